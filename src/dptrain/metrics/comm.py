"""Measured gradient communication: bytes sent per rank, communication time, exposed communication.

`CommMeter.wrap(state, hook, payload_bytes)` wraps a DDP communication hook (torch's
`default_hooks.allreduce_hook` when `log.comm_times` asks for the times and no compression is
configured, or the `CommHook` of `parallel/comm_hooks.py`). Without either, DDP reduces with its
built-in C++ all-reduce (no Python per bucket) and the bytes are the gradients' (`ddp_grad_bytes`,
counted once at setup), the times null. Per bucket it records the launch time (in the hook) and the completion
time (in a callback chained on the hook's future; DDP waits on the chained future, so the time is
recorded before `backward()` returns). At the first bucket of a backward it queues an autograd
final callback that queues a second one: it runs after DDP's own finalizer (queued when the last
bucket was launched; it waits for every bucket), i.e. where `backward()` returns.

Definitions (per optimizer step; a logged record holds the mean over its log window):

- `comm_bytes`: bytes this rank SENDS under the bandwidth-optimal ring algorithm of each collective:
  all-reduce 2(n-1)/n x payload, all-gather and reduce-scatter (n-1)/n x the full (unsharded)
  tensor, n the group size. It is NCCL-tests' "bus bytes", what crosses this rank's link; gloo's
  and NCCL's tree algorithms send about as much. At n = 1 it is 0.
- `comm_s`: the union of the buckets' in-flight intervals [launch, completion]: wall time during
  which at least one gradient collective was outstanding (overlapping buckets count once).
- `exposed_comm_s`: from the launch of the last bucket (the end of backward's compute, as far as
  communication is concerned) to the end of `backward()` (DDP's finalizer has waited for every
  bucket): the communication the step waits for, not hidden behind backward compute.

On CPU the times are host clocks (`time.perf_counter`). On CUDA they are CUDA events recorded on
the current stream (the callbacks of a CUDA future run on streams that wait for the collective),
resolved only when a window is read, which is a log step, so the meter adds no per-step
host-device sync; it never issues a collective. (The CUDA path is written, not yet run on a GPU.)

FSDP2 (zero2, fsdp, HSDP) issues its collectives inside its own hooks, with no public completion
callback in the step path: bytes come from the parameters' shapes and dtypes (`fsdp_comm_bytes`,
computed once), times are logged as null. Tensor and pipeline parallelism: not counted (null).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

PayloadBytes = Callable[[Any], int]


def ring_bytes(collective: str, payload: float, n: int) -> float:
    """Bytes one rank sends for `collective` of `payload` bytes (the full tensor) over `n` ranks."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n * payload
    if collective in ("all_gather", "reduce_scatter", "broadcast"):
        return (n - 1) / n * payload
    raise ValueError(f"unknown collective {collective!r}; expected all_reduce, all_gather, reduce_scatter or broadcast")


def bucket_payload(bucket: Any) -> int:
    """Bytes of a DDP bucket's flat gradient buffer (what the default all-reduce hook hands to gloo/NCCL)."""
    buf = bucket.buffer()
    return buf.numel() * buf.element_size()


@dataclass(frozen=True)
class FixedBytes:
    """Analytic bytes sent per rank: per micro-step (FSDP2 all-gathers), per gradient sync
    (reduce-scatter, HSDP all-reduce) and per optimizer step (ZeRO-1's parameter broadcast)."""

    per_micro: float = 0.0
    per_sync: float = 0.0
    per_step: float = 0.0


