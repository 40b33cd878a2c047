"""`dptrain plan --recommend`: every layout of the built-in LLaMA on N GPUs, ranked by predicted time.

Candidates (for a global batch of G sequences): strategy ddp/zero1/zero2/fsdp, ± cpu_offload
(zero2/fsdp), zero2/fsdp gathering fp32 or (bf16/fp16 training) half-precision parameters; tp a
divisor of the GPUs per node (tensor parallelism stays inside a node); pp a divisor of n_layers with
tp*pp dividing the GPUs, schedule 1f1b, pp_microbatches any divisor of the micro-batch >= pp; dp =
gpus / (tp*pp); micro-batch any divisor of G / dp, accumulation the rest; activation checkpointing
none/selective/full. HSDP (dp_replicate x dp_shard) is not searched. Context parallelism (`parallel.cp`) is
searched where dptrain composes it: cp a divisor (> 1) of the GPUs per node, alone or with tp (cp * tp dividing the
GPUs per node: both stay inside a node), pp = 1 (cp x pp is refused), strategy ddp, zero2 or fsdp (zero1 is refused
with cp), the row splitting into 2*cp chunks (and under sequence parallelism each rank's seq/cp over tp);
dp = gpus / (cp * tp). cp adds its K/V exchange to the step (not overlapped), so it ranks below a layout without it
unless the row does not fit otherwise.

Each candidate is turned into the Config it stands for and checked by dptrain itself: `resolve()`
(what `dptrain run` checks before launch) and, with tp > 1, the launcher's tensor-parallel check on
the model built once on the meta device; a refused one is rejected with dptrain's message. The
accepted ones get `layout_memory` (plan/memory.py) and are rejected when the worst stage's total
exceeds the device's memory; those that fit are ranked by predicted step time (`timing.step_time`,
cpu_offload and fsdp's re-gathers under pp included), ties by memory. Host memory for cpu_offload is
not checked against the host's size (unknown here)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dptrain.config.fields import ConfigError
from dptrain.config.resolve import resolve
from dptrain.launch.checks import check_model, check_tensor_parallel
from dptrain.metrics.hardware import GpuSpec
from dptrain.tools.plan.memory import GB, layout_memory
from dptrain.tools.plan.predict import layout_from_config
from dptrain.tools.plan.timing import Link, step_time

if TYPE_CHECKING:
    from dptrain.config.fields import Config
    from dptrain.config.resolve import Resolved
    from dptrain.models.llama import LlamaConfig

CHECKPOINTING = ("none", "selective", "full")
FSDP2 = ("zero2", "fsdp")


@dataclass(frozen=True)
class Candidate:
    """One layout to try; `micro_batch` None when dp does not divide the global batch."""

    strategy: str
    cpu_offload: bool
    tp: int
    pp: int
    dp: int
    micro_batch: int | None
    accum: int | None
    pp_microbatches: int | None
    checkpointing: str
    gather_dtype: str | None = None  # zero2/fsdp: parallel.fsdp_param_dtype (None: the fp32 parameters)
    cp: int = 1  # parallel.cp: each row split over cp ranks

    def label(self) -> str:
        s = (
            self.strategy
            + ("+offload" if self.cpu_offload else "")
            + (f"+{self.gather_dtype}" if self.gather_dtype else "")
        )
        m = f" m{self.pp_microbatches}" if self.pp > 1 else ""
        mb = "-" if self.micro_batch is None else f"{self.micro_batch}x{self.accum}"
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        return f"{s} dp{self.dp} tp{self.tp} pp{self.pp}{cp}{m} mb{mb} ckpt={self.checkpointing}"


@dataclass(frozen=True)
class Ranked:
    """A layout that dptrain accepts and that fits: its config, memory and predicted time."""

    cand: Candidate
    cfg: Config
    memory: dict[str, float]
    time: dict[str, float]
    """`timing.step_time`'s result."""

    @property
    def step_s(self) -> float:
        return self.time["step"]

    @property
    def mfu(self) -> float:
        return self.time["mfu"]


