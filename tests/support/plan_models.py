"""Model and data factories for tests/test_plan_measure.py: a small CNN (convolutions, batch norm,
blocks in an nn.ModuleList), its image data, and token data with a `seq_len` for the LLaMA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class ConvBlock(nn.Module):
    """3x3 convolution, batch norm, ReLU: one FSDP unit."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class SmallCNN(nn.Module):
    """Stem convolution, `depth` ConvBlocks, global average pooling, a linear classifier;
    `forward((x, y))` returns the cross-entropy loss."""

    def __init__(self, channels: int, depth: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList([ConvBlock(channels) for _ in range(depth)])
        self.head = nn.Linear(channels, classes)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x.mean(dim=(2, 3))).float(), y)


def build_cnn(*, channels: int = 8, depth: int = 3, classes: int = 5) -> SmallCNN:
    return SmallCNN(channels, depth, classes)


class Images(Dataset):
    def __init__(self, n: int, size: int, classes: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, size, size, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def build_images(*, n: int = 16, size: int = 12, classes: int = 5) -> Images:
    return Images(n, size, classes)


class Tokens(Dataset):
    """Random token sequences of `seq_len + 1` ids (inputs and shifted targets), like the corpus."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.seq_len = seq_len
        self.ids = torch.randint(0, vocab, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def build_tokens(*, n: int = 16, seq_len: int = 24, vocab: int = 256) -> Tokens:
    return Tokens(n, seq_len, vocab)
