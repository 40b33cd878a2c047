"""A DDP script in the shape of pytorch/examples imagenet/main.py: mp.spawn, DistributedSampler, -b as the total
batch of all processes, a BatchNorm conv net, SGD + StepLR, top-1 accuracy, save_checkpoint with is_best and
best_acc1, --resume. On a small synthetic image set (seeded noisy 3x16x16 images of 10 patterns): nothing to
download.

    python examples/ports/imagenet_base.py --world-size 2 --epochs 2

Its port is imagenet_dptrain.py (docs/guides/porting.md shows the diff).
"""

import argparse
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser(description="ImageNet-style training")
parser.add_argument("--epochs", default=2, type=int, help="number of total epochs to run")
parser.add_argument("-b", "--batch-size", default=32, type=int, help="the total batch size of all processes")
parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, dest="lr")
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
parser.add_argument("--resume", default="", type=str, help="path to latest checkpoint")
parser.add_argument("--seed", default=0, type=int)
parser.add_argument("--world-size", default=1, type=int, help="number of processes (mp.spawn)")
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456", type=str)
parser.add_argument("--out", default="runs/imagenet", help="where checkpoints go")
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
    mp.spawn(main_worker, nprocs=args.world_size, args=(args,))


def main_worker(rank, args):
    global best_acc1
    dist.init_process_group("gloo", init_method=args.dist_url, world_size=args.world_size, rank=rank)
    torch.manual_seed(args.seed)
    model = Net()
    model = nn.parallel.DistributedDataParallel(model)
    args.batch_size = int(args.batch_size / args.world_size)  # -b is the total over all processes

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.5)
    args.start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        args.start_epoch = checkpoint["epoch"]
        best_acc1 = checkpoint["best_acc1"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])

    train_dataset, val_dataset = synthetic_images(256, seed=1), synthetic_images(64, seed=2)
    train_sampler = DistributedSampler(train_dataset, seed=args.seed)
    val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=False, sampler=train_sampler)
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, shuffle=False, sampler=val_sampler)

    record = {"loss": [], "val": []}
    for epoch in range(args.start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, record)
        acc1 = validate(val_loader, model, criterion, record)
        scheduler.step()

        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if rank == 0:
            save_checkpoint({
                "epoch": epoch + 1,
                "state_dict": model.state_dict(),
                "best_acc1": best_acc1,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            }, is_best, args.out)
    if rank == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump({**record, "best_acc1": best_acc1}, f)
    dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer, epoch, record):
    model.train()
    for i, (images, target) in enumerate(train_loader):
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        record["loss"].append(loss.item())
        if i % 4 == 0 and dist.get_rank() == 0:
            print(f"Epoch: [{epoch}][{i}/{len(train_loader)}]\tLoss {loss.item():.4e}")


def validate(val_loader, model, criterion, record):
    model.eval()
    correct, total = torch.zeros(1), torch.zeros(1)
    with torch.no_grad():
        for images, target in val_loader:
            output = model(images)
            correct += (output.argmax(1) == target).sum()
            total += len(target)
    dist.all_reduce(correct)
    dist.all_reduce(total)
    acc1 = 100.0 * correct.item() / total.item()
    record["val"].append(acc1)
    if dist.get_rank() == 0:
        print(f" * Acc@1 {acc1:.3f}")
    return acc1


def save_checkpoint(state, is_best, out, filename="checkpoint.pth.tar"):
    os.makedirs(out, exist_ok=True)
    torch.save(state, os.path.join(out, filename))
    if is_best:
        shutil.copyfile(os.path.join(out, filename), os.path.join(out, "model_best.pth.tar"))


if __name__ == "__main__":
    main()
