"""Parallelisation: `parallelize_model(model, cfg=..., mesh=..., device=...)` (compose.py) returns a `ParallelModel`
that owns everything which differs by wrapper (gradient-sync context, clipping, state dicts,
optimizer sharding, communication hooks). One small file per technique: `ddp`, `fsdp`, `zero`,
`activation_checkpointing`, `dp`, `single`, `tensor`, `pipeline`; `compose` puts them together in a fixed
order (`parallelize_model`); `clip` (global norm) and `wrapped` (unwrap, full state dict) work on any of them.

The free functions `sync_gradients`, `clip_grad_norm_`, `full_state_dict` and `unwrap` accept a
`ParallelModel` (they delegate to it) or the module it returned (for own loops that keep only the
module), so own loops never branch on the strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from dptrain.config import ParallelConfig
from dptrain.config.layout import resolve_layout
from dptrain.distributed.mesh import ParallelMesh
from dptrain.parallel import clip, wrapped
from dptrain.parallel.compose import parallelize_model
from dptrain.parallel.ddp import apply_ddp
from dptrain.parallel.dp import apply_dp
from dptrain.parallel.fsdp import apply_fsdp
from dptrain.parallel.model import ParallelModel, gradient_sync
from dptrain.parallel.single import apply_single
from dptrain.parallel.wrapped import is_sharded

__all__ = [
    "ParallelModel",
    "parallelize_model",
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

Parallelized = nn.Module | ParallelModel


def apply_strategy(model: nn.Module, *, cfg: ParallelConfig, device: torch.device) -> nn.Module:
    """`parallelize` over a mesh of the current world, returning only the module to call.
    Inside an initialised process group (a world of one is fine). For zero1 the optimizer must come
    from the plan (`parallelize(...).optimizer(cls, ...)`); this returns only DDP's module."""
    import torch.distributed as dist


    dims, _ = resolve_layout(cfg, world_size=dist.get_world_size())
    mesh = ParallelMesh.build(dims, device_type=device.type)
    return parallelize_model(model, cfg=cfg, mesh=mesh, device=device).module


def unwrap(model: Parallelized) -> nn.Module:
    """The user's plain module (inside a DDP/DataParallel wrapper; FSDP2 shards in place)."""
    return model.plain if isinstance(model, ParallelModel) else wrapped.unwrap(model)


@contextlib.contextmanager
def sync_gradients(model: Parallelized, sync: bool) -> Iterator[None]:
    """Wrap a micro-step's forward AND backward: with sync=False, gradients only accumulate locally
    (DDP `no_sync`, FSDP2 `set_requires_gradient_sync(False)`); with sync=True they are reduced."""
    if isinstance(model, ParallelModel):
        with model.sync_gradients(sync):
            yield
    else:
        with gradient_sync(model, sync):
            yield


def clip_grad_norm_(model: Parallelized, max_norm: float | None) -> torch.Tensor:
    """Clip to the global gradient norm over all ranks and shards; return it (a plain tensor)."""
    return (
        model.clip_grad_norm_(max_norm) if isinstance(model, ParallelModel) else clip.clip_grad_norm_(model, max_norm)
    )


def full_state_dict(model: Parallelized) -> dict[str, torch.Tensor]:
    """Consolidated weights under the plain module's names, on CPU. Collective under FSDP2."""
    return model.full_state_dict() if isinstance(model, ParallelModel) else wrapped.full_state_dict(model)
