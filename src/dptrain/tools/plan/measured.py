"""`dptrain plan` for a model other than the built-in LLaMA: measured on fake tensors
(plan/measure.py), then the same memory (`memory.profile_memory`) and time
(`timing.profile_step_time`) report as the LLaMA's formulas give."""

from __future__ import annotations

import argparse
from typing import Any

from dptrain.config.fields import ConfigError
from dptrain.tools.plan.efficiency import MEASURED_EFFICIENCY
from dptrain.tools.plan.measure import measure_model
from dptrain.tools.plan.memory import profile_memory
from dptrain.tools.plan.predict import device_spec, layout_from_config, resolve_for_plan
from dptrain.tools.plan.report_lines import memory_lines, time_lines
from dptrain.tools.plan.timing import Link, profile_step_time


def measured_report(args: argparse.Namespace, cfg: Any, *, comm: Link | None,
                    efficiency: tuple[float | None, str]) -> str:
    """The layout report of `cfg` (a Config) on `args.gpus` ranks for a measured model."""

    resolved = resolve_for_plan(cfg, gpus=args.gpus, gpu_type=args.gpu_type)
    spec = device_spec(args.gpu_type, ranks_per_host=args.gpus // args.nodes, gpu_memory=args.gpu_memory)
    dims = resolved.dims
    if dims.tp > 1 or dims.pp > 1:
        raise ConfigError(f"dptrain plan measures model.factory {cfg.model.factory!r} unsplit: tp={dims.tp}, "
                          f"pp={dims.pp} are planned for the built-in LLaMA only (dptrain's pipeline stages are "
                          "LLaMA's; a user's tp_plan is not modelled); plan tp = pp = 1")
    prof = measure_model(model=cfg.model, data=cfg.data, micro_batch=resolved.micro_batch_size,
                         precision=cfg.precision.dtype, loss=cfg.train.loss, collate=cfg.data.collate,
                         seed=cfg.train.seed)
    lay = layout_from_config(cfg, resolved, seq=prof.seq_len or 0, cpu=spec.key == "cpu")
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
    if efficiency[0] is None:  # no model of a measured model's kernels: the stated share
        efficiency = (MEASURED_EFFICIENCY, "assumed for a measured model: the Llama 3 paper's lowest BF16 MFU on H100s")
    t = profile_step_time(prof, lay, spec, gpus=args.gpus, nodes=args.nodes, interconnect=args.interconnect,
                          accum=resolved.grad_accum_steps, efficiency=efficiency[0] or MEASURED_EFFICIENCY, comm=comm)
    lines.append(f"compute: {t['flops_per_step']:.4g} measured FLOPs per rank per step")
    lines += time_lines(args, t, comm=comm, efficiency=efficiency)
    return "\n".join(lines)
