"""`dptrain plan` for a model other than the built-in LLaMA: measured on fake tensors
(plan/measure.py), then the same memory (`memory.profile_memory`) and time
(`timing.profile_step_time`) report as the LLaMA's formulas give."""

from __future__ import annotations

import argparse
from typing import Any

from dptrain.config.fields import ConfigError
from dptrain.plan.memory import profile_memory
from dptrain.plan.specs import GpuSpec
from dptrain.plan.timing import profile_step_time


def measured_report(args: argparse.Namespace, spec: GpuSpec, cfg: Any, resolved: Any) -> str:
    """The layout report of `cfg` (a Config, resolved for `args.gpus` ranks) for a measured model."""
    from dptrain.plan.cli import _layout, memory_lines
    from dptrain.plan.measure import measure_model

    dims = resolved.dims
    if dims.tp > 1 or dims.pp > 1:
        raise ConfigError(f"dptrain plan measures model.factory {cfg.model.factory!r} unsplit: tp={dims.tp}, "
                          f"pp={dims.pp} are planned for the built-in LLaMA only (dptrain's pipeline stages are "
                          "LLaMA's; a user's tp_plan is not modelled); plan tp = pp = 1")
    prof = measure_model(model=cfg.model, data=cfg.data, micro_batch=resolved.micro_batch_size,
                         precision=cfg.precision.dtype, loss=cfg.train.loss, collate=cfg.data.collate,
                         seed=cfg.train.seed)
    lay = _layout(cfg, resolved, seq=prof.seq_len or 0)
    mem = profile_memory(prof, lay)
    dtypes = ", ".join(f"{k} {v / 1e9:.3g} GB" for k, v in prof.bytes_by_dtype.items())
    sample = f"{lay.micro_batch} samples" + (f" x {prof.seq_len} tokens" if prof.seq_len else "")
    lines = [f"{prof.params:,} parameters ({prof.trainable:,} trainable; {dtypes}; {prof.units} FSDP units, "
             f"the largest {prof.largest_unit_bytes / 1e9:.3g} GB), measured on fake tensors (one micro-batch "
             f"forward and backward, no allocation): {cfg.model.factory}",
             f"{cfg.parallel.strategy}{' + cpu_offload' if lay.cpu_offload else ''} on {args.gpus} x {spec.name}: "
             f"dp_shard {lay.dp_shard}; micro-batch {sample}, {lay.precision}, {lay.optimizer}, activation "
             f"checkpointing {lay.checkpointing}",
             "memory per rank (GB = 1e9 bytes; activations: the bytes autograd saves for backward, measured):",
             *memory_lines(mem, spec)]
    if prof.block_recompute_bytes:
        lines.append(f"  saved for backward: {prof.outside_bytes / 1e9:.4g} GB outside the blocks, "
                     f"{len(prof.block_recompute_bytes)} blocks of up to "
                     f"{max(prof.block_recompute_bytes) / 1e9:.4g} GB besides their inputs "
                     f"({prof.block_input_bytes / 1e9:.4g} GB); checkpointing none "
                     f"{prof.activation_bytes('none') / 1e9:.4g} GB, full {prof.activation_bytes('full') / 1e9:.4g} GB")
    t = profile_step_time(prof, lay, spec, gpus=args.gpus, nodes=args.nodes, interconnect=args.interconnect,
                          accum=resolved.grad_accum_steps, efficiency=args.efficiency)
    lines.append(f"time per step (alpha-beta model, {t['flops_per_step']:.4g} measured FLOPs per rank at "
                 f"{args.efficiency:g} x the dense peak, an assumption; {args.nodes} node(s), {args.interconnect}): "
                 f"compute {t['compute']:.4g} s, data-parallel comm {t['dp_comm']:.4g} s (overlapped with backward)")
    rate = f"{t['samples_per_s']:,.1f} samples/s"
    if t["tokens_per_s"]:
        rate += f", {t['tokens_per_s']:,.0f} tokens/s ({t['tokens_per_s'] / args.gpus:,.0f} per GPU)"
    lines.append(f"  step {t['step']:.4g} s, {rate}, MFU {t['mfu']:.1%}")
    return "\n".join(lines)
