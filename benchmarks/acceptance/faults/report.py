"""The fault matrix's Markdown: the table, and for each fault the lines the user reads
(benchmarks/acceptance/fault_matrix.py)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from faults.verdict import Event


def _cell(text: str, limit: int = 260) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| fault | named right | seconds to the name | what the user reads |", "|---|---|---|---|"]
    for name in dict.fromkeys(r["fault"] for r in rows):
        runs = [r for r in rows if r["fault"] == name]
        first = runs[0]
        right = sum(r["named_right"] for r in runs)
        named = first["cell"]
        if len(runs) > 1:
            others = sorted({r["cell"] for r in runs if not r["named_right"]})
            named = f"{right}/{len(runs)} right" + (f"; otherwise {', '.join(others)}" if others else "")
        secs = [r["seconds"] for r in runs if r["seconds"] is not None]
        if not secs:
            when = f"none in {first['deadline_s']:g} s" if first["timed_out"] else "none"
        elif len(secs) == 1:
            when = f"{secs[0]:.1f}"
        else:
            when = f"{statistics.median(secs):.1f} ({min(secs):.1f}–{max(secs):.1f})"
        codes = ", ".join(str(c) for c in first["exit_codes"])
        exit_text = f"exit {codes}"
        if first["timed_out"]:
            exit_text = f"still running {first['deadline_s']:g} s after the fault"
        title = first["title"] + (" †" if first["bounded_by"] else "")
        lines.append(f"| {title} | {named} | {when} | {_cell(short(first['reads'], first))} ({exit_text}) |")
    bounded = {r["fault"]: r["bounded_by"] for r in rows if r["bounded_by"]}
    if bounded:
        lines.append("")
        titles = {r["fault"]: r["title"] for r in rows}
        lines += [f"- † {titles[n]}: bounded by {b}." for n, b in bounded.items()]
    return "\n".join(lines)


NOISE = ("frame #", "<omitting python frames>", "Extension modules:", "Thread ", "Current thread 0x", "Traceback (most")
CHECKOUT = str(Path(__file__).resolve().parents[3])
LIBRARY = ("/site-packages/", "/src/dptrain/", "<frozen ", "/lib/python3")


def what_the_user_reads(row: dict[str, Any], limit: int = 16) -> list[str]:
    """The first lines after the fault, then the lines around the name (the first claim's when none was right), as
    `+S.s  line` (seconds after the injection). Left out: C++ frames, thread headers, library frames and source
    lines of tracebacks (the user's own frames and the error lines stay), a line already shown (a report file
    printed on the console too)."""
    seen: set[str] = set()
    lines = []
    for e in (Event(**e) for e in row.get("lines", [])):
        if _shown(e.text) and e.text.strip() not in seen:
            seen.add(e.text.strip())
            lines.append(e)
    injected = row["injected_at"]
    after = [e for e in lines if injected is None or e.t >= injected]
    head = after[:4]
    claim = row.get("claim") or row.get("first_claim")
    if claim:
        at = next((i for i, e in enumerate(after) if e.t >= claim["t"] and e.text.strip() in claim["text"]), None)
        at = at if at is not None else next((i for i, e in enumerate(after) if e.t >= claim["t"]), len(after))
        around = after[max(len(head), at - 2):]
        picked = head + ([None] if around and around[0] is not after[len(head):][:1][0] else []) + around
    else:
        picked = after
    injected_at = injected or 0.0

    def shown(e: Event | None) -> str:
        if e is None:
            return "  …"
        node = e.source.partition(":")[0] + " " if e.source.startswith("node") else ""
        return f"+{e.t - injected_at:6.1f} s  {node}{_cell(short(e.text, row), 200)}"

    return [shown(e) for e in picked[:limit]]


def short(text: str, row: dict[str, Any]) -> str:
    """Paths as a reader of the docs knows them: RUN_DIR, the checkout's own, .../site-packages/."""
    for i, run_dir in enumerate(row.get("run_dirs", [])):
        text = text.replace(run_dir, "RUN_DIR" if len(row["run_dirs"]) == 1 else f"RUN_DIR{i}")
    text = text.replace(f"{CHECKOUT}/", "")
    return re.sub(r"/[^\s\"']*/site-packages/", ".../site-packages/", text)


def _shown(text: str) -> bool:
    """Not a blank line, a C++ frame, a thread header, a library frame or a traceback's source line."""
    body = re.sub(r"^\[rank\d+\]:", "", text)
    stripped = body.strip()
    if not stripped or stripped.startswith(NOISE):
        return False
    if stripped.startswith(("File ", "at ")):
        return not any(lib in stripped for lib in LIBRARY)
    return not body.startswith("    ")


def messages(rows: list[dict[str, Any]]) -> str:
    """Markdown: for each fault (its first run), the lines the user reads."""
    out = []
    for name in dict.fromkeys(r["fault"] for r in rows):
        row = next(r for r in rows if r["fault"] == name)
        out += [f"**{row['title']}** (culprit rank {row['culprit']}, step {row['step']}; {row['cell']}):", "",
                "```", *(what_the_user_reads(row) or ["(nothing)"]), "```", ""]
    return "\n".join(out)
