"""Reading what a run has written so far, finished or still going.

Every file is optional: a run that is still going has no summary.json, its metrics.jsonl may end
in a half-written line, and diagnostics.jsonl exists only once the diagnostics started. A line
that is not JSON is skipped and counted (`RunRecords.bad_lines`), so the page can say so instead
of failing. Nothing here imports torch.

Sources and what the report takes from them:

- metrics.jsonl (rank 0, one record per log step): loss, lr, grad_norm, throughput, `mfu` when
  present, `skipped_steps` (fp16), and the validation records (`val_loss`);
- diagnostics.jsonl (rank 0): `step_split` (every rank's data/compute/wait/other seconds per
  step, averaged over the last steps of each straggler window), `memory` (every rank's RSS and
  CUDA memory at `diagnostics.rss_every_steps`), and the events: `straggler`, `nonfinite`, `nonfinite_loss`,
  `memory_leak`, `drift`, `watchdog_died`, `gpu0_context`;
- attempts.jsonl: elastic restarts; checkpoints/step_*/manifest.json (+ COMMITTED): saves;
- summary.json and config.yaml: the run's totals and settings.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

EVENT_KINDS = ("straggler", "nonfinite", "nonfinite_loss", "memory_leak", "drift", "watchdog_died", "gpu0_context")
WINDOW_KINDS = ("straggler", "memory_leak")
"""Findings about a window of steps (`steps`: first and last): shown at the window's last step."""


@dataclasses.dataclass
class RunRecords:
    """Everything the report shows, as plain data."""

    run_dir: Path
    train: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # metrics records with a loss
    val: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # metrics records with a val_loss
    splits: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # step_split records
    memory: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # memory records
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # {"step", "kind", "text"}
    summary: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    bad_lines: dict[str, int] = dataclasses.field(default_factory=dict)  # file name -> unreadable lines

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def last_step(self) -> int:
        steps = [r["step"] for r in self.train + self.val if isinstance(r.get("step"), int)]
        return max(steps, default=0)


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSONL file and how many lines were not one (a line being written)."""
    if not path.is_file():
        return [], 0
    records, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(obj, dict):
            records.append(obj)
        else:
            bad += 1
    return records, bad


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _read_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    import yaml

    try:
        obj = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return None
    return obj if isinstance(obj, dict) else None


def read_run(run_dir: str | Path) -> RunRecords:
    """Read a run directory (raises FileNotFoundError when it is not a directory)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    out = RunRecords(run_dir=run_dir, summary=_read_json(run_dir / "summary.json"), config=_read_config(run_dir))
    metrics, bad = read_jsonl(run_dir / "metrics.jsonl")
    if bad:
        out.bad_lines["metrics.jsonl"] = bad
    out.train = [r for r in metrics if "loss" in r]
    out.val = [r for r in metrics if "val_loss" in r]
    diag, bad = read_jsonl(run_dir / "diagnostics.jsonl")
    if bad:
        out.bad_lines["diagnostics.jsonl"] = bad
    out.splits = [r for r in diag if r.get("kind") == "step_split" and r.get("ranks")]
    out.memory = [r for r in diag if r.get("kind") == "memory" and r.get("ranks")]
    out.events = sorted(_diagnostic_events(diag) + _skipped_step_events(out.train) + _restart_events(run_dir, out)
                        + _checkpoint_events(run_dir, out.config), key=lambda e: (e["step"], e["kind"]))
    return out


def _event(step: Any, kind: str, text: str) -> dict[str, Any]:
    return {"step": step if isinstance(step, int) else 0, "kind": kind, "text": text}


def _diagnostic_events(diag: list[dict[str, Any]]) -> list[dict[str, Any]]:
    events = []
    for r in diag:
        kind = r.get("kind")
        if kind not in EVENT_KINDS or (kind == "drift" and r.get("ok", True)):
            continue  # a passing drift check is not news
        # a finding over a window of steps (straggler, memory leak) stands at the window's last step
        steps = r.get("steps") or [0, 0]
        step = steps[-1] if kind in WINDOW_KINDS else r.get("step")
        if kind == "straggler":
            text = (f"rank {r.get('rank')} on {r.get('host')}: {_ms(r.get('busy_s'))} ms/step of data + compute vs "
                    f"{_ms(r.get('others_busy_s'))} ms for the others "
                    f"(steps {steps[0]}-{steps[-1]}; slow: {r.get('cause')})")
        elif kind == "nonfinite":
            text = (
                f"update skipped (non-finite values; ranks {r.get('ranks') or 'all'}, {r.get('consecutive')} in a row)"
            )
        elif kind == "nonfinite_loss":
            text = f"logged loss is {r.get('loss')} (policy {r.get('policy')})"
        elif kind == "memory_leak":
            text = (
                f"rank {r.get('rank')}: {r.get('memory')} grows {r.get('mb_per_step', 0):.2f} MiB/step "
                f"(+{r.get('growth_mb', 0):.0f} MiB)"
            )
        elif kind == "drift":
            text = f"replicas drifted: {r.get('error')}"
        elif kind == "watchdog_died":
            text = f"rank {r.get('rank')}: the hang watchdog died ({r.get('error')})"
        else:
            text = f"rank {r.get('rank')} (pid {r.get('pid')}) holds a CUDA context on GPU 0"
        events.append(_event(step, kind, text))
    return events


def _ms(x: Any) -> str:
    return f"{x * 1e3:.1f}" if isinstance(x, int | float) else "?"


def _skipped_step_events(train: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """fp16: the scaler's skipped steps, from the running count in the log records."""
    events, before = [], 0
    for r in train:
        n = r.get("skipped_steps")
        if isinstance(n, int) and n > before:
            events.append(
                _event(
                    r["step"],
                    "fp16_skip",
                    f"{n - before} step(s) skipped by the loss scaler (scale now {r.get('loss_scale')})",
                )
            )
            before = n
    return events


def _restart_events(run_dir: Path, out: RunRecords) -> list[dict[str, Any]]:
    records, bad = read_jsonl(run_dir / "attempts.jsonl")
    if bad:
        out.bad_lines["attempts.jsonl"] = bad
    events = []
    for r in records:
        causes = "; ".join(
            f"rank {c.get('rank')} at step {c.get('step')}: {c.get('cause')}" for c in r.get("failures", [])
        )
        events.append(
            _event(
                r.get("last_step"),
                "restart",
                f"attempt {r.get('attempt')} failed, restarted as {r.get('restarted_as')}: {causes}",
            )
        )
    return events


def _checkpoint_events(run_dir: Path, config: dict[str, Any] | None) -> list[dict[str, Any]]:
    folder = (
        (config or {}).get("checkpoint", {}).get("dir") if isinstance((config or {}).get("checkpoint"), dict) else None
    )
    ckpt_dir = Path(folder) if folder else run_dir / "checkpoints"
    if not ckpt_dir.is_absolute() and not ckpt_dir.is_dir():
        ckpt_dir = run_dir / ckpt_dir
    events = []
    for d in sorted(ckpt_dir.glob("step_*")) if ckpt_dir.is_dir() else []:
        manifest = _read_json(d / "manifest.json")
        meta = (manifest or {}).get("meta") or {}
        step = meta.get("step")
        if not isinstance(step, int):
            digits = d.name.removeprefix("step_")
            step = int(digits) if digits.isdigit() else 0
        state = "committed" if (d / "COMMITTED").is_file() else "not committed (being written, or interrupted)"
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        events.append(
            _event(step, "checkpoint", f"{d.name}: {state}, {size / 2**20:.1f} MiB, format {meta.get('format', '?')}")
        )
    return events
