"""Activation memory as the storages a forward leaves alive (tests/test_plan_paths.py): every tensor storage an op
creates during the forward is tracked by a weak reference; those still alive once the forward returns, less the
parameters, the buffers and the loss, are what the graph holds for backward. Unlike a saved_tensors_hooks count this
also sees what activation checkpointing keeps (its own hooks stand between the graph and an outer one)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Track(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[int, StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.made.append((s.data_ptr(), StorageWeakRef(s), s.nbytes()))
        return out


def alive_after_forward(model: torch.nn.Module, batch: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes of the storages the forward made that are alive when it returns (each once; parameters, buffers and the
    loss excluded), under autocast to `dtype` when given; runs the backward too (the graph was real)."""
    buffers = {b.untyped_storage().data_ptr() for b in model.buffers()}
    track = _Track()
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    with track, ctx:
        loss = model(batch)
    # after the forward: a buffer it rebuilt (the rope tables) counts, one it left alone does not
    owned = {p.untyped_storage().data_ptr() for p in model.parameters()}
    owned |= {ptr for b in model.buffers() if (ptr := b.untyped_storage().data_ptr()) in buffers}
    alive = {ptr: n for ptr, ref, n in track.made if not ref.expired() and ptr not in owned}
    alive.pop(loss.untyped_storage().data_ptr(), None)
    loss.backward()
    return sum(alive.values())
