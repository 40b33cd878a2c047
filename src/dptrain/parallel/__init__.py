"""Parallelisation: a plain model made data-, tensor- or pipeline-parallel, behind one `ParallelModel`.

This module's own functions take a `ParallelModel` (they delegate to it) or the module it returned (own loops that
keep only the module), so own loops never branch on the strategy:

- `unwrap(model)`: the user's plain module (inside a DDP/DataParallel wrapper; FSDP2 shards in place);
- `sync_gradients(model, sync)`: the context for a micro-step's forward and backward (no reduction with False);
- `clip_grad_norm_(model, max_norm)`: the global gradient norm over every rank and shard, clipped;
- `full_state_dict(model)`: the consolidated weights on the CPU (collective under FSDP2).

Re-exported from the files that define them: `ParallelModel` (model.py; the owner of everything that differs by
wrapper: gradient-sync context, clipping, state dicts, optimizer sharding, communication hooks),
`parallelize_model` (compose.py: the internal engine, taking a `ParallelConfig` and a mesh, behind the Trainer and
`dptrain.parallelize`, the one public way to parallelise a model), `is_sharded` (wrapped.py) and the techniques'
`apply_ddp`, `apply_dp`, `apply_fsdp`, `apply_single` (one small file each, like `tensor`, `pipeline`,
`activation_checkpointing`, `zero`; compose.py applies them in a fixed order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

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
