"""Strategies: plain functions that apply one of PyTorch's parallel APIs to a plain model.

`apply_strategy` picks the function by name; every other helper here works on whatever
the strategy returned (dispatching on the wrapper type), so the training loop and users'
own loops never branch on the strategy name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from dptrain.config import ParallelConfig
from dptrain.parallel.ddp import apply_ddp
from dptrain.parallel.dp import apply_dp
from dptrain.parallel.fsdp import apply_fsdp
from dptrain.parallel.single import apply_single

__all__ = [
    "apply_strategy",
    "sync_gradients",
    "unwrap",
    "clip_grad_norm_",
    "full_state_dict",
    "is_sharded",
    "apply_ddp",
    "apply_dp",
    "apply_fsdp",
    "apply_single",
]


def apply_strategy(model: nn.Module, *, cfg: ParallelConfig, device: torch.device) -> nn.Module:
    """Apply `cfg.strategy` to `model`. zero1 is DDP here; its optimizer is sharded by `build_optimizer`."""
    name = cfg.strategy
    if name == "single":
        return apply_single(model, device=device)
    if name == "dp":
        return apply_dp(model, device=device)
    if name in ("ddp", "zero1"):
        return apply_ddp(model, device=device, bucket_cap_mb=cfg.bucket_cap_mb)
    if name in ("zero2", "fsdp"):
        return apply_fsdp(
            model, device=device, reshard_after_forward=name == "fsdp", cpu_offload=cfg.cpu_offload
        )
    raise ValueError(f"unknown strategy {name!r}; choose one of: single, dp, ddp, zero1, zero2, fsdp")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP/DataParallel wrapper (FSDP2 shards in place: the module itself)."""
    return model.module if isinstance(model, DDP | nn.DataParallel) else model


def is_sharded(model: nn.Module) -> bool:
    """True when parameters are sharded across ranks (FSDP2)."""
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def sync_gradients(model: nn.Module, sync: bool) -> Iterator[None]:
    """Wrap a micro-step's forward AND backward: with sync=False, gradients only accumulate locally
    (DDP `no_sync`, FSDP2 `set_requires_gradient_sync(False)`); with sync=True they are reduced."""
    if sync:
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(True)
        yield
    elif isinstance(model, DDP):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def clip_grad_norm_(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """Clip to the global norm over all ranks' shards and return that norm (a plain tensor).

    With FSDP2 the gradients are sharded DTensors; their norm is reduced across ranks, so every
    rank clips by the same factor. max_norm=None only measures the norm.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm is None:
        norm = torch.nn.utils.get_total_norm([g for p in params if (g := p.grad) is not None])
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The consolidated, unsharded state dict of the user's module on CPU, under the plain module's
    names. Collective under FSDP (call on every rank); the result is complete on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = unwrap(model)
    if is_sharded(module):
        # Typed as DCP's general values; a module's state dict holds only tensors.
        return cast(dict[str, torch.Tensor],
                    get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}
