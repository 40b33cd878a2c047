"""DDP communication hooks for `parallel.grad_compression` (ddp, zero1): what each compresses,
its per-rank state for checkpoints, and the bytes it hands to collectives.

- fp16 / bf16: torch's `default_hooks.fp16_compress_hook` / `bf16_compress_hook` (cast, average,
  all-reduce, cast back); stateless. Under FSDP2 the same values set MixedPrecisionPolicy's
  reduce dtype instead (`config/compression.py:fsdp_reduce_dtype`); no hook is built then.
- powersgd: torch's `powerSGD_hook.powerSGD_hook` with `PowerSGDState` (error feedback and warm
  start on), wrapped only to record the bucket layout and the bytes sent.
- onebit: `dptrain/parallel/onebit.py`.
- onebit_adam (`optim.name`, not a grad_compression): `dptrain/parallel/momentum_exchange.py`, the
  warm-up's all-reduce and, after it, no reduction at all; its optimizer exchanges the momentum.

Where a compression applies and what is refused is checked before launch (config/compression.py).
Stateful hooks save their per-bucket tensors per parameter (parallel/bucket_layout.py), so a resumed
run continues bit-identically although DDP lays its buckets out differently in a fresh process.
"""

# No `from __future__ import annotations`: DDP checks the hook's `bucket` and return annotations
# against the real classes.

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from dptrain.config.compression import CAST
from dptrain.config.fields import OptimConfig, ParallelConfig
from dptrain.config.layout import strategy_mode
from dptrain.parallel import momentum_exchange, onebit
from dptrain.parallel.bucket_layout import BucketLayout, Pieces

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class CommHook:
    """A compression as DDP takes it (`register_comm_hook(state, hook)`), plus what the trainer and
    the meters need: the bytes of the last call per bucket and the per-rank state for checkpoints."""

    name: str
    """The grad_compression value."""
    state: Any
    """What DDP.register_comm_hook gets as `state`."""
    hook: Hook
    payload_bytes: Callable[[dist.GradBucket], int]
    """Bytes THIS rank handed to collectives for this bucket in the hook call just made."""
    collective: Callable[[dist.GradBucket], str] = field(default=lambda bucket: "all_reduce")
    """The collective that call used (all_reduce, or all_gather for onebit's messages): the meters'
    ring factor (metrics/comm.py)."""
    sent_outside: Callable[[], float] | None = None
    """Bytes this rank sent outside the hook since the last call (onebit_adam's momentum exchange,
    in the optimizer step); the meters add them to the step."""
    _stateful: Any = field(default=None, repr=False)

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state (error feedback, PowerSGD's iteration, memories and RNG); plain data."""
        return self._stateful.state_dict() if self._stateful is not None else {"kind": self.name}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output; a checkpoint of another compression is ignored with a warning."""
        if sd.get("kind") != self.name:
            import warnings

            warnings.warn(f"dptrain: the checkpoint's gradient-compression state is for {sd.get('kind')!r}, this "
                          f"run uses {self.name!r}: its error feedback starts afresh", UserWarning, stacklevel=2)
            return
        if self._stateful is not None:
            self._stateful.load_state_dict(sd)


# ------------------------------------------------------------------------------- fp16 / bf16
def _cast_hook(name: str, process_group: Any) -> CommHook:
    hook = default_hooks.fp16_compress_hook if name == "fp16" else default_hooks.bf16_compress_hook
    size = 2  # both halves

    def payload(bucket: dist.GradBucket) -> int:
        return bucket.buffer().numel() * size

    return CommHook(name, process_group, hook, payload)


# ------------------------------------------------------------------------------- PowerSGD
def _compressed_pieces(names: list[str], shapes: list[torch.Size], *, rank: int,
                       min_rate: float) -> tuple[Pieces, Pieces, int]:
    """The P and Q pieces of one bucket in the order torch's powerSGD_hook lays its memories out
    (tensors worth compressing, grouped by matrix shape in order of first appearance), and the
    element count all-reduced uncompressed."""
    groups: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
    uncompressed = 0
    for name, shape in zip(names, shapes, strict=True):
        n = shape[0]
        m = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        r = min(n, m, rank)
        if (n + m) * r * min_rate < n * m:  # torch's _should_compress
            groups.setdefault((n, m), []).append((name, n, m, r))
        else:
            uncompressed += n * m
    order = [item for group in groups.values() for item in group]
    return [(nm, n * r) for nm, n, _, r in order], [(nm, m * r) for nm, _, m, r in order], uncompressed


class PowerSGDHookState:
    """torch's PowerSGDState plus the bucket layout and the bytes of each call."""

    def __init__(self, process_group: Any, *, rank: int, start_step: int) -> None:
        self.psgd = powerSGD_hook.PowerSGDState(process_group=process_group, matrix_approximation_rank=rank,
                                                start_powerSGD_iter=start_step, use_error_feedback=True,
                                                warm_start=True, random_seed=0)
        self.layout = BucketLayout()
        self.last_payload: dict[int, int] = {}
        self._shapes: dict[int, list[torch.Size]] = {}
        self._warm = False  # the loaded state had P/Q memories (compression had started)

    def pieces(self, index: int) -> tuple[Pieces, Pieces, int]:
        s = self.psgd
        return _compressed_pieces(self.layout.names(index), self._shapes[index], rank=s.matrix_approximation_rank,
                                  min_rate=s.min_compression_rate)

    def restore(self, bucket: dist.GradBucket) -> None:
        """Before torch's hook sees this bucket the first time after a resume: its loaded state, in
        the bucket's layout of the moment."""
        s, index, buffer = self.psgd, bucket.index(), bucket.buffer()
        if index in s.error_dict or not self.layout.pending:
            return
        error = self.layout.join("error", self.layout.element_pieces(index), buffer)
        if error is not None:
            s.error_dict[index] = error
        p_pieces, q_pieces, _ = self.pieces(index)
        for name, pieces, memory in (("p", p_pieces, s.p_memory_dict), ("q", q_pieces, s.q_memory_dict)):
            flat = self.layout.join(name, pieces, buffer)
            if flat is not None or self._warm:
                memory[index] = flat if flat is not None else buffer.new_empty(0)

    def state_dict(self) -> dict[str, Any]:
        s, lay = self.psgd, self.layout
        name, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], s.rng.get_state())
        return {
            "kind": "powersgd", "iter": s.iter,
            "rng": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "stats": [s.total_numel_before_compression, s.total_numel_after_compression, s.next_stats_report],
            "warm": bool(s.p_memory_dict) or self._warm,
            "error": lay.export("error", s.error_dict, lay.element_pieces),
            "p": lay.export("p", s.p_memory_dict, lambda i: self.pieces(i)[0]),
            "q": lay.export("q", s.q_memory_dict, lambda i: self.pieces(i)[1]),
        }

    def park(self) -> None:
        """DDP re-laid its buckets out (a resumed run's first step used the constructor's layout):
        keep error and P/Q memories per parameter until torch's hook sees each bucket again."""
        s, lay = self.psgd, self.layout
        self._warm = self._warm or bool(s.p_memory_dict)
        lay.park("error", s.error_dict, lay.element_pieces)
        lay.park("p", s.p_memory_dict, lambda i: self.pieces(i)[0])
        lay.park("q", s.q_memory_dict, lambda i: self.pieces(i)[1])

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        s = self.psgd
        s.iter = int(sd["iter"])
        r = sd["rng"]
        keys = r["keys"].numpy().astype(np.uint32)
        s.rng.set_state((r["name"], keys, r["pos"], r["has_gauss"], r["cached_gaussian"]))
        s.total_numel_before_compression, s.total_numel_after_compression, s.next_stats_report = sd["stats"]
        s.error_dict.clear()
        s.p_memory_dict.clear()
        s.q_memory_dict.clear()
        self._warm = bool(sd["warm"])
        self.layout.load({"error": sd["error"], "p": sd["p"], "q": sd["q"]})


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's powerSGD_hook, after recording the layout and the bytes this call sends."""
    index, buffer = bucket.index(), bucket.buffer()
    state.layout.observe(bucket, park=state.park)
    state._shapes[index] = [g.shape for g in bucket.gradients()]
    if state.psgd.iter < state.psgd.start_powerSGD_iter:  # torch's hook all-reduces the bucket as it is
        state.last_payload[index] = buffer.numel() * buffer.element_size()
    else:
        state.restore(bucket)
        p_pieces, q_pieces, uncompressed = state.pieces(index)
        elements = uncompressed + sum(n for _, n in p_pieces) + sum(n for _, n in q_pieces)
        state.last_payload[index] = elements * buffer.element_size()
    return powerSGD_hook.powerSGD_hook(state.psgd, bucket)


