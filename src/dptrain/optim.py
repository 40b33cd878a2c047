"""Optimizer and learning-rate schedule built from `OptimConfig`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from dptrain.config import OptimConfig


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; leave biases and norm gains (1-D tensors) undecayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def optimizer_spec(cfg: OptimConfig, *, lr: float) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """(optimizer class, its keyword arguments) for `cfg`: SGD, Adam or AdamW."""
    if cfg.name == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": cfg.momentum}
    if cfg.name == "adam":
        return torch.optim.Adam, {"lr": lr, "betas": cfg.betas, "eps": cfg.eps}
    if cfg.name == "adamw":
        return torch.optim.AdamW, {"lr": lr, "betas": cfg.betas, "eps": cfg.eps}
    raise ValueError(f"optim.name={cfg.name!r} is not valid; choose one of: sgd, adam, adamw")


def build_optimizer(
    model: nn.Module, *, cfg: OptimConfig, lr: float, shard_state: bool = False, process_group: Any = None,
) -> torch.optim.Optimizer:
    """SGD/Adam/AdamW over `model`'s parameters. shard_state=True (ZeRO-1) partitions the optimizer
    state over `process_group`'s ranks with ZeroRedundancyOptimizer (see parallel/zero.py). The
    trainer builds it through its `ParallelModel`, which knows whether to shard."""
    groups = param_groups(model, weight_decay=cfg.weight_decay)
    cls, kw = optimizer_spec(cfg, lr=lr)
    if shard_state:
        from dptrain.parallel.zero import zero_redundancy_optimizer

        return zero_redundancy_optimizer(groups, optimizer_class=cls, process_group=process_group, **kw)
    return cls(groups, **kw)


def lr_lambda(step: int, *, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at `step`: linear warmup, then cosine/linear decay or constant."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, *, cfg: OptimConfig, max_steps: int) -> LambdaLR:
    def fn(step: int) -> float:
        return lr_lambda(
            step, warmup_steps=cfg.warmup_steps, max_steps=max_steps, schedule=cfg.schedule,
            min_lr_ratio=cfg.min_lr_ratio,
        )

    return LambdaLR(optimizer, fn)
