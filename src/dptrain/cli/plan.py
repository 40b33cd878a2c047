"""`dptrain plan`: memory per rank before any GPU is rented (pure arithmetic, no process group)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dptrain.cli.arg_types import positive_float, positive_int
from dptrain.metrics.hardware import GpuSpec, gpu_spec, with_memory
from dptrain.tools.plan.calibrate import calibrated_efficiency, link_from_sweep, load_sweep
from dptrain.tools.plan.efficiency import MEASURED_EFFICIENCY
from dptrain.tools.plan.gpt import deepspeed_zero2_gpu_bytes, deepspeed_zero3_gpu_bytes
from dptrain.tools.plan.llama import param_counts
from dptrain.tools.plan.measured import measured_report
from dptrain.tools.plan.memory import GB, OPTIMIZERS, PRECISIONS, zero_states
from dptrain.tools.plan.predict import LLAMA, device_spec, predict, scaling
from dptrain.tools.plan.presets import PRESETS, preset
from dptrain.tools.plan.recommend import load_plan_config, recommend
from dptrain.tools.plan.report_lines import gpu_lines, memory_lines, time_lines
from dptrain.tools.plan.timing import INTERCONNECT_CHOICES

DEFAULT_EFFICIENCY = MEASURED_EFFICIENCY  # a measured model's and the CPU's stated share (plan/efficiency.py)
MODELLED = ("modelled per layout (plan/efficiency.py): GEMM rooflines at the GPU's measured MAMF, FlashAttention-2's "
            "measured share, memory-bound ops at HBM bandwidth, x 0.667 sustained (set from MosaicML's MPT-7B run)")


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan", help="memory per rank of a layout (or ZeRO stages 0-3 for --params) and whether it fits"
    )
    plan.add_argument("items", nargs="*", metavar="[CONFIG] [section.field=value ...]")
    plan.add_argument("--gpus", type=positive_int, default=1, help="ranks (GPUs) in all (default 1)")
    plan.add_argument("--gpu-type", default="H100", help="GPU model of metrics/hardware.py (default H100 = H100-SXM)")
    plan.add_argument("--gpu-memory", type=positive_float, metavar="GB",
                      help="the GPU's memory in GB when it differs from the table's (a variant, e.g. 96)")
    plan.add_argument(
        "--params", type=positive_float, help="a model given only by its parameter count: ZeRO stages 0-3"
    )
    plan.add_argument("--optimizer", default="adam", help=f"--params: {', '.join(OPTIMIZERS)} (default adam)")
    plan.add_argument("--precision", default="fp16", help=f"--params: {', '.join(PRECISIONS)} (default fp16)")
    plan.add_argument("--convention", default="zero", choices=("zero", "deepspeed"),
                      help="--params: the ZeRO paper's bytes per parameter (default) or DeepSpeed's estimators "
                      "(estimate_zero2/3_model_states_mem_needs: 18 bytes per parameter and the largest layer)")
    plan.add_argument("--largest-layer", type=positive_float, metavar="N",
                      help="--params --convention deepspeed: parameters of the largest layer (ZeRO-3's gathered "
                      "layer; default: none given, 0)")
    plan.add_argument("--offload", default="none", choices=("none", "optimizer", "optimizer+params"),
                      help="--params --convention deepspeed: what ZeRO-Offload moves to the host")
    plan.add_argument("--nodes", type=positive_int, default=1, help="nodes the GPUs are spread over (default 1)")
    plan.add_argument(
        "--interconnect", default="ib", help="between nodes: ib or ethernet; inside: nvlink or pcie (default ib)"
    )
    plan.add_argument(
        "--efficiency",
        type=positive_float,
        default=None,
        help="achieved share of the dense peak for compute (a stated assumption; default: modelled per layout from "
        "the GEMM shapes, attention and the GPU, plan/efficiency.py)",
    )
    plan.add_argument(
        "--calibrate",
        metavar="RUN_DIR",
        help="take the efficiency from a finished `dptrain run` (its run directory's metrics.jsonl)",
    )
    plan.add_argument(
        "--comm",
        metavar="FILE",
        help="data-parallel link: alpha and beta fitted to `dptrain doctor --comm --json FILE` "
        "(default: the interconnect's datasheet figures)",
    )
    plan.add_argument(
        "--scaling",
        action="store_true",
        help="also predict 1, 2, 4, ... --gpus ranks: step time, tokens/s and scaling efficiency",
    )
    plan.add_argument(
        "--model",
        help=f"a model preset for the built-in LLaMA ({', '.join(PRESETS)}): sets "
        "model.kwargs and data.kwargs.seq_len; CONFIG and overrides apply on top",
    )
    plan.add_argument(
        "--recommend",
        action="store_true",
        help="search every layout, rank those that fit by predicted step time, say why the others not",
    )
    plan.add_argument("--top", type=int, default=10, help="--recommend: layouts to list (default 10)")
    plan.add_argument(
        "--global-batch",
        type=int,
        help="--recommend: sequences per optimizer step (default: the config's global batch)",
    )
    plan.add_argument(
        "--write",
        metavar="RECIPE.yaml",
        help="write the best layout as a config `dptrain run` accepts (implies --recommend)",
    )
    plan.set_defaults(func=cmd_plan)


def _gb(x: float) -> str:
    return f"{x / GB:.1f}".removesuffix(".0")


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        if args.gpu_type.lower() != "cpu":
            with_memory(gpu_spec(args.gpu_type), args.gpu_memory)  # an unknown name fails here, before any config
        if args.gpus < 1:
            raise ValueError(f"--gpus {args.gpus} must be >= 1")
        if args.nodes < 1 or args.gpus % args.nodes:
            raise ValueError(f"--nodes {args.nodes} must be >= 1 and divide --gpus {args.gpus}")
        if args.interconnect not in INTERCONNECT_CHOICES:
            raise ValueError(f"unknown interconnect {args.interconnect!r} (valid: {', '.join(INTERCONNECT_CHOICES)})")
        if args.efficiency is not None and not 0 < args.efficiency <= 1:
            raise ValueError(f"--efficiency {args.efficiency} must be in (0, 1]")
        if args.top < 1:
            raise ValueError(f"--top {args.top} must be >= 1")
        if args.model is not None:
            preset(args.model)
        if args.global_batch is not None and not (args.recommend or args.write):
            raise ValueError(
                f"--global-batch {args.global_batch} applies to --recommend / --write; add one, or set "
                "train.global_batch_size for a single layout"
            )
        if args.gpu_type.lower() == "cpu" and args.gpus > args.nodes and not args.comm:
            raise ValueError(
                "--gpu-type cpu with more than one rank per host needs --comm FILE (the gloo link of "
                "this machine: `dptrain doctor --comm --json FILE`)"
            )
        if args.gpu_type.lower() == "cpu" and args.nodes > 1 and not args.comm:
            raise ValueError("--gpu-type cpu across --nodes needs --comm FILE (a sweep over that link)")
        comm = _comm_link(args.comm)
        efficiency = _efficiency(args)
        if args.params is not None:
            if args.recommend or args.write:
                raise ValueError(
                    "--params plans a bare parameter count; --recommend / --write need the built-in "
                    "LLaMA (a CONFIG or --model)"
                )
            if args.model is not None:
                raise ValueError(f"--params plans a bare parameter count; drop --model {args.model}")
            if args.items:
                raise ValueError(f"--params plans a bare parameter count; drop {' '.join(args.items)!r}")
            spec = device_spec(args.gpu_type, ranks_per_host=args.gpus // args.nodes, gpu_memory=args.gpu_memory)
            print(_deepspeed_table(args, spec) if args.convention == "deepspeed" else _zero_table(args, spec))
            return 0
        if args.recommend or args.write:
            return recommend(args, comm=comm, efficiency=efficiency)
    except ValueError as e:
        print(f"dptrain plan: error: {e}", file=sys.stderr)
        return 2
    print(_layout_report(args, comm=comm, efficiency=efficiency))
    return 0


def _comm_link(path: str | None):  # noqa: ANN202 (Link: plan.timing)
    if path is None:
        return None

    return link_from_sweep(load_sweep(path))


def _efficiency(args: argparse.Namespace) -> tuple[float | None, str]:
    """(efficiency, where it comes from); None: modelled per layout."""
    if args.calibrate is None:
        if args.efficiency is None:
            if args.gpu_type.lower() == "cpu":
                return DEFAULT_EFFICIENCY, "assumed on the CPU: the Llama 3 paper's lowest BF16 MFU on H100s"
            return None, MODELLED
        return args.efficiency, "assumed (--efficiency)"

    return calibrated_efficiency(args.calibrate, cpu=args.gpu_type.lower() == "cpu")


def _zero_table(args: argparse.Namespace, spec: GpuSpec) -> str:
    states = zero_states(params=args.params, gpus=args.gpus, optimizer=args.optimizer, precision=args.precision)
    names = {0: "0 (DDP)", 1: "1 (optimizer states)", 2: "2 (+ gradients)", 3: "3 (+ parameters)"}
    lines = [
        f"model states per GPU: {args.params:g} parameters, {args.gpus} GPUs, {args.optimizer}, "
        f"{args.precision} (ZeRO paper convention; GB = 1e9 bytes)",
        f"{'ZeRO stage':<22}{'GB per GPU':>12}  fits {spec.name} ({spec.memory_gb:g} GB)",
    ]
    for stage, nbytes in states.items():
        lines.append(f"{names[stage]:<22}{_gb(nbytes):>12}  {'yes' if nbytes <= spec.memory_gb * GB else 'no'}")
    lines.append("model states only: activations, buffers and overhead come on top (give a CONFIG for those)")
    return "\n".join(lines)


def _deepspeed_table(args: argparse.Namespace, spec: GpuSpec) -> str:
    p, n, largest = args.params, args.gpus, args.largest_layer or 0.0
    z2 = deepspeed_zero2_gpu_bytes(p, n, offload=args.offload != "none")
    z3 = deepspeed_zero3_gpu_bytes(p, largest, n, offload=args.offload)
    lines = [f"model states per GPU: {p:g} parameters, {n} GPUs, largest layer {largest:g} parameters, offload "
             f"{args.offload} (DeepSpeed's estimate_zero2/3_model_states_mem_needs; GB = 1e9 bytes)",
             f"{'ZeRO stage':<22}{'GB per GPU':>12}  fits {spec.name} ({spec.memory_gb:g} GB)"]
    for name, nbytes in (("2 (+ gradients)", z2), ("3 (+ parameters)", z3)):
        lines.append(f"{name:<22}{_gb(nbytes):>12}  {'yes' if nbytes <= spec.memory_gb * GB else 'no'}")
    lines.append("model states only: activations, buffers and overhead come on top (give a CONFIG for those)")
    return "\n".join(lines)


def _layout_report(args: argparse.Namespace, *, comm, efficiency: tuple[float | None, str]) -> str:  # noqa: ANN001
    cfg = load_plan_config(args.items, model=args.model)
    if cfg.model.factory != LLAMA:
        return measured_report(args, cfg, comm=comm, efficiency=efficiency)
    pr = predict(cfg, **_cluster(args), comm=comm, efficiency=efficiency[0])
    model, lay, mem, t, spec, seq = pr.model, pr.layout, pr.memory, pr.time, pr.spec, pr.layout.seq

    lines = [
        f"{param_counts(model).total:,} parameters; {cfg.parallel.strategy}"
        f"{' + cpu_offload' if lay.cpu_offload else ''} on {args.gpus} x {spec.name}: dp_shard {lay.dp_shard}, "
        f"tp {lay.tp}, pp {lay.pp}{cp_text(lay.cp)}; micro-batch {lay.micro_batch} x {seq} tokens, {lay.precision}, "
        f"{lay.optimizer}, activation checkpointing {lay.checkpointing}",
        f"memory per rank (GB = 1e9 bytes; the worst pipeline stage: {int(mem['stage'])}):",
        *memory_lines(mem, spec),
        *gpu_lines(spec),
    ]
    lines += time_lines(args, t, comm=comm, efficiency=efficiency, cp_attention=lay.cp_attention)
    if args.scaling:
        lines += _scaling_lines(args, cfg, comm=comm, efficiency=efficiency[0])
    return "\n".join(lines)


def cp_text(cp: int) -> str:
    """`, cp N` in a layout's headline when the row is split (dp_shard then counts dp_shard x cp: FSDP2's mesh)."""
    return f", cp {cp}" if cp > 1 else ""


def _cluster(args: argparse.Namespace) -> dict[str, Any]:
    """The cluster the command line describes, as `predict` and `scaling` take it."""
    return {"gpus": args.gpus, "nodes": args.nodes, "gpu_type": args.gpu_type, "interconnect": args.interconnect,
            "gpu_memory": args.gpu_memory}


def _scaling_lines(args: argparse.Namespace, cfg, *, comm, efficiency: float | None) -> list[str]:  # noqa: ANN001
    rows = scaling(cfg, **_cluster(args), comm=comm, efficiency=efficiency)
    lines = [
        "scaling (the config resolved at each world size; efficiency = tokens/s per rank / tokens/s at 1 rank):",
        f"  {'ranks':>5} {'nodes':>5} {'global':>7} {'micro x accum':>13} {'step s':>9} {'tokens/s':>11} "
        f"{'per rank':>9} {'exposed comm s':>14} {'efficiency':>10}",
    ]
    for r in rows:
        if "refused" in r:
            lines.append(f"  {r['ranks']:>5} {r['nodes']:>5} refused: {r['refused']}")
            continue
        lines.append(
            f"  {r['ranks']:>5} {r['nodes']:>5} {r['global_batch']:>7} {r['micro_accum']:>13} "
            f"{r['step']:>9.4g} {r['tokens_per_s']:>11,.0f} {r['tokens_per_s'] / r['ranks']:>9,.0f} "
            f"{r['exposed_comm']:>14.4g} {r['efficiency']:>10.1%}"
        )
    return lines
