"""`dptrain plan`: memory per rank before any GPU is rented (pure arithmetic, no process group)."""

from __future__ import annotations

import argparse
import sys

from dptrain.plan.memory import GB, OPTIMIZERS, PRECISIONS, Layout, layout_memory, zero_states
from dptrain.plan.specs import GpuSpec, gpu_spec
from dptrain.plan.timing import INTERCONNECT_CHOICES, step_time

LLAMA = "dptrain.models.llama:build_llama"


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="memory per rank of a layout (or ZeRO stages 0-3 for --params) and whether it fits")
    plan.add_argument("items", nargs="*", metavar="[CONFIG] [section.field=value ...]")
    plan.add_argument("--gpus", type=int, default=1, help="ranks (GPUs) in all (default 1)")
    plan.add_argument("--gpu-type", default="H100", help="GPU model of plan/specs.py (default H100 = H100-SXM)")
    plan.add_argument("--params", type=float, help="a model given only by its parameter count: ZeRO stages 0-3")
    plan.add_argument("--optimizer", default="adam", help=f"--params: {', '.join(OPTIMIZERS)} (default adam)")
    plan.add_argument("--precision", default="fp16", help=f"--params: {', '.join(PRECISIONS)} (default fp16)")
    plan.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (default 1)")
    plan.add_argument("--interconnect", default="ib", help="between nodes: ib or ethernet; inside: nvlink or pcie (default ib)")
    plan.add_argument("--efficiency", type=float, default=0.4,
                      help="achieved share of the dense peak for compute (a stated assumption; default 0.4)")
    plan.set_defaults(func=cmd_plan)


def _gb(x: float) -> str:
    return f"{x / GB:.1f}".removesuffix(".0")


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        spec = gpu_spec(args.gpu_type)
        if args.gpus < 1:
            raise ValueError(f"--gpus {args.gpus} must be >= 1")
        if args.nodes < 1 or args.gpus % args.nodes:
            raise ValueError(f"--nodes {args.nodes} must be >= 1 and divide --gpus {args.gpus}")
        if args.interconnect not in INTERCONNECT_CHOICES:
            raise ValueError(f"unknown interconnect {args.interconnect!r} (valid: {', '.join(INTERCONNECT_CHOICES)})")
        if not 0 < args.efficiency <= 1:
            raise ValueError(f"--efficiency {args.efficiency} must be in (0, 1]")
        if args.params is not None:
            if args.items:
                raise ValueError(f"--params plans a bare parameter count; drop {' '.join(args.items)!r}")
            print(_zero_table(args, spec))
            return 0
    except ValueError as e:
        print(f"dptrain plan: error: {e}", file=sys.stderr)
        return 2
    print(_layout_report(args, spec))
    return 0


def _zero_table(args: argparse.Namespace, spec: GpuSpec) -> str:
    states = zero_states(params=args.params, gpus=args.gpus, optimizer=args.optimizer, precision=args.precision)
    names = {0: "0 (DDP)", 1: "1 (optimizer states)", 2: "2 (+ gradients)", 3: "3 (+ parameters)"}
    lines = [f"model states per GPU: {args.params:g} parameters, {args.gpus} GPUs, {args.optimizer}, "
             f"{args.precision} (ZeRO paper convention; GB = 1e9 bytes)",
             f"{'ZeRO stage':<22}{'GB per GPU':>12}  fits {spec.name} ({spec.memory_gb:g} GB)"]
    for stage, nbytes in states.items():
        lines.append(f"{names[stage]:<22}{_gb(nbytes):>12}  {'yes' if nbytes <= spec.memory_gb * GB else 'no'}")
    lines.append("model states only: activations, buffers and overhead come on top (give a CONFIG for those)")
    return "\n".join(lines)


