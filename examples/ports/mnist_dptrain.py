"""mnist_base.py ported to data parallelism with dptrain's own-loop API (docs/guides/porting.md).

    dptrain launch --nproc-per-node 2 examples/ports/mnist_dptrain.py --epochs 3   # 2 processes
    python examples/ports/mnist_dptrain.py --epochs 3                                # a world of one

The global batch stays --batch-size at any world size. Checkpoints go to --out at the end of every epoch;
run it again (at any world size) with more --epochs and it resumes.
"""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import TensorDataset

import dptrain


class Net(nn.Module):
    def __init__(self, dropout=True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)
        self.fc1 = nn.Linear(2304, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def synthetic_mnist(n, seed):
    """n seeded 1x28x28 images: one of 10 fixed patterns (the label) under twice its amount of noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234))
    return TensorDataset(0.5 * patterns[labels] + torch.randn(n, 1, 28, 28, generator=g), labels)


def train(args, model, device, train_loader, optimizer, epoch, losses):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        losses.append(dptrain.all_reduce_mean(loss.detach()).item())  # the global batch's loss
        if batch_idx % args.log_interval == 0:
            dptrain.print0(f'Train Epoch: {epoch} [{batch_idx * args.batch_size}/{len(train_loader.dataset)} '
                  f'({100. * batch_idx / len(train_loader):.0f}%)]\tLoss: {losses[-1]:.6f}')


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            loss, pred = F.nll_loss(output, target, reduction='none'), output.argmax(dim=1)
            loss, pred, target = dptrain.gather_for_metrics((loss, pred, target), test_loader)
            test_loss += loss.sum().item()
            correct += pred.eq(target).sum().item()
    test_loss /= len(test_loader.dataset)
    dptrain.print0(f'\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)} '
          f'({100. * correct / len(test_loader.dataset):.0f}%)\n')
    return {"test_loss": test_loss, "correct": correct}


def main():
    parser = argparse.ArgumentParser(description='MNIST-style example on synthetic data')
    parser.add_argument('--batch-size', type=int, default=64, help='input batch size for training (default: 64)')
    parser.add_argument('--test-batch-size', type=int, default=50, help='input batch size for testing (default: 50)')
    parser.add_argument('--epochs', type=int, default=3, help='number of epochs to train (default: 3)')
    parser.add_argument('--lr', type=float, default=1.0, help='learning rate (default: 1.0)')
    parser.add_argument('--gamma', type=float, default=0.7, help='learning rate step gamma (default: 0.7)')
    parser.add_argument('--seed', type=int, default=1, help='random seed (default: 1)')
    parser.add_argument('--log-interval', type=int, default=4, help='batches between logs (default: 4)')
    parser.add_argument('--no-dropout', action='store_true', help='train without dropout')
    parser.add_argument('--save-model', action='store_true', help='save the model to mnist_cnn.pt')
    parser.add_argument('--out', default='runs/mnist', help='checkpoint directory (default: runs/mnist)')
    parser.add_argument('--losses', help='write the per-step losses and test results to this JSON file')
    args = parser.parse_args()

    runtime = dptrain.init_distributed()
    torch.manual_seed(args.seed)
    device = runtime.device

    train_set, test_set = synthetic_mnist(512, args.seed), synthetic_mnist(131, args.seed + 1)
    train_loader = dptrain.prepare_dataloader(train_set, global_batch_size=args.batch_size, seed=args.seed)
    test_loader = dptrain.prepare_eval_dataloader(test_set, batch_size=args.test_batch_size)

    model = dptrain.parallelize(Net(dropout=not args.no_dropout), device=device).module
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    ckpt = dptrain.Checkpointer(args.out, model, optimizer, scheduler, train_loader)
    ckpt.resume()  # model, optimizer, scheduler, RNG and data position, when --out holds a checkpoint
    losses, tests = [], []
    for epoch in dptrain.epochs(train_loader, args.epochs):
        train(args, model, device, train_loader, optimizer, epoch + 1, losses)
        tests.append(test(model, device, test_loader))
        scheduler.step()
        ckpt.save(train_loader.step)
    ckpt.close()

    if args.save_model:
        dptrain.save_model(model, "mnist_cnn.pt")
    if args.losses and runtime.is_main:
        with open(args.losses, "w") as f:
            json.dump({"loss": losses, "test": tests}, f)


if __name__ == '__main__':
    main()
