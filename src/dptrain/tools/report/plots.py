"""The report's figures, one PNG each, drawn with matplotlib's object API (no pyplot: no global
figure state, no GUI backend). Each function returns the figure, or None when the run has not
written the data it needs (the page then says why).
"""

from __future__ import annotations

from typing import Any

from dptrain.tools.report.read import RunRecords

# matplotlib is an optional extra; import_matplotlib() gives the error that says so
Figure = Any
BUCKET_COLORS = {"data": "#4c72b0", "compute": "#55a868", "wait": "#c44e52", "other": "#8c8c8c"}
EVENT_COLORS = {"checkpoint": "#4c72b0", "restart": "#c44e52", "straggler": "#dd8452", "fp16_skip": "#8172b3",
                "nonfinite": "#8172b3", "nonfinite_loss": "#937860", "memory_leak": "#da8bc3", "drift": "#000000",
                "watchdog_died": "#000000", "gpu0_context": "#ccb974"}


class MissingExtra(RuntimeError):
    """matplotlib is not installed."""


def import_matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure as _Figure
    except ImportError as e:
        raise MissingExtra(
            f"dptrain report draws its figures with matplotlib, which is not installed ({e}); install the optional "
            "extra: pip install 'dptrain[report]' (or pip install matplotlib)"
        ) from None
    del matplotlib
    return _Figure


