"""Time that `parallel.cpu_offload` adds to a step (FSDP2's CPUOffloadPolicy), a stated model.

plan/timing.py's `step_time` does not see offload; the recommendation adds this on top so an
offloaded layout is not ranked as free:

- host-to-device copies of the rank's fp32 parameter shard before every all-gather (fsdp: two
  per micro-step, forward and backward; zero2: one), and one device-to-host copy of the fp32
  gradient shard per step, over the GPU's host link (PCIe, half the datasheet's bidirectional
  figure per direction), not overlapped (an upper bound: FSDP2 issues them with its all-gathers);
- the optimizer step on the host over the rank's shard at HOST_OPTIMIZER_PARAMS_PER_S.

HOST_OPTIMIZER_PARAMS_PER_S is an assumption: torch's foreach AdamW reached 1.3e8 parameters/s on
one core of this (loaded) machine; 5e8 supposes about four host cores per GPU. Not measured on a
GPU server.
"""

from __future__ import annotations

from dptrain.plan.memory import Layout, optimizer_bytes
from dptrain.plan.specs import GpuSpec

HOST_OPTIMIZER_PARAMS_PER_S = 5e8


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