class _Clock:
    """Host time on CPU; CUDA events (recorded now, read later) on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, marks: list[Any]) -> list[float]:
        """Marks as seconds on a common (arbitrary) origin; waits for CUDA events (log steps only)."""
        if not self.cuda or not marks:
            return [float(m) for m in marks]
        for ev in marks:
            ev.synchronize()
        return [marks[0].elapsed_time(ev) / 1e3 for ev in marks]


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class CommMeter:
    """Per-step communication of one rank. `wrap` meters a DDP hook; `step_done` closes a step;
    `window` returns (and resets) the means since the last call; `summary` the run's means."""

    def __init__(self, *, group_size: int, device: torch.device, fixed: FixedBytes | None = None,
                 timed: bool = True) -> None:
        self.n = group_size
        self.fixed = fixed or FixedBytes()
        self.timed = timed
        self.clock = _Clock(device)
        self._bytes = 0.0  # this step's metered bytes
        self._backwards: list[tuple[list[Any], list[Any], Any]] = []  # (launches, completions, end) per backward
        self._launch: list[Any] = []
        self._done: list[Any] = []
        self._in_backward = False
        self._window: list[tuple[int, float, list[tuple[list[Any], list[Any], Any]]]] = []  # (steps, bytes, ...)
        self._run = {"steps": 0, "bytes": 0.0, "comm_s": 0.0, "exposed_s": 0.0}
        self.outside: Callable[[], float] | None = None
        """Bytes sent outside the hook since the last call (onebit_adam's momentum exchange), added per step."""

    # ---------------------------------------------------------------- DDP hook
    def wrap(
        self, state: Any, hook: Callable[[Any, Any], torch.futures.Future], payload_bytes: PayloadBytes,
        *, collective: Callable[[Any], str] | None = None,
    ) -> tuple[Any, Callable[[Any, Any], torch.futures.Future]]:
        """(state, hook) for `DDP.register_comm_hook`: `hook` metered. `payload_bytes(bucket)`: bytes this
        rank hands to the collective for the bucket in the call just made; `collective(bucket)`: which
        one that call used (default all_reduce). The ring factor is applied here: an all-reduce of p
        bytes sends 2(n-1)/n * p, an all-gather of this rank's p bytes sends (n-1) * p."""
        n = self.n

        def sent(bucket: Any) -> float:
            kind = "all_reduce" if collective is None else collective(bucket)
            p = payload_bytes(bucket)
            return ring_bytes(kind, p * n if kind == "all_gather" else p, n)

        def metered(st, bucket):  # DDP refuses string annotations here
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._queue_end)
            slot = len(self._launch)
            self._launch.append(self.clock.mark())
            self._done.append(None)
            fut = hook(st, bucket)
            self._bytes += sent(bucket)

            def finished(f: torch.futures.Future) -> Any:
                self._done[slot] = self.clock.mark()
                return f.value()

            return fut.then(finished)  # DDP waits on this one: the time is in before backward() returns

        return state, metered

    def _queue_end(self) -> None:
        # Runs among autograd's final callbacks, before DDP's finalizer (queued later, at the last
        # bucket); a callback queued from here runs after it.
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self) -> None:
        self._backwards.append((self._launch, self._done, self.clock.mark()))
        self._launch, self._done, self._in_backward = [], [], False

    # ---------------------------------------------------------------- steps and windows
    def step_done(self, *, micro_steps: int = 1, sync_steps: int = 1) -> None:
        """Close one optimizer step (`micro_steps` forwards/backwards, `sync_steps` of them reducing)."""
        self.steps_done(1, micro_steps=micro_steps, sync_steps=sync_steps)

    def steps_done(self, steps: int, *, micro_steps: int = 1, sync_steps: int = 1) -> None:
        """Close `steps` optimizer steps at once (each `micro_steps` forwards/backwards, `sync_steps` of them
        reducing): the trainer hands its steps over at log steps, not one call per step."""
        if steps <= 0:
            return
        fixed = self.fixed
        sent = self._bytes + steps * (fixed.per_micro * micro_steps + fixed.per_sync * sync_steps + fixed.per_step)
        if self.outside is not None:
            sent += self.outside()
        self._window.append((steps, sent, self._backwards))
        self._bytes, self._backwards = 0.0, []

    def _times(self, backwards: list[tuple[list[Any], list[Any], Any]]) -> tuple[float, float]:
        comm = exposed = 0.0
        for launch, done, end in backwards:
            t = self.clock.seconds([*launch, *[d if d is not None else end for d in done], end])
            k = len(launch)
            comm += union_length(list(zip(t[:k], t[k : 2 * k], strict=True)))
            exposed += max(t[-1] - max(t[:k]), 0.0)
        return comm, exposed

    def window(self) -> dict[str, float | None]:
        """Means per step since the last call (a log record's fields); resets the window."""
        parts, self._window = self._window, []
        n = sum(k for k, _, _ in parts)
        if not n:
            return {}
        total = sum(b for _, b, _ in parts)
        comm = exposed = 0.0
        for _, _, backwards in parts:
            c, e = self._times(backwards)
            comm, exposed = comm + c, exposed + e
        run = self._run
        run["steps"] += n
        run["bytes"] += total
        run["comm_s"] += comm
        run["exposed_s"] += exposed
        return {
            "comm_bytes": total / n,
            "comm_s": comm / n if self.timed else None,
            "exposed_comm_s": exposed / n if self.timed else None,
        }

    def summary(self) -> dict[str, float | None]:
        """Run means per step of everything windowed so far (flush with `window()` first)."""
        run, n = self._run, max(self._run["steps"], 1)
        return {
            "comm_bytes": run["bytes"] / n,
            "comm_bytes_total": run["bytes"],
            "comm_s": run["comm_s"] / n if self.timed else None,
            "exposed_comm_s": run["exposed_s"] / n if self.timed else None,
        }