def _figure(width: float = 8.0, height: float = 3.6) -> Any:
    fig = import_matplotlib()(figsize=(width, height), dpi=100, layout="constrained")
    return fig


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [
        (r["step"], r[key]) for r in records if isinstance(r.get(key), int | float) and isinstance(r.get("step"), int)
    ]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def loss_figure(run: RunRecords) -> Figure | None:
    xs, ys = _series(run.train, "loss")
    vx, vy = _series(run.val, "val_loss")
    if not xs and not vx:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    if xs:
        ax.plot(xs, ys, label="train loss", color="#4c72b0")
    if vx:
        ax.plot(vx, vy, "o-", label="validation loss", color="#dd8452")
    ax.set(xlabel="step", ylabel="loss", title="Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def lr_figure(run: RunRecords) -> Figure | None:
    xs, ys = _series(run.train, "lr")
    if not xs:
        return None
    fig = _figure(8.0, 2.8)
    ax = fig.add_subplot()
    ax.plot(xs, ys, color="#55a868")
    ax.set(xlabel="step", ylabel="learning rate", title="Learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    return fig


def throughput_figure(run: RunRecords) -> Figure | None:
    """Tokens/s (or samples/s), and MFU below it when the records carry an `mfu`."""
    key = "tokens_per_s" if any("tokens_per_s" in r for r in run.train) else "samples_per_s"
    xs, ys = _series(run.train, key)
    mx, my = _series(run.train, "mfu")
    if not xs:
        return None
    fig = _figure(8.0, 5.2 if mx else 3.0)
    axes = fig.subplots(2, 1, sharex=True) if mx else [fig.add_subplot()]
    axes[0].plot(xs, ys, color="#4c72b0")
    axes[0].set(ylabel=key.replace("_per_s", "/s"), title="Throughput" + (" and MFU" if mx else ""))
    if mx:
        axes[1].plot(mx, [100 * v for v in my], color="#c44e52")
        axes[1].set(ylabel="MFU (%)")
    axes[-1].set(xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig


def _step_ms(row: dict[str, Any]) -> float:
    return 1e3 * sum(float(row.get(k) or 0.0) for k in BUCKET_COLORS)


def step_time_heatmap(run: RunRecords) -> Figure | None:
    """Rank x straggler window: each rank's mean step time (ms) over the window's timed steps."""
    if not run.splits:
        return None
    ranks = sorted({row["rank"] for s in run.splits for row in s["ranks"]})
    grid = [[float("nan")] * len(run.splits) for _ in ranks]
    for j, s in enumerate(run.splits):
        for row in s["ranks"]:
            grid[ranks.index(row["rank"])][j] = _step_ms(row)
    fig = _figure(8.0, 1.4 + 0.45 * len(ranks))
    ax = fig.add_subplot()
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    labels = [f"{s['steps'][0]}-{s['steps'][-1]}" for s in run.splits]
    ax.set_xticks(
        range(len(labels)), labels, rotation=45 if len(labels) > 8 else 0, ha="right" if len(labels) > 8 else "center"
    )
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    if len(labels) * len(ranks) <= 120:
        mid = sum(im.get_clim()) / 2  # dark text on the bright half of viridis
        for i in range(len(ranks)):
            for j in range(len(labels)):
                ax.text(
                    j,
                    i,
                    f"{grid[i][j]:.0f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="black" if grid[i][j] > mid else "white",
                )
    ax.set(xlabel="steps (straggler window)", title="Step time per rank (ms/step)")
    fig.colorbar(im, ax=ax, label="ms/step")
    return fig


def split_figure(run: RunRecords) -> Figure | None:
    """Data / compute / wait / other per rank, averaged over every recorded window."""
    if not run.splits:
        return None
    sums: dict[int, dict[str, float]] = {}
    counts: dict[int, int] = {}
    for s in run.splits:
        for row in s["ranks"]:
            acc = sums.setdefault(row["rank"], dict.fromkeys(BUCKET_COLORS, 0.0))
            for k in BUCKET_COLORS:
                acc[k] += 1e3 * float(row.get(k) or 0.0)
            counts[row["rank"]] = counts.get(row["rank"], 0) + 1
    ranks = sorted(sums)
    fig = _figure(8.0, 1.4 + 0.45 * len(ranks))
    ax = fig.add_subplot()
    left = [0.0] * len(ranks)
    for k, color in BUCKET_COLORS.items():
        widths = [sums[r][k] / counts[r] for r in ranks]
        ax.barh([f"rank {r}" for r in ranks], widths, left=left, color=color, label=k)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set(xlabel="ms per step", title="Where each rank's step goes (mean over the straggler windows)")
    ax.legend(ncols=4, loc="lower center", bbox_to_anchor=(0.5, 1.12), frameon=False)
    return fig


def memory_figure(run: RunRecords) -> Figure | None:
    """Host RSS per rank over the steps; CUDA allocated and peak below it on GPUs."""
    if not run.memory:
        return None
    per_rank: dict[int, dict[str, list[tuple[int, float]]]] = {}
    for m in run.memory:
        for row in m["ranks"]:
            for key in ("rss_mb", "cuda_allocated_mb", "cuda_peak_mb"):
                if isinstance(row.get(key), int | float):
                    per_rank.setdefault(row["rank"], {}).setdefault(key, []).append((m["step"], float(row[key])))
    cuda = any("cuda_allocated_mb" in d for d in per_rank.values())
    fig = _figure(8.0, 5.4 if cuda else 3.2)
    axes = fig.subplots(2, 1, sharex=True) if cuda else [fig.add_subplot()]
    for rank in sorted(per_rank):
        d = per_rank[rank]
        pts = d.get("rss_mb", [])
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=f"rank {rank}")
        if cuda:
            for key, style in (("cuda_allocated_mb", "-"), ("cuda_peak_mb", ":")):
                pts = d.get(key, [])
                axes[1].plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"rank {rank} {key[5:-3]}")
    axes[0].set(ylabel="host RSS (MiB)", title="Memory per rank")
    if cuda:
        axes[1].set(ylabel="CUDA (MiB)")
    axes[-1].set(xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncols=4)
    return fig


def events_figure(run: RunRecords) -> Figure | None:
    """One row per event kind, a mark at each event's step, over the loss curve's step range."""
    if not run.events:
        return None
    kinds = sorted({e["kind"] for e in run.events})
    fig = _figure(8.0, 1.2 + 0.4 * len(kinds))
    ax = fig.add_subplot()
    for i, kind in enumerate(kinds):
        steps = [e["step"] for e in run.events if e["kind"] == kind]
        ax.scatter(
            steps,
            [i] * len(steps),
            marker="|" if kind == "checkpoint" else "o",
            s=200 if kind == "checkpoint" else 40,
            color=EVENT_COLORS.get(kind, "#333333"),
        )
    ax.set_yticks(range(len(kinds)), kinds)
    ax.set_ylim(-0.6, len(kinds) - 0.4)
    ax.set_xlim(0, max(run.last_step, max(e["step"] for e in run.events)) * 1.02 + 1)
    ax.set(xlabel="step", title="Events")
    ax.grid(alpha=0.3, axis="x")
    return fig


FIGURES = {
    "loss": loss_figure,
    "lr": lr_figure,
    "throughput": throughput_figure,
    "step_time": step_time_heatmap,
    "split": split_figure,
    "memory": memory_figure,
    "events": events_figure,
}
