"""Tiny regression model and data set for fast parity tests and as a custom-factory example."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class MLPBlock(nn.Module):
    """``Linear -> GELU``; one FSDP sharding unit."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(in_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class ToyMLP(nn.Module):
    """MLP regressor whose ``forward(batch)`` returns the MSE loss of ``batch``.

    Built from ``nn.Linear`` only, whose constructors call ``reset_parameters()``: meta-device
    init replays exactly that, so the model needs no init hook of its own."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, depth: int) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        dims = [in_dim] + [hidden] * depth
        self.layers = nn.ModuleList([MLPBlock(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)])
        self.head = nn.Linear(hidden, out_dim)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Model output for inputs ``x`` of shape ``[B, in_dim]``."""
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def forward(
        self, batch: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | None = None, *,
        x: torch.Tensor | None = None, y: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """MSE loss of an ``(x, y)`` tuple/list, a ``{"x", "y"}`` mapping, or ``x=``, ``y=`` keyword
        arguments (a mapping batch under the default loss: ``model(**batch)``)."""
        if batch is not None:
            x, y = (batch["x"], batch["y"]) if isinstance(batch, Mapping) else batch
        if x is None or y is None:
            raise TypeError("ToyMLP.forward needs a batch, or both x= and y=")
        # float32 loss even under autocast, matching the LM's loss convention.
        return F.mse_loss(self.predict(x).float(), y.float())


def build_mlp(*, in_dim: int = 16, hidden: int = 32, out_dim: int = 4, depth: int = 2) -> ToyMLP:
    """Build a :class:`ToyMLP` with ``depth`` hidden blocks in ``model.layers``."""
    return ToyMLP(in_dim, hidden, out_dim, depth)


class RegressionData(Dataset):
    """Map-style data set of ``(x, y)`` float32 pairs held in memory."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return self.x.size(0)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def build_regression_data(
    *, n: int = 512, in_dim: int = 16, out_dim: int = 4, seed: int = 0
) -> RegressionData:
    """``y = x @ W + 0.1 * noise`` with ``x, noise ~ N(0, 1)``, ``W ~ N(0, 1/in_dim)``; fixed by ``seed``."""
    # A private generator: the data must not depend on (or disturb) the global RNG state.
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(in_dim, out_dim, generator=g) / in_dim**0.5
    x = torch.randn(n, in_dim, generator=g)
    y = x @ w + 0.1 * torch.randn(n, out_dim, generator=g)
    return RegressionData(x, y)