def _layout(cfg, resolved, *, seq: int) -> Layout:  # noqa: ANN001 (Config, Resolved: imported lazily)
    p, dims = cfg.parallel, resolved.dims
    optimizer = cfg.optim.name if cfg.optim.name != "sgd" or not cfg.optim.momentum else "sgd-momentum"
    shard = resolved.dp_world_size if p.strategy == "zero1" else dims.dp_shard
    return Layout(strategy=p.strategy, dp_shard=shard, tp=dims.tp, pp=dims.pp,
                  micro_batch=resolved.micro_batch_size, seq=seq, precision=cfg.precision.dtype,
                  optimizer=optimizer, checkpointing=p.activation_checkpointing, cpu_offload=p.cpu_offload,
                  bucket_cap_mb=p.bucket_cap_mb, gradient_as_bucket_view=p.gradient_as_bucket_view,
                  pp_microbatches=p.pp_microbatches or dims.pp, pp_schedule=p.pp_schedule, pp_layers=p.pp_layers)


def memory_lines(mem: dict[str, float], spec: GpuSpec) -> list[str]:
    """The per-rank memory table of a layout report, and whether it fits `spec`."""
    lines = [f"  {key:<12}{mem[key] / GB:>10.3f}" for key in ("params", "grads", "optimizer", "activations",
                                                              "temporary", "overhead")]
    lines.append(f"  {'total':<12}{mem['total'] / GB:>10.3f}  of {spec.memory_gb:g} GB: "
                 f"{'fits' if mem['total'] <= spec.memory_gb * GB else 'does NOT fit'}")
    if mem["host"]:
        lines.append(f"  host (cpu_offload): {mem['host'] / GB:.3f} GB per rank")
    return lines


def _layout_report(args: argparse.Namespace, spec: GpuSpec) -> str:
    from dptrain.cli import _load
    from dptrain.config.fields import ConfigError
    from dptrain.config.resolve import resolve
    from dptrain.models.llama import LlamaConfig

    cfg = _load(args.items, extra=[])
    if cfg.parallel.strategy not in ("ddp", "zero1", "zero2", "fsdp"):
        raise ConfigError(f"dptrain plan covers parallel.strategy ddp, zero1, zero2, fsdp, not {cfg.parallel.strategy!r}")
    resolved = resolve(cfg, world_size=args.gpus, cuda_available=True)
    if cfg.model.factory != LLAMA:
        from dptrain.plan.measured import measured_report

        return measured_report(args, spec, cfg, resolved)
    model = LlamaConfig(**cfg.model.kwargs)
    seq = int(cfg.data.kwargs.get("seq_len", model.max_seq_len))
    lay = _layout(cfg, resolved, seq=seq)
    mem = layout_memory(model, lay)
    from dptrain.plan.llama import param_counts

    lines = [f"{param_counts(model).total:,} parameters; {cfg.parallel.strategy}"
             f"{' + cpu_offload' if lay.cpu_offload else ''} on {args.gpus} x {spec.name}: dp_shard {lay.dp_shard}, "
             f"tp {lay.tp}, pp {lay.pp}; micro-batch {lay.micro_batch} x {seq} tokens, {lay.precision}, "
             f"{lay.optimizer}, activation checkpointing {lay.checkpointing}",
             f"memory per rank (GB = 1e9 bytes; the worst pipeline stage: {int(mem['stage'])}):",
             *memory_lines(mem, spec)]
    t = step_time(model, lay, spec, gpus=args.gpus, nodes=args.nodes, interconnect=args.interconnect,
                  accum=resolved.grad_accum_steps, efficiency=args.efficiency)
    lines.append(f"time per step (alpha-beta model, compute at {args.efficiency:g} x the dense peak, an assumption; "
                 f"{args.nodes} node(s), {args.interconnect}): compute {t['compute']:.4g} s, data-parallel "
                 f"comm {t['dp_comm']:.4g} s (overlapped with backward), tensor-parallel comm {t['tp_comm']:.4g} s")
    lines.append(f"  step {t['step']:.4g} s, {t['tokens_per_s']:,.0f} tokens/s ({t['tokens_per_s'] / args.gpus:,.0f} "
                 f"per GPU), MFU {t['mfu']:.1%}")
    return "\n".join(lines)
