"""Where metrics go: a JSONL file per run and the console (progress line and summary table).

Only rank 0 creates sinks; the other ranks log nothing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TextIO

from dptrain.metrics import strict_json


class JsonlSink:
    """One JSON object per logged step, flushed each time so a crash loses at most one line."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(strict_json.dumps(record) + "\n")

    def close(self) -> None:
        self._f.close()


class ConsoleSink:
    """The live progress line: step, loss, lr, throughput, ETA. Rewritten in place on a terminal,
    one line per log step otherwise (CI logs, files)."""

    def __init__(self, *, max_steps: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.max_steps = max_steps
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self._start = time.perf_counter()
        self._open_line = False

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled or "loss" not in record:
            return
        step = record["step"]
        rate = record.get("tokens_per_s")
        unit = "tok/s"
        if rate is None:
            rate, unit = record.get("samples_per_s", 0.0), "samples/s"
        elapsed = time.perf_counter() - self._start
        eta = elapsed / max(step, 1) * (self.max_steps - step)
        mfu = record.get("mfu")
        line = (
            f"step {step:>6}/{self.max_steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
            f"{rate:,.0f} {unit}" + (f"  mfu {mfu:.1%}" if mfu is not None else "") + f"  eta {_fmt_s(eta)}"
        )
        if self.tty:
            self.stream.write("\r\033[K" + line)
            self._open_line = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (evaluation results, notices) that does not disturb the progress line."""
        if not self.enabled:
            return
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False


def _fmt_s(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def print_summary(summary: dict[str, Any], *, run_dir: Path, stream: TextIO | None = None) -> None:
    """The end-of-run table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dptrain run summary", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("strategy", summary.get("strategy")),
        ("world size", summary.get("world_size")),
        ("steps", summary.get("steps")),
        ("final train loss", _num(summary.get("final_loss"))),
        (
            "val loss (start -> end)",
            f"{_num(summary.get('initial_val_loss'))} -> {_num(summary.get('final_val_loss'))}",
        ),
        ("val bits per byte", _num(summary.get("final_val_bpb"))),
        (
            "tokens/s" if summary.get("tokens_per_s") else "samples/s",
            f"{summary.get('tokens_per_s') or summary.get('samples_per_s') or 0:,.0f}",
        ),
        ("wall time", f"{summary.get('wall_s', 0):.1f} s"),
        *_meter_rows(summary),
    ]
    for k, v in rows:
        if v not in (None, "None", "- -> -"):
            table.add_row(k, str(v))
    console = Console(file=stream or sys.stdout)
    console.print(table)
    console.print(f"outputs: {run_dir}  (config.yaml, metrics.jsonl, summary.json, final/model.safetensors)")


def _meter_rows(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    """Per-rank throughput, MFU and communication (metrics/meters.py); absent values are skipped."""
    per_rank = summary.get("tokens_per_s_per_rank")
    mfu, sent = summary.get("mfu"), summary.get("comm_bytes")
    comm, exposed = summary.get("comm_s"), summary.get("exposed_comm_s")
    return [
        ("tokens/s per rank", None if per_rank is None else f"{per_rank:,.0f}"),
        ("MFU", None if mfu is None else f"{mfu:.2%}"),
        ("comm sent per rank per step", None if sent is None else f"{sent / 2**20:,.2f} MiB"),
        (
            "comm time per step (exposed)",
            None if comm is None else f"{comm * 1e3:.1f} ms ({(exposed or 0.0) * 1e3:.1f} ms)",
        ),
    ]


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.4f}"
