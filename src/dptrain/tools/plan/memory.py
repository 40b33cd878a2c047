"""Memory per rank: model states by ZeRO stage, the built-in LLaMA's layouts and measured models.

Conventions (bytes per parameter; GB = 1e9 bytes):

- `zero_states` (a model given only by its parameter count, `dptrain plan --params`) follows the
  ZeRO paper (Rajbhandari et al. 2020, sec. 3.1/5): mixed precision (bf16/fp16) keeps 2-byte
  parameters and gradients plus K bytes of optimizer state, K = 12 for Adam/AdamW (fp32 master
  copy, momentum, variance), 8 for SGD with momentum (master + momentum), 4 for plain SGD (the
  master); fp32 keeps 4-byte parameters and gradients, K = 8 / 4 / 0. Stage 0 (DDP) replicates
  all; 1 shards the optimizer states over the N data-parallel ranks, 2 also the gradients, 3
  also the parameters: (2+2+K)Psi, (2+2)Psi + K*Psi/N, 2Psi + (2+K)Psi/N, (2+2+K)Psi/N.
- `layout_memory` (dptrain's own runs) uses what dptrain allocates: its autocast keeps fp32
  parameters and gradients under bf16/fp16 too (no separate master copy), so 4 + 4 + K with
  K = 8 / 4 / 0; the half-precision copies autocast makes are activations (plan/llama.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dptrain.tools.plan.llama import (
    HALF,
    ParamCounts,
    activation_parts,
    lora_block_params,
    param_counts,
    replicated_block_bytes,
    tp_whole_outside_bytes,
)

if TYPE_CHECKING:  # annotations only: the planner imports no torch (`dptrain --help` stays fast)
    from dptrain.models.llama import LlamaConfig
    from dptrain.tools.plan.measure import ModelProfile

OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum", "onebit_adam", "lamb", "onebit_lamb")
PRECISIONS = ("fp32", "bf16", "fp16")
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
GB = 1e9
# Stated allowance for what no formula here counts: the CUDA context, cuBLAS/cuDNN workspaces and
# NCCL's buffers (about 0.5-1 GB on recent GPUs; not measured here, no GPU). Allocator
# fragmentation is not counted.
FRAMEWORK_OVERHEAD = 1.0 * GB


def _choice(value: str, valid: tuple[str, ...], what: str) -> str:
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r} (valid: {', '.join(valid)})")
    return value


def optimizer_bytes(optimizer: str, *, master: bool) -> int:
    """Optimizer-state bytes per parameter (K), with or without the fp32 master copy."""
    # onebit_lamb: momentum, frozen variance and the fresh variance it tracks after the freeze
    per = {"adam": 8, "adamw": 8, "sgd": 0, "sgd-momentum": 4, "onebit_adam": 8, "lamb": 8,
           "onebit_lamb": 12}[_choice(optimizer, OPTIMIZERS, "optimizer")]
    return per + (4 if master else 0)


def zero_states(*, params: float, gpus: int, optimizer: str, precision: str) -> dict[int, float]:
    """Model-state bytes per rank for ZeRO stages 0-3 under the paper's convention (docstring)."""
    if params <= 0:
        raise ValueError(f"params={params} must be > 0")
    if gpus < 1:
        raise ValueError(f"gpus={gpus} must be >= 1")
    mixed = _choice(precision, PRECISIONS, "precision") != "fp32"
    p = g = 2 if mixed else 4
    k = optimizer_bytes(optimizer, master=mixed)
    n = gpus
    return {0: (p + g + k) * params, 1: (p + g) * params + k * params / n,
            2: p * params + (g + k) * params / n, 3: (p + g + k) * params / n}