@dataclass(frozen=True)
class Rejected:
    """A layout refused by dptrain's validation (`memory` None) or too large for the device."""

    cand: Candidate
    reason: str
    memory: float | None = None

    @property
    def group(self) -> str:
        """The reason with its numbers and the rest of its sentence dropped (what a group shares)."""
        head = re.split(r"; | \(", self.reason, maxsplit=1)[0]
        return re.sub(r"\d+(\.\d+)?", "N", head)


@dataclass(frozen=True)
class SearchResult:
    ranked: list[Ranked]
    rejected: list[Rejected]
    global_batch: int
    seq: int


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def data_parallel_degrees(model: LlamaConfig, *, gpus: int, per_node: int) -> list[tuple[int, int, int]]:
    """(tp, pp, dp) triples the search tries: tp | GPUs per node, pp | n_layers, tp*pp | gpus."""
    return [
        (tp, pp, gpus // (tp * pp))
        for tp in divisors(per_node)
        for pp in divisors(model.n_layers)
        if gpus % (tp * pp) == 0
    ]


def candidates(
    model: LlamaConfig, *, gpus: int, per_node: int, global_batch: int, half: str | None = None, seq: int | None = None
) -> Iterator[Candidate]:
    """Every layout of the module docstring, in a fixed order. `half` (bf16/fp16 training): zero2/fsdp
    also gather their parameters in that dtype (`fsdp_param_dtype`). `seq` given: also the cp layouts whose 2*cp
    chunks divide it."""
    cps = [c for c in divisors(per_node) if c > 1 and gpus % c == 0 and seq is not None and seq % (2 * c) == 0]
    for strategy in ("ddp", "zero1", "zero2", "fsdp"):
        fsdp2 = strategy in FSDP2
        for offload, gather in (
            (o, g)
            for o in ((False, True) if fsdp2 else (False,))
            for g in ((None, half) if fsdp2 and half else (None,))
        ):
            degrees = [(tp, pp, dp, 1) for tp, pp, dp in data_parallel_degrees(model, gpus=gpus, per_node=per_node)]
            if strategy != "zero1":  # cp, alone or with tp inside a node; pp = 1 (dptrain refuses cp x pp)
                degrees += [(tp, 1, gpus // (tp * cp), cp) for cp in cps for tp in divisors(per_node // cp)
                            if gpus % (tp * cp) == 0]
            for tp, pp, dp, cp in degrees:
                base = Candidate(strategy, offload, tp, pp, dp, micro_batch=None, accum=None, pp_microbatches=None,
                                 checkpointing="none", gather_dtype=gather, cp=cp)
                if global_batch % dp:
                    yield base  # dptrain refuses it (the batch does not split over dp)
                    continue
                yield from _batch_splits(base, global_batch // dp)


def _batch_splits(base: Candidate, per_replica: int) -> Iterator[Candidate]:
    """`base` at every micro-batch (a divisor of the replica's share), pipeline split and checkpointing mode."""
    pp = base.pp
    for mb in divisors(per_replica):
        splits: list[int | None] = ([m for m in divisors(mb) if m >= pp] or [pp]) if pp > 1 else [None]
        for m in splits:
            for ckpt in CHECKPOINTING:
                yield dataclasses.replace(base, micro_batch=mb, accum=per_replica // mb, pp_microbatches=m,
                                          checkpointing=ckpt)


def candidate_config(base: Config, cand: Candidate, *, global_batch: int) -> Config:
    """`base` with the candidate's parallel layout and batch sizes (everything else kept)."""
    parallel = dataclasses.replace(
        base.parallel,
        strategy=cand.strategy,
        cpu_offload=cand.cpu_offload,
        tp=cand.tp,
        pp=cand.pp,
        cp=cand.cp,
        dp_replicate=1,
        dp_shard=1,
        pp_schedule="1f1b",
        pp_microbatches=cand.pp_microbatches,
        activation_checkpointing=cand.checkpointing,
        fsdp_param_dtype=cand.gather_dtype,
    )
    train = dataclasses.replace(
        base.train,
        global_batch_size=global_batch,
        micro_batch_size=cand.micro_batch,
        grad_accum_steps=cand.accum if cand.micro_batch is not None else 1,
    )
    return dataclasses.replace(base, parallel=parallel, train=train)


class Checker:
    """dptrain's own pre-launch checks for a candidate config: `resolve()` at the world size and,
    with tp > 1, the launcher's `check_tensor_parallel` on the model built once on meta."""

    def __init__(self, base: Config, *, gpus: int, seq: int) -> None:
        self.gpus = gpus
        self.model = check_model(base.model)  # meta device: no memory
        self.seq = seq
        self._tp: dict[tuple[Any, ...], str | None] = {}

    def refusal(self, cfg: Config) -> tuple[Resolved | None, str | None]:
        try:
            resolved = resolve(cfg, world_size=self.gpus, cuda_available=True)
        except ConfigError as e:
            return None, str(e)
        return resolved, self._tp_refusal(cfg, resolved.dims.tp, resolved.dims.cp)

    def _tp_refusal(self, cfg: Config, tp: int, cp: int = 1) -> str | None:
        key = (tp, cp, cfg.parallel.tp_plan, cfg.parallel.sequence_parallel)
        if key not in self._tp:
            import torch


            try:  # the launcher reads the input length off a training sample: a token row of seq + 1
                check_tensor_parallel(
                    self.model, parallel=cfg.parallel, tp=tp, sample=torch.zeros(self.seq + 1, dtype=torch.long), cp=cp
                )
                self._tp[key] = None
            except ConfigError as e:
                self._tp[key] = str(e)
        return self._tp[key]


def search(
    base: Config,
    model: LlamaConfig,
    spec: GpuSpec,
    *,
    gpus: int,
    nodes: int,
    interconnect: str,
    global_batch: int,
    seq: int,
    efficiency: float | None,
    comm: Link | None = None,
) -> SearchResult:
    """Rank every candidate layout (module docstring); `base` is the user's config (built-in LLaMA)."""
    checker = Checker(base, gpus=gpus, seq=seq)
    ranked: list[Ranked] = []
    rejected: list[Rejected] = []
    half = base.precision.dtype if base.precision.dtype in ("bf16", "fp16") else None
    for cand in candidates(model, gpus=gpus, per_node=gpus // nodes, global_batch=global_batch, half=half, seq=seq):
        cfg = candidate_config(base, cand, global_batch=global_batch)
        resolved, why = checker.refusal(cfg)
        if resolved is None or why is not None:
            rejected.append(Rejected(cand, why or ""))
            continue
        lay = layout_from_config(cfg, resolved, seq=seq, cpu=spec.key == "cpu")
        mem = layout_memory(model, lay)
        if mem["total"] > spec.memory_gb * GB:
            rejected.append(
                Rejected(
                    cand,
                    f"memory per rank {mem['total'] / GB:.1f} GB > {spec.name}'s {spec.memory_gb:g} GB",
                    memory=mem["total"],
                )
            )
            continue
        t = step_time(model, lay, spec, gpus=gpus, nodes=nodes, interconnect=interconnect,
                      accum=resolved.grad_accum_steps, efficiency=efficiency, comm=comm)
        ranked.append(Ranked(cand, cfg, mem, t))
    ranked.sort(key=_rank_key)
    return SearchResult(ranked, rejected, global_batch, seq)


def _rank_key(r: Ranked) -> tuple[float, float, int, bool, int, int, int]:
    c = r.cand
    return (r.step_s, r.memory["total"], CHECKPOINTING.index(c.checkpointing), c.cpu_offload, c.tp, c.pp, c.cp)


def rejected_groups(rejected: list[Rejected]) -> list[tuple[str, list[Rejected]]]:
    """Rejections grouped by reason (largest group first); memory ones sorted closest to fitting."""
    groups: dict[str, list[Rejected]] = {}
    for r in rejected:
        key = "does not fit the device's memory" if r.memory is not None else r.group
        groups.setdefault(key, []).append(r)
    for items in groups.values():
        items.sort(key=lambda r: r.memory if r.memory is not None else math.inf)
    return sorted(groups.items(), key=lambda kv: -len(kv[1]))
