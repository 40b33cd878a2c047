"""α-β time model of one optimizer step of the built-in LLaMA (a prediction; not yet calibrated).

- Compute: training FLOPs per token (`LlamaLM.flops_per_token`: 6*N + 12*L*d*T, N the
  non-embedding parameters) x the tokens a rank's model replica processes per step / (tp * pp),
  at the GPU's dense peak for the precision (fp32 as tf32) x `efficiency`. `efficiency` is an assumption the
  user states (`--efficiency`, default 0.4, not calibrated against a measurement yet). Full
  activation checkpointing adds one forward: x 4/3.
- Pipeline bubble: the compute time / (1 - (p-1)/(m+p-1)), m micro-batches per schedule.
- Collectives over N ranks, S bytes, link bandwidth B (bytes/s, one direction), latency α per
  step: ring all-reduce 2(N-1)·α + 2(N-1)/N·S/B; all-gather and reduce-scatter (N-1)·α + (N-1)/N·S/B.
  Gradients are fp32 (dptrain's autocast); ddp/zero1 all-reduce them (zero1 then all-gathers the
  updated parameters), zero2 reduce-scatters them and all-gathers the parameters once, fsdp
  all-gathers twice (forward, backward) and reduce-scatters. Tensor parallelism: per block 2
  all-reduces forward and 2 backward of the [micro-batch, seq, d] activation (the compute dtype).
- Overlap (stated assumption): data-parallel traffic hides behind the backward pass (2/3 of the
  compute), only what exceeds it adds to the step; tensor-parallel traffic is not overlapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dptrain.plan.llama import param_counts
from dptrain.plan.memory import Layout
from dptrain.plan.specs import GpuSpec

if TYPE_CHECKING:  # annotations only: the planner imports no torch (`dptrain --help` stays fast)
    from dptrain.models.llama import LlamaConfig
    from dptrain.plan.measure import ModelProfile

# Inter-node links, bytes/s per GPU per direction, and α per collective step (stated assumptions:
# the nominal line rate of one NIC per GPU; α a typical order of magnitude, not measured here).
INTERCONNECTS = {"ib": (400e9 / 8, 10e-6), "ethernet": (100e9 / 8, 30e-6)}
INTRA_ALPHA = {"nvlink": 5e-6, "pcie": 10e-6}
INTERCONNECT_CHOICES = ("nvlink", "pcie", "ib", "ethernet")


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction
    alpha: float  # seconds per step


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: 2(N-1) steps of latency plus 2(N-1)/N·S/B."""
    return 0.0 if n <= 1 else 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes / link.bandwidth


def gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather or reduce-scatter of S bytes in all: (N-1) steps plus (N-1)/N·S/B."""
    return 0.0 if n <= 1 else (n - 1) * link.alpha + (n - 1) / n * nbytes / link.bandwidth


def bubble_fraction(pp: int, microbatches: int) -> float:
    """Idle share of a pipeline schedule: (p-1)/(m+p-1)."""
    return (pp - 1) / (microbatches + pp - 1)


def links(spec: GpuSpec, *, nodes: int, interconnect: str, spans_nodes: bool) -> Link:
    """The ring's slowest link: inside a node NVLink (or PCIe without it), across nodes the
    interconnect. Datasheet bandwidths are both directions together: halved."""
    if interconnect not in INTERCONNECT_CHOICES:
        raise ValueError(f"unknown interconnect {interconnect!r} (valid: {', '.join(INTERCONNECT_CHOICES)})")
    if nodes > 1 and spans_nodes:
        bw, alpha = INTERCONNECTS.get(interconnect, INTERCONNECTS["ib"])
        return Link(bw, alpha)
    if interconnect == "pcie" or not spec.nvlink_gbps:
        return Link(spec.pcie_gbps * 1e9 / 2, INTRA_ALPHA["pcie"])
    return Link(spec.nvlink_gbps * 1e9 / 2, INTRA_ALPHA["nvlink"])


def step_time(cfg: LlamaConfig, lay: Layout, spec: GpuSpec, *, gpus: int, nodes: int, interconnect: str,
              accum: int, efficiency: float) -> dict[str, float]:
    """Predicted seconds per optimizer step, its parts, and tokens/s over all GPUs."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency} must be in (0, 1]")
    c = param_counts(cfg)
    nonemb = c.total - (0 if cfg.tie_embeddings else c.embedding)
    fpt = 6 * nonemb + 12 * cfg.n_layers * cfg.dim * lay.seq
    dtype = lay.precision if lay.precision != "fp32" else "tf32"
    peak = spec.peaks.get(dtype) or spec.peaks["fp32"]
    tokens = lay.micro_batch * lay.seq * accum  # per model replica per step
    compute = tokens * fpt / (lay.tp * lay.pp) / (peak * efficiency)
    if lay.checkpointing == "full":
        compute *= 4 / 3
    m = max(1, lay.pp_microbatches)
    compute /= 1 - bubble_fraction(lay.pp, m)
    dp = gpus // (lay.tp * lay.pp)
    per_node = max(1, gpus // nodes)
    dp_link = links(spec, nodes=nodes, interconnect=interconnect, spans_nodes=gpus > per_node)
    shard = 4 * c.total / (lay.tp * lay.pp)  # fp32 bytes of one replica's share of the model
    if lay.strategy == "ddp":
        dp_comm = all_reduce_time(shard, dp, dp_link)
    elif lay.strategy == "zero1":
        dp_comm = all_reduce_time(shard, dp, dp_link) + gather_time(shard, dp, dp_link)
    else:
        gathers = 2 if lay.strategy == "fsdp" else 1
        dp_comm = accum * (gathers + 1) * gather_time(shard, dp, dp_link)
    act = (2 if lay.precision != "fp32" else 4) * lay.micro_batch * lay.seq * cfg.dim
    tp_link = links(spec, nodes=1, interconnect="nvlink", spans_nodes=False)
    tp_comm = accum * 4 * cfg.n_layers / lay.pp * all_reduce_time(act, lay.tp, tp_link)
    exposed = max(0.0, dp_comm - 2 / 3 * compute)
    step = compute + exposed + tp_comm
    return {"compute": compute, "dp_comm": dp_comm, "tp_comm": tp_comm, "step": step,
            "tokens_per_s": tokens * dp / step, "flops_per_token": fpt, "mfu": tokens * dp * fpt / step / gpus / peak}


def dp_comm_time(strategy: str, nbytes: float, dp: int, link: Link, *, accum: int) -> float:
    """Data-parallel traffic of one optimizer step over `dp` ranks for `nbytes` of gradients (the
    module docstring's rules): ddp all-reduces once, zero1 also all-gathers the parameters, zero2
    reduce-scatters and all-gathers per micro-step, fsdp all-gathers twice and reduce-scatters."""
    if strategy == "ddp":
        return all_reduce_time(nbytes, dp, link)
    if strategy == "zero1":
        return all_reduce_time(nbytes, dp, link) + gather_time(nbytes, dp, link)
    gathers = 2 if strategy == "fsdp" else 1
    return accum * (gathers + 1) * gather_time(nbytes, dp, link)


def profile_step_time(prof: ModelProfile, lay: Layout, spec: GpuSpec, *, gpus: int, nodes: int, interconnect: str,
                      accum: int, efficiency: float) -> dict[str, float]:
    """`step_time` for a measured model (plan/measure.py; tp = pp = 1): compute is the measured
    training FLOPs of one micro-batch (full checkpointing: the blocks' forward once more) x `accum`
    at the dense peak x `efficiency`; data-parallel traffic `dp_comm_time` of the parameter bytes
    (gradients in each parameter's dtype), overlapped with backward as in `step_time`. Samples/s,
    and tokens/s when the dataset has a `seq_len`."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency} must be in (0, 1]")
    dtype = lay.precision if lay.precision != "fp32" else "tf32"
    peak = spec.peaks.get(dtype) or spec.peaks["fp32"]
    flops = accum * prof.training_flops(lay.checkpointing)  # per rank per step
    compute = flops / (peak * efficiency)
    per_node = max(1, gpus // nodes)
    link = links(spec, nodes=nodes, interconnect=interconnect, spans_nodes=gpus > per_node)
    dp_comm = dp_comm_time(lay.strategy, prof.param_bytes, gpus, link, accum=accum)
    step = compute + max(0.0, dp_comm - 2 / 3 * compute)
    samples = lay.micro_batch * accum * gpus / step
    return {"compute": compute, "dp_comm": dp_comm, "tp_comm": 0.0, "step": step, "samples_per_s": samples,
            "tokens_per_s": samples * prof.seq_len if prof.seq_len else 0.0, "flops_per_step": flops,
            "mfu": flops / step / peak}