@dataclass(frozen=True)
class Layout:
    """One layout of the built-in LLaMA on `gpus` ranks (the resolved config's numbers)."""

    strategy: str
    dp_shard: int  # ranks the zero1/zero2/fsdp shards span (ddp: 1; zero2/fsdp under cp: dp_shard x cp)
    tp: int
    pp: int
    micro_batch: int  # sequences per rank per micro-step
    seq: int
    precision: str
    optimizer: str
    checkpointing: str = "none"
    cpu_offload: bool = False
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    pp_microbatches: int = 1
    pp_schedule: str = "1f1b"
    pp_layers: tuple[int, ...] | None = None
    grad_dtype: str | None = None  # ddp/zero1: the dtype gradients travel in (grad_compression fp16/bf16)
    grad_compression: str = "none"  # ddp: none, fp16, bf16, powersgd, onebit (parallel.grad_compression)
    powersgd_rank: int = 8
    param_dtype: str | None = None  # zero2/fsdp: fsdp_param_dtype (gathers; null: the parameters' fp32)
    reduce_dtype: str | None = None  # zero2/fsdp: fsdp_reduce_dtype (reduce-scatters; null: param_dtype)
    overhead: float = FRAMEWORK_OVERHEAD  # the stated allowance; 0 on the CPU (no CUDA context)
    sequence_parallel: bool = True  # tp > 1: norms and the residual stream on 1/tp of the sequence
    pp_stages_per_rank: int = 1  # interleaved_1f1b: virtual stages per rank (v)
    lora_rank: int = 0  # model.lora: adapters of this rank train, the base is frozen (weights only); 0: no LoRA
    lora_targets: tuple[str, ...] | None = None  # model.lora.target_modules (null: every attention and MLP linear)
    cp: int = 1  # parallel.cp: each row of `seq` tokens split over cp ranks (seq/cp each, K/V all-gathered)
    loss_parallel: bool = False  # tp > 1: the logits stay vocabulary-sharded (else gathered whole on every tp rank)
    cp_mask: bool = True  # cp > 1 off the CPU: SDPA with a [T/cp, T] mask; on the CPU blockwise attention, no mask
    cp_attention: str = "allgather"  # cp > 1: allgather (K/V all-gathered) or ulysses (all-to-all on heads, no mask)

    @property
    def ulysses(self) -> bool:
        """Context parallelism by Ulysses' all-to-all on heads (cp > 1, cp_attention ulysses)."""
        return self.cp > 1 and self.cp_attention == "ulysses"

    @property
    def pure_half(self) -> bool:
        """Half-precision parameters in the forward (zero2/fsdp with fsdp_param_dtype bf16/fp16 under autocast)."""
        return self.strategy in ("zero2", "fsdp") and self.precision in HALF and self.param_dtype in HALF


