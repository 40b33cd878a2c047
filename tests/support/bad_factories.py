"""Model and data factories that are wrong in the ways users get them wrong (tests/test_bad_input.py)."""

from __future__ import annotations

import torch
from torch import nn


def needs_width(*, width: int, depth: int = 2) -> nn.Module:
    """A model factory with a required argument."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def raising_model(*, dim: int = 4) -> nn.Module:
    """A model factory whose own code fails."""
    return _layers_for(dim)


def _layers_for(dim: int) -> nn.Module:
    raise ValueError(f"user bug: cannot build {dim} layers")


def returns_dict(**kwargs) -> dict:
    """A model factory that returns its state instead of a module."""
    return {"weight": torch.zeros(2)}


def raising_data(*, n: int = 8):
    """A data factory whose own code fails."""
    raise FileNotFoundError(f"user data file for n={n} is missing")


def nan_loss(model: nn.Module, batch) -> torch.Tensor:
    """A loss that is NaN from the first step (the model's own loss times NaN, so it has gradients)."""
    return model(batch) * float("nan")


def fails_on_rank_1(model: nn.Module, batch) -> torch.Tensor:
    """A loss that raises on rank 1 only (the failure report must name that rank, not its victims)."""
    import os

    if os.environ.get("RANK") == "1":
        raise ValueError("user bug: loss exploded on rank 1")
    return model(batch)
