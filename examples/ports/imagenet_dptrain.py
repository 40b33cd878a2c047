"""imagenet_base.py ported to dptrain's own-loop API (docs/guides/porting.md).

    dptrain launch --nproc-per-node 2 examples/ports/imagenet_dptrain.py --epochs 2   # 2 processes
    python examples/ports/imagenet_dptrain.py --epochs 2                                # a world of one

-b stays the total batch at any world size; rank_split="interleaved" gives each rank the samples
DistributedSampler gave it (BatchNorm normalises over them). Checkpoints go to --out after every epoch, with
best_acc1; run it again with more --epochs and it resumes.
"""

import argparse
import json
import os

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import TensorDataset

import dptrain

parser = argparse.ArgumentParser(description="ImageNet-style training")
parser.add_argument("--epochs", default=2, type=int, help="number of total epochs to run")
parser.add_argument("-b", "--batch-size", default=32, type=int, help="the total batch size of all processes")
parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, dest="lr")
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
parser.add_argument("--seed", default=0, type=int)
parser.add_argument("--out", default="runs/imagenet", help="where checkpoints go (and are resumed from)")
parser.add_argument("--losses", default=None, help="write per-step losses and accuracies to this JSON file")
best_acc1 = 0


class Net(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.features(x), 1))


def synthetic_images(n, seed):
    """n seeded 3x16x16 images: one of 10 fixed patterns (the label) under noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    patterns = torch.randn(10, 3, 16, 16, generator=torch.Generator().manual_seed(1234))
    return TensorDataset(0.7 * patterns[labels] + torch.randn(n, 3, 16, 16, generator=g), labels)


def main():
    args = parser.parse_args()
    main_worker(args)


def main_worker(args):
    global best_acc1
    runtime = dptrain.init_distributed()
    torch.manual_seed(args.seed)
    model = Net()
    model = dptrain.parallelize(model, strategy="ddp", device=runtime.device).module

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.5)
    train_dataset, val_dataset = synthetic_images(256, seed=1), synthetic_images(64, seed=2)
    train_loader = dptrain.prepare_dataloader(train_dataset, global_batch_size=args.batch_size, seed=args.seed,
                                              rank_split="interleaved")
    val_loader = dptrain.prepare_eval_dataloader(val_dataset, args.batch_size // runtime.world_size)
    ckpt = dptrain.Checkpointer(args.out, model, optimizer, scheduler, train_loader)
    ckpt.resume()
    best_acc1 = ckpt.extra.get("best_acc1", best_acc1)

    record = {"loss": [], "val": []}
    for epoch in dptrain.epochs(train_loader, args.epochs):
        train(train_loader, model, criterion, optimizer, epoch, record)
        acc1 = validate(val_loader, model, criterion, record)
        scheduler.step()

        is_best = acc1 > best_acc1  # acc1 is the whole set's on every rank: every rank agrees
        best_acc1 = max(acc1, best_acc1)
        ckpt.save(train_loader.step, extra={"best_acc1": best_acc1})
        if is_best:
            dptrain.save_model(model, os.path.join(args.out, "model_best.safetensors"))
    if runtime.is_main and args.losses:
        with open(args.losses, "w") as f:
            json.dump({**record, "best_acc1": best_acc1}, f)


def train(train_loader, model, criterion, optimizer, epoch, record):
    model.train()
    for i, (images, target) in enumerate(train_loader):
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        record["loss"].append(loss.item())
        if i % 4 == 0:
            dptrain.print0(f"Epoch: [{epoch}][{i}/{len(train_loader)}]\tLoss {loss.item():.4e}")


def validate(val_loader, model, criterion, record):
    model.eval()
    correct, total = torch.zeros(1), torch.zeros(1)
    with torch.no_grad():
        for images, target in val_loader:
            output = model(images)
            pred, target = dptrain.gather_for_metrics((output.argmax(1), target), val_loader)
            correct += (pred == target).sum()
            total += len(target)
    acc1 = 100.0 * correct.item() / total.item()
    record["val"].append(acc1)
    dptrain.print0(f" * Acc@1 {acc1:.3f}")
    return acc1


if __name__ == "__main__":
    main()