def stage_layers(n_layers: int, pp: int, pp_layers: tuple[int, ...] | None) -> list[int]:
    """Blocks per pipeline stage: `pp_layers`, else an even split, the first stages one more."""
    if pp_layers:
        return list(pp_layers)
    return [n_layers // pp + (1 if i < n_layers % pp else 0) for i in range(pp)]


def _rank_params(c: ParamCounts, *, layers: int, first: bool, last: bool, tp: int) -> int:
    """Parameters one rank of a stage holds before data-parallel sharding: block matrices,
    embedding and head split over tp (the built-in plan), RMSNorm weights replicated."""
    n = layers * (c.block_linear // tp + (c.block - c.block_linear))
    if first:
        n += c.embedding // tp
    if last:
        n += c.final_norm + c.head // tp
    return n


def layout_memory(cfg: LlamaConfig, lay: Layout) -> dict[str, float]:
    """Bytes per rank of the worst pipeline rank: model states (GPU and host), activations,
    temporary buffers, the stated overhead and the total on the GPU. A rank holds stages r, r + pp,
    ... (`pp_stages_per_rank` of them under interleaved_1f1b). Under `cp` a rank's activations are those of its
    seq/cp tokens plus what the K/V all-gather (and off the CPU the mask) keep (plan/llama.py); zero2/fsdp shard over
    the `dp_shard` the layout gives (dp_shard x cp, as FSDP2's mesh does)."""
    c = param_counts(cfg)
    v = max(1, lay.pp_stages_per_rank)
    stages = stage_layers(cfg.n_layers, lay.pp * v, lay.pp_layers)
    worst: dict[str, float] = {}
    for rank in range(lay.pp):
        parts = rank_memory(cfg, lay, rank, counts=c, stages=stages)
        if not worst or parts["total"] > worst["total"]:
            worst = parts
    return worst


def rank_memory(cfg: LlamaConfig, lay: Layout, rank: int, *, counts: ParamCounts | None = None,
                stages: list[int] | None = None) -> dict[str, float]:
    """`layout_memory`'s parts for one pipeline rank (0: the first stage)."""
    c = counts or param_counts(cfg)
    v = max(1, lay.pp_stages_per_rank)
    stages = stages or stage_layers(cfg.n_layers, lay.pp * v, lay.pp_layers)
    mine = list(range(rank, lay.pp * v, lay.pp))
    return _stage_memory(cfg, c, lay, layers=[stages[i] for i in mine], first=rank == 0,
                         last=len(stages) - 1 in mine, stage=rank)


def loss_backward_bytes(cfg: LlamaConfig, *, batch: int, seq: int) -> int:
    """What the loss's backward holds beside the saved fp32 log-softmax: the fp32 gradients of the
    log-softmax and of the logits, [batch * seq, vocab] each (the last stage's temporaries)."""
    return 8 * batch * seq * cfg.vocab_size


def pipeline_in_flight(lay: Layout, rank: int) -> int:
    """Forward chunks (a micro-batch through one of the rank's stages) a pipeline rank holds at its
    first backward: gpipe all m * v; 1f1b min(m, pp - rank) (torch's Schedule1F1B); interleaved
    (torch's ScheduleInterleaved1F1B, `_get_warmup_ops`) (v - 1) * m_round + 2 * (pp - 1 - rank)
    warm-up forwards and the steady state's first, m_round = m // max(1, m // pp), at most m * v."""
    m, v = max(1, lay.pp_microbatches), max(1, lay.pp_stages_per_rank)
    if lay.pp == 1 or lay.pp_schedule == "gpipe":
        return m * v
    if lay.pp_schedule == "interleaved_1f1b":
        per_round = m // max(1, m // lay.pp)
        return min((v - 1) * per_round + 2 * (lay.pp - 1 - rank) + 1, m * v)
    return min(m, lay.pp - rank)


def pipeline_bubble(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle share of a pipeline schedule: (p - 1) / (v * m + p - 1), v stages per rank; the idle time
    over the busy time is Narayanan et al.'s (p - 1) / (v * m)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def model_states(lay: Layout, *, param_bytes: float, grad_bytes: float, optim_bytes: float,
                 unit_bytes: float, zero1_optim: float | None = None) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients, optimizer state, the strategy's temporary buffers
    and (cpu_offload) the host share, for a rank holding `param_bytes` of parameters before
    data-parallel sharding (`grad_bytes`, `optim_bytes` likewise), the largest FSDP unit
    `unit_bytes`. `zero1_optim`: under zero1, the rank's optimizer bytes when known (an uneven
    partition, `zero1_partition`) instead of an even split. Shared by the LLaMA formulas and
    measured models."""
    shard = lay.dp_shard if lay.strategy != "ddp" else 1
    params = param_bytes / (shard if lay.strategy in ("zero2", "fsdp") else 1)
    grads = grad_bytes / (shard if lay.strategy in ("zero2", "fsdp") else 1)
    optim = optim_bytes / (shard if lay.strategy != "ddp" else 1)
    if lay.strategy == "zero1" and zero1_optim is not None:
        optim = zero1_optim
    half = 0.5 if lay.pure_half else 1.0  # fsdp_param_dtype bf16/fp16: 2-byte gathered copies of 4-byte parameters
    if lay.strategy == "zero2":  # FSDP2 without reshard: every unit stays gathered forward to backward
        # gathered parameters (fp32: the shard is part of them) + one unsharded gradient (reduce-scatter)
        temp = (half * param_bytes if lay.pure_half else param_bytes - params) + unit_bytes
    elif lay.strategy == "fsdp":  # the unit in use and the one prefetched, one unsharded gradient
        temp = (2 * half + 1) * unit_bytes
    else:  # DDP: one bucket under all-reduce; without bucket views the buckets copy every gradient
        temp = lay.bucket_cap_mb * 2**20 + (0 if lay.gradient_as_bucket_view else grads)
    host = 0.0
    if lay.cpu_offload and lay.strategy in ("zero2", "fsdp"):
        host, params, grads, optim = params + grads + optim, 0.0, 0.0, 0.0
    return {"params": params, "grads": grads, "optimizer": optim, "temporary": temp, "host": host}


def _stage_memory(cfg: LlamaConfig, c: ParamCounts, lay: Layout, *, layers: list[int], first: bool,
                  last: bool, stage: int) -> dict[str, float]:
    n = _rank_params(c, layers=sum(layers), first=first, last=last, tp=lay.tp)
    k = optimizer_bytes(lay.optimizer, master=False)
    unit = 4 * (max(c.block_linear // lay.tp + c.block - c.block_linear,
                    (c.embedding + c.head) // lay.tp + c.final_norm))
    trained = n  # LoRA: only the adapters have gradients and optimizer state; the frozen base is weights only
    if lay.lora_rank:
        trained = sum(layers) * lora_block_params(cfg, rank=lay.lora_rank, targets=lay.lora_targets, tp=lay.tp)
        n += trained
    states = model_states(lay, param_bytes=4 * n, grad_bytes=4 * trained, optim_bytes=k * trained, unit_bytes=unit)
    params, grads, optim, temp, host = (states[key] for key in ("params", "grads", "optimizer", "temporary", "host"))
    m = max(1, lay.pp_microbatches)
    in_flight = pipeline_in_flight(lay, stage)
    batch = math.ceil(lay.micro_batch / m)
    pdt = lay.param_dtype if lay.pure_half else None
    chunk = sum(layers) / len(layers)  # blocks per stage of this rank (an even split: all the same)
    kept_i, work_i = activation_parts(cfg, batch=batch, seq=lay.seq, precision=lay.precision,
                                      checkpointing=lay.checkpointing, n_layers=1, outside=False, param_dtype=pdt,
                                      cp=lay.cp, cp_mask=lay.cp_mask, ulysses=lay.ulysses)
    kept, work = float(kept_i), float(work_i)
    outside = float(activation_parts(cfg, batch=batch, seq=lay.seq, precision=lay.precision, n_layers=0,
                                     param_dtype=pdt, cp=lay.cp, cp_mask=lay.cp_mask,
                                     ulysses=lay.ulysses)[0]) if last else 0.0
    rep = replicated_block_bytes(cfg, batch=batch, seq=lay.seq // lay.cp, precision=lay.precision,
                                 checkpointing=lay.checkpointing, param_dtype=pdt)
    if lay.tp > 1:  # sequence parallel: all of it on 1/tp of the sequence; else the norms' part replicated
        kept = kept / lay.tp if lay.sequence_parallel else rep + (kept - rep) / lay.tp
        whole = tp_whole_outside_bytes(cfg, batch=batch, seq=lay.seq, cp=lay.cp, precision=lay.precision,
                                       loss_parallel=lay.loss_parallel, cp_mask=lay.cp_mask,
                                       ulysses=lay.ulysses) if last else 0
        work, outside = work / lay.tp, whole + (outside - whole) / lay.tp  # the head's log-softmax, cp's own parts
    # the last stage's outside part (final norm, head, loss) for each of its micro-batches in flight
    acts = in_flight * chunk * kept + work + (min(in_flight, m) * outside if last else 0)
    if last:
        temp += loss_backward_bytes(cfg, batch=batch, seq=lay.seq // lay.cp)
    total = params + grads + optim + acts + temp + lay.overhead
    return {"params": params, "grads": grads, "optimizer": optim, "activations": acts,
            "temporary": temp, "overhead": lay.overhead, "total": total, "host": host,
            "stage": stage, "in_flight": in_flight}


def zero1_partition(groups: tuple[tuple[int, ...], ...], ranks: int) -> list[int]:
    """Elements of optimizer state per rank as ZeroRedundancyOptimizer partitions them: group by
    group, each tensor (largest first) to the rank with the fewest elements so far."""
    sizes = [0] * ranks
    for group in groups:
        for numel in sorted(group, reverse=True):
            sizes[sizes.index(min(sizes))] += numel
    return sizes


def profile_memory(prof: ModelProfile, lay: Layout) -> dict[str, float]:
    """Bytes per rank of a measured model (plan/measure.py) under `lay` (ddp/zero1/zero2/fsdp ±
    cpu_offload; tp = pp = 1): model states as `model_states` with the measured parameter bytes
    (gradients and optimizer states in each parameter's dtype, trainable ones only; zero1: the
    most loaded rank of ZeroRedundancyOptimizer's partition), the measured activations of one
    micro-batch under `lay.checkpointing`, the stated overhead."""
    if lay.tp != 1 or lay.pp != 1:
        raise ValueError(f"a measured model is planned without tensor or pipeline parallelism (tp={lay.tp}, "
                         f"pp={lay.pp}): the measurement runs the whole, unsplit model")
    if lay.micro_batch != prof.micro_batch or lay.precision != prof.precision:
        raise ValueError(f"the profile was measured at micro-batch {prof.micro_batch}, {prof.precision}, not "
                         f"{lay.micro_batch}, {lay.precision}")
    k = optimizer_bytes(lay.optimizer, master=False)  # per 4-byte parameter: the states are zeros_like(param)
    zero1 = None
    if lay.strategy == "zero1" and prof.optimizer_groups and prof.trainable:  # the worst rank's share
        per_element = k * prof.trainable_bytes / prof.trainable / 4
        zero1 = per_element * max(zero1_partition(prof.optimizer_groups, lay.dp_shard))
    states = model_states(lay, param_bytes=prof.param_bytes, grad_bytes=prof.trainable_bytes,
                          optim_bytes=k * prof.trainable_bytes / 4, unit_bytes=prof.largest_unit_bytes,
                          zero1_optim=zero1)
    acts = float(prof.activation_bytes(lay.checkpointing))
    total = states["params"] + states["grads"] + states["optimizer"] + acts + states["temporary"] + lay.overhead
    return {**states, "activations": acts, "overhead": lay.overhead, "total": total, "stage": 0, "in_flight": 1}
