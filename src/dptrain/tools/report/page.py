"""`dptrain report RUN_DIR`: one HTML page and its PNGs in one folder (default RUN_DIR/report/).

The page references its images by relative file name and has no script, stylesheet or font from
anywhere else, so the folder works when it is copied or opened from a file:// URL. A run that is
still going gets a report of what it has written so far (see read.py).
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

from dptrain.tools.report import plots
from dptrain.tools.report.read import RunRecords, read_run

PAGE = "index.html"

# section id -> (heading, why it can be missing)
SECTIONS = {
    "loss": ("Loss", "no loss or validation record in metrics.jsonl yet"),
    "lr": ("Learning rate", "no log record in metrics.jsonl yet"),
    "throughput": ("Throughput", "no log record in metrics.jsonl yet"),
    "step_time": ("Step time per rank", "no step_split record in diagnostics.jsonl: the straggler split runs with "
                  "world size > 1 and diagnostics.straggler_every_steps > 0 (not under pipeline parallelism), and "
                  "writes one record at the end of each window"),
    "split": ("Data / compute / wait per rank", "no step_split record in diagnostics.jsonl (see above)"),
    "memory": ("Memory per rank", "no memory record in diagnostics.jsonl: set diagnostics.rss_every_steps > 0"),
    "events": ("Events", "no events: no checkpoint, restart, straggler, skipped step or other finding"),
}
SUMMARY_ROWS = ("strategy", "world_size", "precision", "steps", "global_batch_size", "final_loss", "initial_val_loss",
                "final_val_loss", "final_val_bpb", "tokens_per_s", "samples_per_s", "mfu", "step_time_s", "wall_s",
                "skipped_steps", "nonfinite_skipped_steps", "resumed_from", "preempted", "dptrain_version",
                "torch_version")

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; } td, th { padding: 0.2em 0.8em; border-bottom: 1px solid #eee;
text-align: left; vertical-align: top; } img { max-width: 100%; } .note { color: #666; font-style: italic; }
.banner { padding: 0.5em 1em; background: #fff4d6; border: 1px solid #e8c766; } .ok { background: #e6f4e6;
border-color: #9c9; }
"""


def build_report(run_dir: str | Path, *, out_dir: str | Path | None = None) -> Path:
    """Write the page and its PNGs; return the page's path. Raises plots.MissingExtra without
    matplotlib, FileNotFoundError for a missing run directory."""
    plots.import_matplotlib()  # fail before writing anything
    run = read_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    images: dict[str, str] = {}
    for name, draw in plots.FIGURES.items():
        fig = draw(run)
        if fig is not None:
            fig.savefig(out / f"{name}.png")
            images[name] = f"{name}.png"
        elif (out / f"{name}.png").exists():
            (out / f"{name}.png").unlink()  # a stale image from an earlier report of this run
    page = out / PAGE
    page.write_text(render_html(run, images=images))
    return page


def render_html(run: RunRecords, *, images: dict[str, str]) -> str:
    """The page; `images`: section id -> relative PNG file name."""
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
             f"<title>dptrain report: {_e(run.run_dir.name)}</title><style>{STYLE}</style></head><body>",
             f"<h1>dptrain run report: {_e(run.run_dir.name)}</h1>", _status(run), _summary_table(run)]
    for sid, (title, missing) in SECTIONS.items():
        parts.append(f"<h2 id=\"{sid}\">{_e(title)}</h2>")
        if sid in images:
            parts.append(f"<img src=\"{_e(images[sid])}\" alt=\"{_e(title)}\">")
        else:
            parts.append(f"<p class=\"note\">Not shown: {_e(missing)}.</p>")
        if sid == "events" and run.events:
            parts.append(_events_table(run.events))
    parts.append(f"<p class=\"note\">Written by <code>dptrain report</code> on "
                 f"{_e(time.strftime('%Y-%m-%d %H:%M:%S %Z'))} from {_e(str(run.run_dir))}.</p></body></html>\n")
    return "\n".join(parts)


def _status(run: RunRecords) -> str:
    if run.finished:
        text = f"Finished: {run.summary.get('steps') if run.summary else '?'} steps (summary.json)."
        if run.summary and run.summary.get("preempted"):
            text = f"Stopped by a signal at step {run.summary.get('steps')}, checkpointed (resume with dptrain run)."
        cls = "banner ok"
    else:
        text = f"In progress or stopped without a summary: last recorded step {run.last_step}; no summary.json yet."
        cls = "banner"
    if run.bad_lines:
        text += " Skipped unreadable lines (a line being written, or a cut file): " + ", ".join(
            f"{name}: {n}" for name, n in run.bad_lines.items()) + "."
    return f"<p class=\"{cls}\">{_e(text)}</p>"


def _summary_table(run: RunRecords) -> str:
    rows: list[tuple[str, Any]] = []
    if run.summary:
        rows = [(k, run.summary[k]) for k in SUMMARY_ROWS if run.summary.get(k) is not None]
    elif run.train:
        last = run.train[-1]
        rows = [("last step", last.get("step")), ("last loss", last.get("loss")), ("lr", last.get("lr")),
                *[(k, last[k]) for k in ("tokens_per_s", "samples_per_s", "mfu") if k in last]]
    cfg = run.config or {}
    par: dict[str, Any] = cfg["parallel"] if isinstance(cfg.get("parallel"), dict) else {}
    if par and not run.summary:
        rows.insert(0, ("strategy", par.get("strategy")))
    model: dict[str, Any] = cfg["model"] if isinstance(cfg.get("model"), dict) else {}
    if model.get("factory"):
        rows.append(("model", model["factory"]))
    if not rows:
        return "<p class=\"note\">No summary.json and no log record yet.</p>"
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(_fmt(v))}</td></tr>" for k, v in rows)
    return f"<h2 id=\"summary\">Summary</h2><table>{body}</table>"


def _events_table(events: list[dict[str, Any]]) -> str:
    body = "".join(f"<tr><td>{e['step']}</td><td>{_e(e['kind'])}</td><td>{_e(e['text'])}</td></tr>" for e in events)
    return f"<table><tr><th>step</th><th>event</th><th>what</th></tr>{body}</table>"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)
