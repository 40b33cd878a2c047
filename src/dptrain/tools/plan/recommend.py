"""`dptrain plan --recommend / --write`: the ranked table, the rejections by reason, the recipe file.

The search is plan/search.py; this module loads the config (with a `--model` preset as its lowest
layer), picks the global batch, prints, and writes the winner as a YAML recipe that
`config/load.py` reads back to the same Config.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dptrain.config.dotted import set_dotted
from dptrain.config.fields import DEFAULT_BATCH, ConfigError
from dptrain.config.load import (
    build_config,
    dump_yaml,
    load_command_line,
    load_config,
    load_file,
    parse_override,
)
from dptrain.config.resolve import resolve
from dptrain.launch.checks import check_file_writable
from dptrain.metrics.hardware import GpuSpec
from dptrain.tools.plan.llama import param_counts
from dptrain.tools.plan.memory import GB
from dptrain.tools.plan.predict import LLAMA, device_spec
from dptrain.tools.plan.presets import preset, preset_overrides
from dptrain.tools.plan.search import (
    Ranked,
    Rejected,
    SearchResult,
    data_parallel_degrees,
    rejected_groups,
    search,
)
from dptrain.tools.plan.timing import Link

if TYPE_CHECKING:
    from dptrain.config.fields import Config
    from dptrain.models.llama import LlamaConfig

CORPUS = "dptrain.data.corpus:build_stdlib_lm"


def _merge(into: dict[str, Any], top: dict[str, Any]) -> None:
    """Nested dict merge: `top`'s values win, sections and kwargs merged key by key."""
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def load_plan_config(items: list[str], *, model: str | None) -> Config:
    """CONFIG + overrides as `dptrain run` reads them; with `--model`, the preset's model.kwargs and
    data.kwargs.seq_len are the lowest layer (CONFIG, then the overrides, go on top)."""

    if model is None:
        return load_command_line(items)
    files = [item for item in items if "=" not in item]
    if len(files) > 1:
        raise ConfigError(f"{files[1]!r} is not an override of the form section.field=value "
                          f"(only one CONFIG file may be given; {files[0]!r} is the first)")
    data = preset_overrides(preset(model))
    if files:
        top = load_file(files[0])
        if top.get("data", {}).get("factory", CORPUS) != CORPUS:  # another dataset: its own kwargs
            data.pop("data")
        _merge(data, top)
    for item in items:
        if "=" in item:
            set_dotted(data, *parse_override(item))
    return build_config(data)


