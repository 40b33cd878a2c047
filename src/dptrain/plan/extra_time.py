"""Step-time costs plan/timing.py's `step_time` does not count yet; the recommendation adds them.

- `offload_time`: `parallel.cpu_offload` (FSDP2's CPUOffloadPolicy). Host-to-device copies of the
  rank's fp32 parameter shard before every all-gather (fsdp: two per micro-step, forward and
  backward; zero2: one), one device-to-host copy of the fp32 gradient shard per step, over the
  GPU's host link (PCIe, half the datasheet's bidirectional figure per direction), not overlapped
  (an upper bound: FSDP2 issues them with its all-gathers); plus the optimizer step on the host
  over the rank's shard at HOST_OPTIMIZER_PARAMS_PER_S. That rate is an assumption: torch's
  foreach AdamW reached 1.3e8 parameters/s on one core of this (loaded) machine; 5e8 supposes about
  four host cores per GPU. Not measured on a GPU server.
- `pipeline_regather_time`: fsdp (reshard after forward) under pp > 1. torch.distributed.pipelining
  runs the stage's FSDP2 module once per pipeline micro-batch and turns reshard-after-backward off
  until the last one (`PipelineStage.backward_maybe_with_nosync`), so every forward that follows a
  reshard gathers again and every backward after a forward's reshard does: 1F1B, worst (first)
  stage: min(m, pp) warm-up forwards + m backwards = m + min(m, pp) - 1 all-gathers per schedule
  (gpipe: m + 1); `step_time` counts 2 per micro-step. The extra ones are data-parallel traffic,
  hidden behind backward under step_time's overlap rule (2/3 of compute), as its own are.

`adjusted_step` applies both to a `step_time` result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dptrain.plan.llama import param_counts
from dptrain.plan.memory import Layout, optimizer_bytes
from dptrain.plan.specs import GpuSpec
from dptrain.plan.timing import gather_time, links

if TYPE_CHECKING:
    from dptrain.models.llama import LlamaConfig

HOST_OPTIMIZER_PARAMS_PER_S = 5e8
OVERLAP = 2 / 3  # step_time's stated overlap: data-parallel traffic hides behind 2/3 of the compute


def offload_time(lay: Layout, spec: GpuSpec, *, host_bytes: float, accum: int) -> float:
    """Seconds cpu_offload adds per optimizer step; `host_bytes` is `layout_memory(...)["host"]`
    (the rank's fp32 parameters + gradients + optimizer state on the host)."""
    if not lay.cpu_offload or lay.strategy not in ("zero2", "fsdp") or host_bytes <= 0:
        return 0.0
    params = host_bytes / (8 + optimizer_bytes(lay.optimizer, master=False))  # parameters in the rank's shard
    link = spec.pcie_gbps * 1e9 / 2  # bytes/s per direction
    gathers = 2 if lay.strategy == "fsdp" else 1
    copies = accum * gathers * 4 * params + 4 * params  # parameters in, gradients out
    return copies / link + params / HOST_OPTIMIZER_PARAMS_PER_S


def pipeline_regather_time(cfg: LlamaConfig, lay: Layout, spec: GpuSpec, *, gpus: int, nodes: int,
                           interconnect: str, accum: int) -> float:
    """Seconds of all-gathers per step that fsdp under pp > 1 adds beyond step_time's 2 per micro-step."""
    if lay.strategy != "fsdp" or lay.pp == 1:
        return 0.0
    m = max(1, lay.pp_microbatches)
    gathers = m + 1 if lay.pp_schedule == "gpipe" else m + min(m, lay.pp) - 1
    dp = gpus // (lay.tp * lay.pp)
    link = links(spec, nodes=nodes, interconnect=interconnect, spans_nodes=gpus > max(1, gpus // nodes))
    shard = 4 * param_counts(cfg).total / (lay.tp * lay.pp)  # as step_time: one replica's fp32 share
    return accum * max(0, gathers - 2) * gather_time(shard, dp, link)


def adjusted_step(t: dict[str, float], *, offload: float, regather: float) -> float:
    """`t["step"]` with cpu_offload's time added and the re-gathers added to the overlapped traffic."""
    if not offload and not regather:
        return t["step"]
    hidden = OVERLAP * t["compute"]
    return (t["step"] - max(0.0, t["dp_comm"] - hidden) + max(0.0, t["dp_comm"] + regather - hidden)
            + offload)


def with_extras(cfg: LlamaConfig, lay: Layout, spec: GpuSpec, t: dict[str, float], *, host_bytes: float, gpus: int,
                nodes: int, interconnect: str, accum: int) -> dict[str, float]:
    """offload and regather seconds and the adjusted step, tokens/s (all GPUs) and MFU."""
    offload = offload_time(lay, spec, host_bytes=host_bytes, accum=accum)
    regather = pipeline_regather_time(cfg, lay, spec, gpus=gpus, nodes=nodes, interconnect=interconnect, accum=accum)
    step = adjusted_step(t, offload=offload, regather=regather)
    scale = t["step"] / step
    return {"offload": offload, "regather": regather, "step": step, "tokens_per_s": t["tokens_per_s"] * scale,
            "mfu": t["mfu"] * scale}
