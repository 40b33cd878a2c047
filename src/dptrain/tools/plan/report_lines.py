"""The text of a `dptrain plan` layout report shared by the built-in LLaMA's formulas (cli/plan.py)
and a measured model's report (measured.py): the memory table and the time lines."""

from __future__ import annotations

import argparse
from typing import Any

from dptrain.metrics.hardware import GpuSpec
from dptrain.tools.plan.memory import GB


def memory_lines(mem: dict[str, float], spec: GpuSpec) -> list[str]:
    """The per-rank memory table of a layout report, and whether it fits `spec`."""
    lines = [f"  {key:<12}{mem[key] / GB:>10.3f}" for key in ("params", "grads", "optimizer", "activations",
                                                              "temporary", "overhead")]
    lines.append(f"  {'total':<12}{mem['total'] / GB:>10.3f}  of {spec.memory_gb:g} GB: "
                 f"{'fits' if mem['total'] <= spec.memory_gb * GB else 'does NOT fit'}")
    if mem["host"]:
        lines.append(f"  host (cpu_offload): {mem['host'] / GB:.3f} GB per rank")
    return lines


def efficiency_text(value: float, source: str) -> str:
    """`compute at E x the dense peak, SOURCE`."""
    return f"compute at {value:.3g} x the dense peak, {source}"


def gpu_lines(spec: GpuSpec) -> list[str]:
    """What the table says is estimated about the GPU (e.g. the 96 GB H100's peak)."""
    return [f"note on {spec.name}: {spec.note}"] if spec.note else []


def time_lines(args: argparse.Namespace, t: dict[str, float], *, comm: Any,
               efficiency: tuple[float | None, str], cp_attention: str = "allgather") -> list[str]:
    """The time part of a layout report (`step_time` / `profile_step_time`'s result; `cp_attention`: the cp
    attention the layout runs, allgather or ulysses)."""
    link = "measured, " + args.comm if comm else f"{args.interconnect} datasheet"
    used = efficiency[0] if efficiency[0] is not None else t.get("efficiency", 0.0)
    lines = [f"time per step (alpha-beta model; {efficiency_text(used, efficiency[1])}; "
             f"{args.nodes} node(s), data-parallel link {link}):",
             f"  compute {t['compute']:.4g} s, data-parallel comm {t['dp_comm']:.4g} s of which exposed "
             f"{t['exposed_comm']:.4g} s, tensor-parallel comm {t['tp_comm']:.4g} s, pipeline transfers (exposed) "
             f"{t['pp_comm']:.4g} s"]
    if t.get("cp_comm") and cp_attention == "ulysses":
        lines.append(f"  context-parallel Ulysses exchange (4 all-to-alls on heads a layer, q, k, v and the output, "
                     f"as many in backward; not overlapped): {t['cp_comm']:.4g} s")
    elif t.get("cp_comm"):
        lines.append(f"  context-parallel K/V exchange (all-gathers before attention, reduce-scatters in backward; "
                     f"not overlapped): {t['cp_comm']:.4g} s")
    rate = f"{t['samples_per_s']:,.1f} samples/s, " if "samples_per_s" in t else ""
    if t["tokens_per_s"]:
        rate += f"{t['tokens_per_s']:,.0f} tokens/s ({t['tokens_per_s'] / args.gpus:,.0f} per GPU), "
    lines.append(f"  step {t['step']:.4g} s, {rate}MFU {t['mfu']:.1%}")
    if t["offload"]:
        lines.append(f"  of which cpu_offload's host copies and optimizer step: {t['offload']:.4g} s")
    return lines