def global_batch(args: argparse.Namespace, cfg: Config, model: LlamaConfig) -> int:
    """`--global-batch`, else the config's (train.global_batch_size; micro x accum x all GPUs; or the
    built-in default); ValueError when it is < 1 or no searched data-parallel degree divides it."""

    t = cfg.train
    g = args.global_batch
    if g is None:
        g = t.global_batch_size or ((t.micro_batch_size or 1) * (t.grad_accum_steps or 1) * args.gpus
                                    if t.micro_batch_size or t.grad_accum_steps else DEFAULT_BATCH[0])
    dps = sorted({dp for _, _, dp in data_parallel_degrees(model, gpus=args.gpus, per_node=args.gpus // args.nodes)})
    if g < 1 or not any(g % dp == 0 for dp in dps):
        raise ValueError(f"--global-batch {g} is not divisible by any data-parallel degree of {args.gpus} GPUs "
                         f"(dp = gpus / (tp * pp): {', '.join(map(str, dps))}); use a multiple of one of them, "
                         f"e.g. {max(dps) * max(1, -(-g // max(dps)))}")
    return g


def recommend(args: argparse.Namespace, *, comm: Link | None, efficiency: tuple[float | None, str]) -> int:
    """Search, print the table and the rejections, and with `--write` write the winner."""
    # lazy: torch: the built-in LLaMA's config class (models/llama.py imports torch)
    from dptrain.models.llama import LlamaConfig

    if args.write and not Path(args.write).parent.is_dir():
        raise ConfigError(f"--write {args.write!r}: the directory {str(Path(args.write).parent)!r} does not exist")
    if args.write:
        check_file_writable(args.write, what="--write")
    cfg = load_plan_config(args.items, model=args.model)
    if cfg.model.factory != LLAMA:
        raise ConfigError(f"dptrain plan --recommend searches the built-in LLaMA ({LLAMA}) only, not "
                          f"model.factory={cfg.model.factory!r}")
    model = LlamaConfig(**cfg.model.kwargs)
    seq = int(cfg.data.kwargs.get("seq_len", model.max_seq_len))
    g = global_batch(args, cfg, model)
    spec = device_spec(args.gpu_type, ranks_per_host=args.gpus // args.nodes, gpu_memory=args.gpu_memory)
    start = time.perf_counter()
    result = search(cfg, model, spec, gpus=args.gpus, nodes=args.nodes, interconnect=args.interconnect,
                    global_batch=g, seq=seq, efficiency=efficiency[0], comm=comm)
    elapsed = time.perf_counter() - start
    if not result.ranked and all(r.memory is None for r in result.rejected) and result.rejected:
        raise ConfigError(f"no layout is accepted: {result.rejected[0].reason}")
    print(report(args, spec, cfg, model, result, elapsed=elapsed, efficiency=efficiency))
    if args.write:
        if not result.ranked:
            print(f"dptrain plan: no layout fits {spec.name}; {args.write} not written")
            return 1
        print(write_recipe(Path(args.write), result.ranked[0], args=args, spec=spec))
    return 0


def distinct(ranked: list[Ranked]) -> list[tuple[Ranked, str]]:
    """The ranked layouts with their labels, a `selective` one folded into the `none` one just before
    it when both predictions are the same."""
    rows: list[tuple[Ranked, str]] = []
    for r in ranked:
        if rows and r.cand.checkpointing == "selective":
            prev = rows[-1][0]
            if (dataclasses.replace(prev.cand, checkpointing="selective") == r.cand and prev.step_s == r.step_s
                    and prev.memory == r.memory):
                rows[-1] = (prev, prev.cand.label().replace("ckpt=none", "ckpt=none|selective"))
                continue
        rows.append((r, r.cand.label()))
    return rows


def _row(i: int, r: Ranked, label: str, gpus: int) -> str:
    t = r.time
    exposed = r.step_s - t["compute"]
    return (f"{i:>3}  {label:<58}{r.memory['total'] / GB:>8.1f}  yes {r.step_s:>9.4g}{t['compute']:>9.4g}"
            f"{exposed:>9.3g}{result_tokens(r) / gpus:>12,.0f}{r.mfu:>7.1%}")


def result_tokens(r: Ranked) -> float:
    """Tokens per second over all GPUs."""
    return r.time["tokens_per_s"]


def report(args: argparse.Namespace, spec: GpuSpec, cfg: Config, model: LlamaConfig, result: SearchResult, *,
           elapsed: float, efficiency: tuple[float | None, str]) -> str:

    n_fit, n_mem = len(result.ranked), sum(r.memory is not None for r in result.rejected)
    total = n_fit + len(result.rejected)
    name = f"{args.model} " if args.model else ""
    lines = [f"recommendation for {name}({param_counts(model).total:,} parameters) on {args.gpus} x {spec.name} "
             f"({args.nodes} node(s) x {args.gpus // args.nodes}, {args.interconnect}); global batch "
             f"{result.global_batch} x {result.seq} tokens; {cfg.precision.dtype}, {cfg.optim.name}; compute at "
             + (f"{efficiency[0]:.3g} x the dense peak ({efficiency[1]})" if efficiency[0] is not None else
                f"the share of the dense peak {efficiency[1]}")
             + (f"; data-parallel link measured, {args.comm}" if args.comm else ""),
             f"searched {total:,} layouts in {elapsed:.1f} s: {n_fit:,} fit, {len(result.rejected) - n_mem:,} refused "
             f"by dptrain's config checks, {n_mem:,} do not fit {spec.memory_gb:g} GB",
             f"{'#':>3}  {'layout (mb = micro-batch x accumulation)':<58}{'GB/rank':>8}  fits{'step s':>10}"
             f"{'compute':>9}{'+comm':>9}{'tok/s/GPU':>12}{'MFU':>7}"]
    lines += [_row(i, r, label, args.gpus) for i, (r, label) in enumerate(distinct(result.ranked)[:args.top], 1)]
    if not result.ranked:
        lines.append("  (none fits)")
    lines.append("+comm: exposed communication, cpu_offload's copies and host optimizer step (plan/timing.py)")
    if result.rejected:
        lines.append("rejected, by reason (count: reason; examples):")
    for reason, items in rejected_groups(result.rejected):
        first = items[0]
        if first.memory is not None:
            examples = "; ".join(f"{r.cand.label()} {r.memory / GB:.1f} GB" for r in _examples(items) if r.memory)
            lines.append(f"{len(items):>7,}: {reason} ({spec.memory_gb:g} GB); closest: {examples}")
        else:
            lines.append(f"{len(items):>7,}: {first.reason}")
            lines.append(f"         e.g. {'; '.join(r.cand.label() for r in _examples(items))}")
    return "\n".join(lines)


def _examples(items: list[Rejected], k: int = 3) -> list[Rejected]:
    """Up to k of `items`, in order, of different strategy / offload / tp / pp where there are such."""
    seen: set[tuple[str, bool, int, int, int]] = set()
    picked: list[Rejected] = []
    for r in items:
        key = (r.cand.strategy, r.cand.cpu_offload, r.cand.tp, r.cand.pp, r.cand.cp)
        if key not in seen:
            seen.add(key)
            picked.append(r)
        if len(picked) == k:
            break
    return picked or items[:k]


def recipe_config(winner: Ranked, *, gpus: int, nodes: int) -> Config:
    """The winner's config with the launch section for `gpus` over `nodes` nodes."""
    launch = dataclasses.replace(winner.cfg.launch, nproc_per_node=gpus // nodes, nnodes=nodes)
    return dataclasses.replace(winner.cfg, launch=launch)


def write_recipe(path: Path, winner: Ranked, *, args: argparse.Namespace, spec: GpuSpec) -> str:
    """Write the winner as YAML, read it back, check it is the same Config and that dptrain's
    `resolve` accepts it; the lines to print."""

    cfg = recipe_config(winner, gpus=args.gpus, nodes=args.nodes)
    header = (f"# dptrain plan --recommend on {args.gpus} x {spec.name} ({args.nodes} node(s), {args.interconnect}): "
              f"{winner.cand.label()}\n# predicted: {winner.memory['total'] / GB:.1f} GB per rank, step "
              f"{winner.step_s:.4g} s, MFU {winner.mfu:.1%}\n")
    path.write_text(header + dump_yaml(cfg), encoding="utf-8")
    back = load_config(path)
    if back != cfg:
        raise RuntimeError(f"{path} does not read back to the recommended config")  # a bug, not bad input
    lines = [f"wrote {path}: {winner.cand.label()}"]
    check = back
    if args.nodes > 1 and back.launch.rdzv_endpoint is None:
        lines.append(f"  on each of the {args.nodes} nodes: dptrain run {path} launch.rdzv_endpoint=HOST:PORT "
                     f"launch.node_rank=R (launch.nnodes={args.nodes} needs the rendezvous endpoint)")
        check = dataclasses.replace(back, launch=dataclasses.replace(back.launch, rdzv_endpoint="localhost:29500"))
    resolved = resolve(check, cuda_available=True)
    if resolved.world_size != args.gpus:
        raise RuntimeError(f"{path} resolves to {resolved.world_size} ranks, not {args.gpus}")
    lines.append(f"  dptrain run {path}" + ("" if args.nodes == 1 else " ...") + f": {args.gpus} ranks, "
                 f"micro-batch {resolved.micro_batch_size} x accumulation {resolved.grad_accum_steps} x dp "
                 f"{resolved.dp_world_size} = {resolved.global_batch_size}")
    return "\n".join(lines)
