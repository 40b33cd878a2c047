"""Models whose blocks nest their own ModuleLists (the case that crashed parent-first FSDP sharding),
and one without blocks (tests/test_layout.py, tests/test_mesh.py)."""

from __future__ import annotations

import torch
from torch import nn


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return torch.tanh(self.lin(x))


class Block(nn.Module):
    """A block that nests its own ModuleList (the case that crashed parent-first sharding)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList([Inner(), Inner()])
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.inner:
            x = m(x)
        return self.out(x)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 1)

    def forward(self, batch) -> torch.Tensor:
        x, y = batch
        for b in self.blocks:
            x = b(x)
        return torch.nn.functional.mse_loss(self.head(x).squeeze(-1), y)


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Inner()
        self.b = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))
