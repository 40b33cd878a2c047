"""One rank's memory under FSDP2 as the planner splits it (benchmarks/memory/bf16_memory.py,
tests/test_plan_measure.py):
the local shards' bytes of parameters, gradients and optimizer state, and the activations a forward leaves alive
(the method of support/alive.py, on a real FSDP2 module: the storages the forward created that are still allocated
when it returns, each once at its current size, less the parameters' storages: the shards and FSDP2's unsharded
parameters, which are the plan's `temporary`, and the loss)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dptrain import api
from dptrain.config import OptimConfig
from dptrain.models.llama import build_llama
from dptrain.train.optim import build_optimizer


class _Made(TorchDispatchMode):
    """A weak reference to every storage an op created or returned, each once. Keyed by the storage itself (the
    weak reference keeps its address from being reused), not by its data address: FSDP2 frees its all-gather
    buffers by resizing their storages to 0, and the data address then freed is reused by later tensors, so a
    key by data address counted one storage for another depending on the heap's history (glibc's mmap threshold
    changed the count: train.malloc_mmap_threshold_kib, set by an earlier in-process run)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not hasattr(t, "to_local"):
                ref = StorageWeakRef(t.untyped_storage())
                self.refs.setdefault(ref.cdata, ref)
        return out

    def alive(self, owned: set[int]) -> int:
        """Bytes of the tracked storages still alive, each at its current size, less those at `owned` addresses."""
        live = (torch.UntypedStorage._new_with_weak_ptr(ref.cdata) for ref in self.refs.values() if not ref.expired())
        return sum(s.nbytes() for s in live if s.data_ptr() not in owned)


def settled(measure: Callable[[], int], *, polls: int = 3, wait_s: float = 2.0) -> int:
    """`measure()` once gloo has let go of the buffers of the collectives already waited for: a gloo Work's tensors
    are released by its worker thread just after the waiting thread wakes, so a buffer about to be freed (FSDP2's
    all-gather output, a K/V gather) can still be alive for a moment on a loaded machine. The reading that stays the
    same over `polls` polls 10 ms apart (or the last one after `wait_s`)."""
    last, same = measure(), 0
    deadline = time.monotonic() + wait_s
    while same < polls and time.monotonic() < deadline:
        time.sleep(0.01)
        now = measure()
        same = same + 1 if now == last else 0
        last = now
    return last


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _param_storages(module: torch.nn.Module) -> set[int]:
    """Storage addresses of the local shards and of FSDP2's unsharded parameters (gathered or freed)."""
    out = {_local(p).untyped_storage().data_ptr() for p in module.parameters()}
    for m in module.modules():
        state = getattr(m, "_get_fsdp_state", None)
        for group in state()._fsdp_param_groups if state else []:
            for fp in group.fsdp_params:
                t = getattr(fp, "_unsharded_param", None)
                if isinstance(t, torch.Tensor):
                    out.add(t.untyped_storage().data_ptr())
    return out


def fsdp_llama_memory(model_kwargs: dict, batch: torch.Tensor, *, param_dtype: str | None,
                      activation_checkpointing: str = "none") -> dict[str, int]:
    """After `init_distributed`: the built-in LLaMA under fsdp (reduce in fp32), bf16 autocast, AdamW, the given
    activation checkpointing; one warm-up step, then the bytes of this rank's params, grads, optimizer state and
    activations (module docstring)."""
    torch.manual_seed(0)
    pm = api.parallelize(build_llama(**model_kwargs), strategy="fsdp", device=torch.device("cpu"),
                         fsdp_param_dtype=param_dtype, fsdp_reduce_dtype="fp32",
                         activation_checkpointing=activation_checkpointing)
    try:
        opt = build_optimizer(pm, cfg=OptimConfig(), lr=1e-3)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the warm-up step: the optimizer state exists
            loss = pm.module(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        track = _Made()
        with track, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pm.module(batch)
        owned = _param_storages(pm.module) | {loss.untyped_storage().data_ptr()}
        activations = settled(lambda: track.alive(owned))
        loss.backward()
        opt.step()
        params = list(pm.module.parameters())
        return {
            "params": sum(_nbytes(p) for p in params),
            "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(_nbytes(v) for s in opt.state.values() for v in s.values() if v.dim() > 0),
            "activations": activations,
        }
    finally:
        pm.release()
