"""`dptrain top RUN_DIR`: a live table of every rank, redrawn in place like `nvidia-smi -l 1`.

Built only from files the run writes: the per-rank status files (status.py: step, phase, step
time, memory, GPU), the last training record of metrics.jsonl (loss, lr, throughput), config.yaml
(the step budget) and summary.json (the run is finished). A rank whose status file has not been
rewritten for STALE_S seconds while the run is not finished is marked stale: it is stuck (the
watchdog's job to report) or dead.
"""

from __future__ import annotations

import argparse
import io
import json
import signal
import time
from pathlib import Path
from typing import Any

from dptrain.config import ConfigError
from dptrain.metrics.status import DIR

STALE_S = 10.0
GPU_COLUMNS = ("CUDA MiB", "GPU %", "GPU °C", "GPU W")
MIB = 2**20


def read_status(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's last status, by rank (unreadable files are skipped: a rank may be writing)."""
    rows = []
    for p in (Path(run_dir) / DIR).glob("rank*.json"):
        try:
            rows.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    if rows:  # files of an earlier attempt with more ranks (a resume on fewer) are not this run's
        newest = max(rows, key=lambda r: r.get("started", 0))
        rows = [r for r in rows if r.get("world_size") == newest.get("world_size")]
    return sorted(rows, key=lambda r: r.get("rank", 0))


def last_record(run_dir: Path) -> dict[str, Any]:
    """The newest training record (one with a loss) of metrics.jsonl, reading only the file's tail."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return {}
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - 65536))
        lines = f.read().decode("utf-8", "replace").splitlines()
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            return record
    return {}


def _max_steps(run_dir: Path) -> int | None:
    for name in ("config.yaml", "config.pending.yaml"):
        path = Path(run_dir) / name
        if path.is_file():
            import yaml

            try:
                return int(yaml.safe_load(path.read_text())["train"]["max_steps"])
            except (ValueError, KeyError, TypeError, yaml.YAMLError):
                return None
    return None


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def header(run_dir: Path, record: dict[str, Any], *, finished: bool) -> str:
    steps = _max_steps(run_dir)
    parts = [f"dptrain top  {run_dir}", time.strftime("%H:%M:%S")]
    if record:
        parts.append(f"step {record.get('step')}/{steps or '?'}")
        parts.append(f"loss {_fmt(record.get('loss'), '.4f')}  lr {_fmt(record.get('lr'), '.2e')}")
        rate = record.get("tokens_per_s")
        parts.append(f"{rate:,.0f} tok/s" if rate is not None else f"{record.get('samples_per_s', 0):,.0f} samples/s")
    if finished:
        parts.append("finished")
    return "  |  ".join(parts)


def render(run_dir: str | Path, *, now: float | None = None) -> Any:
    """One frame: a rich renderable (a header line above a table with one row per rank)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    run_dir = Path(run_dir)
    now = time.time() if now is None else now
    finished = (run_dir / "summary.json").is_file()
    rows = read_status(run_dir)
    table = Table(show_lines=False, expand=False)
    columns = ["rank", "host", "pid", "step", "phase", "step time", "tok/s", "RSS MiB", "CUDA MiB", "GPU %",
               "GPU °C", "GPU W", "updated"]
    gpu = any("cuda_allocated_bytes" in r or "gpu_utilization_percent" in r for r in rows)
    for c in columns:
        if gpu or c not in GPU_COLUMNS:  # a CPU run has no GPU columns
            table.add_column(c, justify="left" if c in ("host", "phase") else "right")
    for r in rows:
        age = now - float(r.get("time", now))
        stale = not finished and r.get("phase") not in ("done", "stopped") and age > STALE_S
        cells = [
            str(r.get("rank")), str(r.get("host", "?")), str(r.get("pid", "?")), str(r.get("step", "-")),
            str(r.get("phase", "-")), _fmt(r.get("step_time_s"), ".3f") + (" s" if r.get("step_time_s") else ""),
            _fmt(r.get("tokens_per_s_per_rank", r.get("tokens_per_s")), ",.0f"), _fmt(r.get("rss_bytes"), ",.0f", MIB),
        ]
        if gpu:
            cells += [_fmt(r.get("cuda_allocated_bytes"), ",.0f", MIB), _fmt(r.get("gpu_utilization_percent"), ".0f"),
                      _fmt(r.get("gpu_temperature_celsius"), ".0f"), _fmt(r.get("gpu_power_watts"), ".0f")]
        cells.append(f"{age:.0f} s ago" + (" STALE" if stale else ""))
        table.add_row(*cells, style="bold red" if stale else None)
    parts: list[Any] = [Text(header(run_dir, last_record(run_dir), finished=finished))]
    if rows:
        parts.append(table)
    else:
        parts.append(Text(f"no rank has written {run_dir / DIR}/rank<R>.json yet (log.status_every_s=0 turns them "
                          "off; the run may still be starting)"))
    return Group(*parts)


def render_text(run_dir: str | Path, *, width: int = 160, now: float | None = None) -> str:
    """One frame as plain text (what `--once` prints when not on a terminal)."""
    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(render(run_dir, now=now))
    return console.file.getvalue()  # type: ignore[attr-defined]


def watch(run_dir: Path, *, interval_s: float, once: bool) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if once:
        console.print(render(run_dir))
        return 0
    # Ctrl-C stops the view even where the shell started it with SIGINT ignored (a background job, some
    # terminals' launchers): Python then installs no handler of its own.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Live(render(run_dir), console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval_s)
                live.update(render(run_dir), refresh=True)
    except KeyboardInterrupt:
        return 0


def add_top_parser(sub: Any) -> None:
    top = sub.add_parser("top", help="live per-rank view of a run (step, phase, step time, memory, GPU)")
    top.add_argument("run_dir")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (default 1)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(func=cmd_top)


def cmd_top(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{args.run_dir!r} is not a directory; pass a run directory (the --out of dptrain run)")
    if not args.interval > 0:
        raise ConfigError(f"--interval={args.interval} is not valid; use a number of seconds > 0")
    return watch(run_dir, interval_s=args.interval, once=args.once)
