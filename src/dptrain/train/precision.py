"""Mixed precision: autocast for bf16/fp16, dynamic loss scaling only for fp16.

bf16 has fp32's exponent range, so it needs no loss scaling; fp16 does. Under FSDP the
gradients are sharded, so an overflow seen by one rank must stop the step on every rank:
ShardedGradScaler all-reduces the found-inf flag; the plain GradScaler does not need to,
because DDP's gradients are already identical on every rank after the all-reduce.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from dptrain.config import PrecisionConfig
from dptrain.train.loss_scaler import build_deepspeed_scaler

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_factory(cfg: PrecisionConfig, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """The forward-pass context as a factory of fresh contexts, built once (the step enters one per forward): autocast
    to the low-precision dtype, or nothing for fp32."""
    if cfg.dtype == "fp32":
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device.type, dtype=_DTYPES[cfg.dtype])


def build_grad_scaler(cfg: PrecisionConfig, device: torch.device, *, sharded: bool) -> torch.amp.GradScaler:
    """A GradScaler that is enabled only for fp16 (disabled, scale/unscale/step pass straight through);
    precision.loss_scaler=deepspeed (DeepSpeed files): DeepSpeed's scale rule (train/loss_scaler.py)."""
    enabled = cfg.dtype == "fp16"
    if enabled and cfg.loss_scaler == "deepspeed":
        return build_deepspeed_scaler(cfg, device, sharded=sharded)
    kw: dict[str, Any] = {"init_scale": cfg.init_scale, "growth_interval": cfg.growth_interval, "enabled": enabled}
    if sharded and enabled:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type, **kw)
    return torch.amp.GradScaler(device.type, **kw)