# -------------------------------------------------------------------- FSDP2 and ZeRO-1 bytes
def _own_params(module: nn.Module, fsdp_modules: set[int]) -> list[nn.Parameter]:
    """Parameters `module` manages itself: not inside a descendant that is sharded on its own."""
    skip: set[int] = set()
    for child in module.modules():
        if child is not module and id(child) in fsdp_modules:
            skip.update(id(p) for p in child.parameters())
    return [p for p in module.parameters() if id(p) not in skip]


def fsdp_comm_bytes(
    model: nn.Module,
    *,
    shard: int,
    replicate: int = 1,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> FixedBytes:
    """Bytes one rank sends per micro-step and per gradient sync under FSDP2 `fully_shard` units.

    Each unit all-gathers its parameters (dim 0 padded to a multiple of `shard`, as FSDP2 does) in
    `param_dtype` in forward, and again in backward when it reshards after forward (dptrain passes
    the bool explicitly, so the root does too; FSDP2 keeps the root unsharded only in its
    `reshard_after_forward=None` default); gradients are reduce-scattered in `reduce_dtype`
    (default: the parameter dtype) and, with `replicate` > 1 (HSDP), the shard is all-reduced across replicas."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    ids = {id(m) for m in units}
    per_micro = per_sync = 0.0
    for unit in units:
        gathers = 2 if reshard_after_forward else 1
        for p in _own_params(unit, ids):
            shape = tuple(p.shape)  # global shape (DTensor)
            rows = -(-shape[0] // shard) * shard if shape else shard
            numel = rows * math.prod(shape[1:])
            pd = param_dtype or p.dtype
            rd = reduce_dtype or pd
            per_micro += gathers * ring_bytes("all_gather", numel * pd.itemsize, shard)
            if not p.requires_grad:  # frozen (LoRA's base): gathered for compute, never reduced
                continue
            per_sync += ring_bytes("reduce_scatter", numel * rd.itemsize, shard)
            per_sync += ring_bytes("all_reduce", numel / shard * rd.itemsize, replicate)
    return FixedBytes(per_micro=per_micro, per_sync=per_sync)


def ddp_grad_bytes(model: nn.Module, *, n: int) -> float:
    """DDP's gradient reduction without a hook: one all-reduce of every trainable parameter's gradient per
    gradient sync (its buckets hold exactly those, in the parameters' dtypes), sent by the ring rule."""
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return ring_bytes("all_reduce", total, n)


def zero1_broadcast_bytes(model: nn.Module, *, n: int) -> float:
    """ZeRO-1: after each step every rank broadcasts its updated partition: (n-1)/n x all parameters."""
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return ring_bytes("broadcast", total, n)