# ------------------------------------------------------------------------------- building
def _stateful_hook(name: str, state: Any, hook: Hook) -> CommHook:
    def payload(bucket: dist.GradBucket) -> int:
        return int(state.last_payload[bucket.index()])

    def collective(bucket: dist.GradBucket) -> str:
        return str(getattr(state, "last_collective", {}).get(bucket.index(), "all_reduce"))

    return CommHook(name, state, hook, payload, collective, _stateful=state)


def build_comm_hook(cfg: ParallelConfig, *, process_group: Any, backend: str,
                    optim: OptimConfig | None = None) -> CommHook | None:
    """The DDP hook for `cfg.grad_compression` over `process_group` (the data-parallel group);
    None for `none`, and for fp16/bf16 under FSDP2 (its reduce dtype does it). `backend` is
    checked for bf16 (the hook needs NCCL; `resolve` refuses it earlier with the reason).
    `optim.name=onebit_adam` (whose grad_compression is none): its warm-up hook, whose state
    (`MomentumExchange`) the optimizer takes (`train/optim.py:build_optimizer`)."""
    if optim is not None and optim.name in ("onebit_adam", "onebit_lamb"):  # 1-bit LAMB: the same exchange
        if cfg.grad_compression != "none":
            raise ValueError(f"optim.name={optim.name!r} compresses the momentum itself; parallel.grad_compression="
                             f"{cfg.grad_compression!r} must be none")
        ex = momentum_exchange.MomentumExchange(process_group, freeze_step=optim.freeze_step)
        hook = _stateful_hook("onebit_adam", ex, momentum_exchange.warmup_hook)
        hook.sent_outside = ex.take_sent
        return hook
    name = cfg.grad_compression
    if name == "none" or (name in CAST and strategy_mode(cfg).wrapper == "fsdp"):
        return None
    if name in CAST:
        if name == "bf16" and backend != "nccl":
            raise ValueError(
                f"grad_compression='bf16' needs the nccl backend (torch's bf16_compress_hook), not {backend!r}"
            )
        return _cast_hook(name, process_group)
    if name == "powersgd":
        ps = PowerSGDHookState(process_group, rank=cfg.powersgd_rank, start_step=cfg.powersgd_start_step)
        return _stateful_hook(name, ps, powersgd_hook)
    if name == "onebit":
        ob = onebit.OneBitState(process_group, start_step=cfg.onebit_start_step)
        return _stateful_hook(name, ob, onebit.onebit_hook)
    raise ValueError(f"unknown grad_compression {name!r}")
