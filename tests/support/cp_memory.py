"""One context-parallel rank's activation memory, measured the way the planner counts it, and one training step
at a cp degree (tests/test_cp_memory.py, benchmarks/memory/cp_memory.py).

The built-in LLaMA is parallelised exactly as `dptrain run` does it (`parallel.strategy=ddp`, `parallel.cp`: the mesh,
`apply_cp`'s attention: the gathered K/V, on this CPU blockwise with no mask (parallel/cp_attention.py), or Ulysses'
all-to-all on heads (parallel/ulysses.py), DDP over dp x cp), the row is cut into this rank's chunks by the plan's
`ContextParallel.shard`, and after a warm-up step the activations are the storages the forward created that are still
alive when it returns, each once at its current size, less the parameters and the loss (two warm-up steps first: DDP
rebuilds its gradient buckets in the second forward, the plan's `temporary`) (the method of support/alive.py and
support/fsdp_alive.py, storages tracked by identity). On the SDPA path (off the CPU) the rank's cached causal mask would
be dropped before the measured forward, so the mask it makes again (and every layer shares)
is counted once.

Storages of the functional collective's autograd wrapper are views of the all-gather's output (counted there) and
cannot be read back through a weak reference: they are skipped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dptrain.config import ParallelConfig
from dptrain.config.layout import resolve_layout
from dptrain.distributed.mesh import ParallelMesh
from dptrain.models.llama import build_llama
from dptrain.parallel import context, parallelize_model
from support.fsdp_alive import _Made, settled

STRATEGY = "ddp"


def _alive(track: _Made, owned: set[int]) -> int:
    """Bytes of the tracked storages still alive (each once, at its current size), less those at `owned` addresses;
    storages that cannot be read back (the collective's wrapper views) skipped."""
    total = 0
    for ref in track.refs.values():
        if ref.expired():
            continue
        storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        try:
            ptr = storage.data_ptr()
        except RuntimeError:  # a wrapper subclass's storage: a view of the gathered tensor, counted there
            continue
        if ptr not in owned:
            total += storage.nbytes()
    return total


def build_cp_model(model_kwargs: dict[str, Any], *, cp: int, attention: str = "auto") -> Any:
    """After the process group is up: the built-in LLaMA parallelised as `dptrain run` would with
    `parallel.strategy=ddp parallel.cp=cp parallel.cp_attention=attention` on this world (the ParallelModel; its
    `.context` splits batches)."""
    cfg = ParallelConfig(strategy=STRATEGY, cp=cp, cp_attention=attention)
    dims, _ = resolve_layout(cfg, world_size=dist.get_world_size())
    mesh = ParallelMesh.build(dims, device_type="cpu")
    torch.manual_seed(0)
    return parallelize_model(build_llama(**model_kwargs), cfg=cfg, mesh=mesh, device=torch.device("cpu"))


def rank_batch(pm: Any, *, seq: int, vocab: int, batch: int = 1) -> Any:
    """A row of `seq` inputs (+1 target), the same on every rank (the cp ranks of a dp rank load the same rows), cut
    to this rank's chunks."""
    rows = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return pm.context.shard(rows) if pm.context is not None else rows


def measure_activations(model_kwargs: dict[str, Any], seq: int, cp: int, attention: str = "auto") -> int:
    """This rank's activation bytes for one row of `seq` tokens under `parallel.cp=cp` and `parallel.cp_attention`
    (module docstring)."""
    pm = build_cp_model(model_kwargs, cp=cp, attention=attention)
    try:
        mine = rank_batch(pm, seq=seq, vocab=model_kwargs.get("vocab_size", 256))
        for _ in range(2):  # warm-up: the rope tables exist, DDP has rebuilt its buckets (in the 2nd forward)
            pm.module(mine).backward()
            pm.module.zero_grad(set_to_none=True)
        context._causal_bias.cache_clear()  # counted once, where the measured forward makes it
        track = _Made()
        with track:
            loss = pm.module(mine)
        # the rope tables (buffers) count: the forward's slices of them are saved for backward (plan/llama.py)
        owned = {p.untyped_storage().data_ptr() for p in pm.module.parameters()}
        activations = settled(lambda: _alive(track, owned | {loss.untyped_storage().data_ptr()}))
        loss.backward()
        return activations
    finally:
        pm.release()


def train_step(model_kwargs: dict[str, Any], seq: int, cp: int, attention: str = "auto") -> float:
    """Train one SGD step on this rank's chunks (forward, backward with DDP's all-reduce over dp x cp, step) and
    return its loss: the row of `seq` tokens trains at this cp degree (and `parallel.cp_attention`)."""
    pm = build_cp_model(model_kwargs, cp=cp, attention=attention)
    try:
        opt = torch.optim.SGD(pm.module.parameters(), lr=0.01)
        loss = pm.module(rank_batch(pm, seq=seq, vocab=model_kwargs.get("vocab_size", 256)))
        loss.backward()
        opt.step()
        return float(loss.detach())
    finally:
        pm.release()


def on_ranks(rank: int, fn: Any, *args: Any) -> Any:
    """`fn(*args)` on a forked rank (support/mp.run_ranks) inside its own gloo process group."""
    from dptrain import api

    torch.set_num_threads(1)
    api.init_distributed(device="cpu")
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()
