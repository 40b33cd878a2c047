"""`dptrain plan`: memory per rank before any GPU is rented (pure arithmetic, no process group)."""

from __future__ import annotations

import argparse
import sys

from dptrain.plan.extra_time import with_extras
from dptrain.plan.memory import GB, OPTIMIZERS, PRECISIONS, layout_memory, zero_states
from dptrain.plan.presets import PRESETS, preset
from dptrain.plan.recommend import load_plan_config, recommend
from dptrain.plan.search import layout_from_config
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
    plan.add_argument("--model", help=f"a model preset for the built-in LLaMA ({', '.join(PRESETS)}): sets "
                      "model.kwargs and data.kwargs.seq_len; CONFIG and overrides apply on top")
    plan.add_argument("--recommend", action="store_true",
                      help="search every layout, rank those that fit by predicted step time, say why the others not")
    plan.add_argument("--top", type=int, default=10, help="--recommend: layouts to list (default 10)")
    plan.add_argument("--global-batch", type=int,
                      help="--recommend: sequences per optimizer step (default: the config's global batch)")
    plan.add_argument("--write", metavar="RECIPE.yaml",
                      help="write the best layout as a config `dptrain run` accepts (implies --recommend)")
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
        if args.top < 1:
            raise ValueError(f"--top {args.top} must be >= 1")
        if args.model is not None:
            preset(args.model)
        if args.global_batch is not None and not (args.recommend or args.write):
            raise ValueError(f"--global-batch {args.global_batch} applies to --recommend / --write; add one, or set "
                             "train.global_batch_size for a single layout")
        if args.params is not None:
            if args.recommend or args.write:
                raise ValueError("--params plans a bare parameter count; --recommend / --write need the built-in "
                                 "LLaMA (a CONFIG or --model)")
            if args.model is not None:
                raise ValueError(f"--params plans a bare parameter count; drop --model {args.model}")
            if args.items:
                raise ValueError(f"--params plans a bare parameter count; drop {' '.join(args.items)!r}")
            print(_zero_table(args, spec))
            return 0
        if args.recommend or args.write:
            return recommend(args, spec)
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


def _layout_report(args: argparse.Namespace, spec: GpuSpec) -> str:
    from dptrain.config.fields import ConfigError
    from dptrain.config.resolve import resolve
    from dptrain.models.llama import LlamaConfig

    cfg = load_plan_config(args.items, model=args.model)
    if cfg.model.factory != LLAMA:
        raise ConfigError(f"dptrain plan has exact formulas for the built-in LLaMA ({LLAMA}) only, not "
                          f"model.factory={cfg.model.factory!r}; give --params N for its model states")
    if cfg.parallel.strategy not in ("ddp", "zero1", "zero2", "fsdp"):
        raise ConfigError(f"dptrain plan covers parallel.strategy ddp, zero1, zero2, fsdp, not {cfg.parallel.strategy!r}")
    resolved = resolve(cfg, world_size=args.gpus, cuda_available=True)
    model = LlamaConfig(**cfg.model.kwargs)
    seq = int(cfg.data.kwargs.get("seq_len", model.max_seq_len))
    lay = layout_from_config(cfg, resolved, seq=seq)
    mem = layout_memory(model, lay)
    from dptrain.plan.llama import param_counts

    lines = [f"{param_counts(model).total:,} parameters; {cfg.parallel.strategy}"
             f"{' + cpu_offload' if lay.cpu_offload else ''} on {args.gpus} x {spec.name}: dp_shard {lay.dp_shard}, "
             f"tp {lay.tp}, pp {lay.pp}; micro-batch {lay.micro_batch} x {seq} tokens, {lay.precision}, "
             f"{lay.optimizer}, activation checkpointing {lay.checkpointing}",
             f"memory per rank (GB = 1e9 bytes; the worst pipeline stage: {int(mem['stage'])}):"]
    for key in ("params", "grads", "optimizer", "activations", "temporary", "overhead"):
        lines.append(f"  {key:<12}{mem[key] / GB:>10.3f}")
    lines.append(f"  {'total':<12}{mem['total'] / GB:>10.3f}  of {spec.memory_gb:g} GB: "
                 f"{'fits' if mem['total'] <= spec.memory_gb * GB else 'does NOT fit'}")
    if mem["host"]:
        lines.append(f"  host (cpu_offload): {mem['host'] / GB:.3f} GB per rank")
    t = step_time(model, lay, spec, gpus=args.gpus, nodes=args.nodes, interconnect=args.interconnect,
                  accum=resolved.grad_accum_steps, efficiency=args.efficiency)
    lines.append(f"time per step (alpha-beta model, compute at {args.efficiency:g} x the dense peak, an assumption; "
                 f"{args.nodes} node(s), {args.interconnect}): compute {t['compute']:.4g} s, data-parallel "
                 f"comm {t['dp_comm']:.4g} s (overlapped with backward), tensor-parallel comm {t['tp_comm']:.4g} s")
    lines.append(f"  step {t['step']:.4g} s, {t['tokens_per_s']:,.0f} tokens/s ({t['tokens_per_s'] / args.gpus:,.0f} "
                 f"per GPU), MFU {t['mfu']:.1%}")
    x = with_extras(model, lay, spec, t, host_bytes=mem["host"], gpus=args.gpus, nodes=args.nodes,
                    interconnect=args.interconnect, accum=resolved.grad_accum_steps)
    if x["offload"] or x["regather"]:
        lines.append(f"  with what step_time does not count yet (plan/extra_time.py: cpu_offload {x['offload']:.4g} s, "
                     f"fsdp re-gathers under pp {x['regather']:.4g} s of traffic): step {x['step']:.4g} s, "
                     f"{x['tokens_per_s'] / args.gpus:,.0f} tokens/s per GPU, MFU {x['mfu']:.1%}")
    return "\n".join(lines)
