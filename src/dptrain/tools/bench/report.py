"""The numbers `dptrain bench` reports: derived columns, the rich table, bench.json, PNG plots.

Scaling efficiency is throughput at world w over w times the same variant's throughput at world 1:
strong (same global batch) = T1 / (w * Tw), weak (same per-rank batch) = T1 / Tw, with T the
median step time. `vs raw` is the variant's median step time over the raw DDP loop's at the same
world size and mode (> 1: slower than the hand-written loop).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

from dptrain.metrics import strict_json
from dptrain.tools.bench.cells import REFERENCE, BenchOptions

JSON_NAME = "bench.json"


def _derive(row: dict[str, Any], *, base: dict[str, Any] | None, raw: dict[str, Any] | None) -> dict[str, Any]:
    med, world, mode = row["median_s"], row["world"], row["mode"]
    samples = row["global_batch_size"] / med
    tokens = samples * row["tokens_per_sample"] if row["tokens_per_sample"] else None
    eff = None
    if mode == "base":
        eff = 1.0
    elif base is not None and mode == "strong":
        eff = base["median_s"] / (world * med)
    elif base is not None and mode == "weak":
        eff = base["median_s"] / med
    return {**row, "samples_per_s": samples, "tokens_per_s": tokens, "scaling_efficiency": eff,
            "vs_raw": med / raw["median_s"] if raw is not None else None}


def summarize(results: list[dict[str, Any]], *, skipped: list[dict[str, Any]], opts: BenchOptions) -> dict[str, Any]:
    """bench.json's content: every measured row with its derived columns, the skipped cells, the setup."""
    rows = [r for res in results for r in res["rows"]]
    by_key = {(r["variant"], r["world"], r["mode"]): r for r in rows}
    derived = [_derive(r, base=by_key.get((r["variant"], 1, "base")),
                       raw=by_key.get((REFERENCE, r["world"], r["mode"]))) for r in rows]
    return {
        "options": {**dataclasses.asdict(opts), "variants": list(opts.variants)},
        "device": results[0]["device"] if results else None,
        "backend": results[0]["backend"] if results else None,
        "peak_rss_mib": {str(res["world"]): res["peak_rss_mib"] for res in results},
        "rows": derived,
        "skipped": skipped,
    }


def _fmt(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None or not math.isfinite(v) else format(v * scale, spec)


def _bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= size:
            return f"{v / size:.1f} {unit}"
    return f"{v:.0f} B"


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in summary["rows"]:
        mem = r["cuda_peak_mib"] if r["cuda_peak_mib"] is not None else r["state_mib"]
        out.append([
            r["variant"], str(r["world"]), r["mode"], _fmt(r["median_s"], ".1f", 1e3),
            f"{r['q1_s'] * 1e3:.1f}-{r['q3_s'] * 1e3:.1f}", _fmt(r["tokens_per_s"] or r["samples_per_s"], ",.0f"),
            _fmt(r["scaling_efficiency"], ".2f"), _bytes(r["comm_bytes"]), _fmt(mem, ".1f"), _fmt(r["loss"], ".4f"),
            _fmt(r["vs_raw"], ".3f"),
        ])
    return out


def print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = summary["rows"]
    tokens = bool(rows) and rows[0]["tokens_per_sample"] is not None
    mem = "CUDA peak MiB" if summary["device"] == "cuda" else "state MiB/rank"
    opts = summary["options"]
    table = Table(title=f"dptrain bench: {opts['steps']} timed steps per variant ({opts['warmup']} warm-up excluded), "
                        f"interleaved; device {summary['device']}, backend {summary['backend']}")
    for name in ("variant", "world", "mode", "median ms", "IQR ms", "tokens/s" if tokens else "samples/s",
                 "scaling eff", "comm/rank", mem, "loss", "vs raw"):
        table.add_column(name, justify="left" if name in ("variant", "mode") else "right")
    for cells in table_rows(summary):
        table.add_row(*cells)
    console = Console(width=200)
    console.print(table)
    if any((r["scaling_efficiency"] or 0) > 1.1 for r in rows):
        console.print("note: scaling efficiency above 1: each world size is its own launch (only the variants within a "
                      "launch are interleaved), so a change in machine load between launches, or a scheduler giving "
                      "more ranks a larger share of a busy machine, shows up here; compare within a world size",
                      soft_wrap=True)
    for s in summary["skipped"]:
        console.print(f"skipped: {s['variant']} at world {s['world']} ({s['mode']}): {s['skipped']}", soft_wrap=True)


def write(summary: dict[str, Any], *, out: Path) -> None:
    """bench.json, then the PNG plots (skipped, with a message, without matplotlib)."""

    (out / JSON_NAME).write_text(strict_json.dumps(summary, indent=1) + "\n")
    print(f"dptrain bench: wrote {out / JSON_NAME}", file=sys.stderr)
    try:
        import matplotlib
    except ImportError:
        print("dptrain bench: PNG plots skipped: matplotlib is not installed (pip install 'dptrain[bench]')",
              file=sys.stderr)
        return
    matplotlib.use("Agg")
    for path in plot(summary, out=out):
        print(f"dptrain bench: wrote {path}", file=sys.stderr)


def plot(summary: dict[str, Any], *, out: Path) -> list[Path]:
    """step_times.png (per-step times of every variant, box per cell) and scaling.png (efficiency)."""
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    paths = []
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(rows)), 4.5))
    ax.boxplot([[t * 1e3 for t in r["times_s"]] for r in rows], showfliers=True)
    ax.set_xticks(range(1, len(rows) + 1), [f"{r['variant']}\nw{r['world']} {r['mode']}" for r in rows],
                  rotation=90, fontsize=7)
    ax.set_ylabel("step time (ms)")
    ax.set_title("dptrain bench: step time per variant (interleaved)")
    fig.tight_layout()
    paths.append(out / "step_times.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for mode, style in (("strong", "-o"), ("weak", "--s")):
        for variant in dict.fromkeys(r["variant"] for r in rows):
            pts = sorted((r["world"], r["scaling_efficiency"]) for r in rows if r["variant"] == variant
                         and r["mode"] in (mode, "base") and r["scaling_efficiency"] is not None)
            if len(pts) > 1:
                ax.plot(*zip(*pts, strict=True), style, label=f"{variant} ({mode})")
    ax.set_xlabel("world size")
    ax.set_ylabel("scaling efficiency")
    ax.set_title("dptrain bench: scaling efficiency (1.0 = linear)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "scaling.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
