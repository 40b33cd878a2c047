"""Reports of elastic restarts: which rank died, at which step, and why.

Every rank keeps a tiny progress file (`attempts/rank<R>.json`: attempt, pid, step, and the
error it died with, if it died in Python). A rank killed by a signal cannot write anything, so its
file still shows the last step it finished and no error. When torchrun restarts the worker
group (TORCHELASTIC_RESTART_COUNT > 0), rank 0 reads the previous attempt's files, appends one
record to `attempts.jsonl` in the run directory and prints it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from dptrain.metrics import strict_json

_DIR = "attempts"
LOG = "attempts.jsonl"


class ProgressFile:
    """This rank's progress in the current attempt; `step` is cheap (one small write, no fsync)."""

    def __init__(self, run_dir: Path, *, rank: int, attempt: int) -> None:
        folder = run_dir / _DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank}.json"
        self.record: dict[str, Any] = {"attempt": attempt, "rank": rank, "pid": os.getpid(), "step": None,
                                       "started": time.time(), "error": None}
        self._f = open(self.path, "w")  # noqa: SIM115 - kept open for cheap rewrites

    def _write(self) -> None:
        text = strict_json.dumps(self.record)
        self._f.seek(0)
        self._f.write(text.ljust(len(text) + 64) + "\n")  # padding overwrites a longer old record
        self._f.truncate()
        self._f.flush()

    def step(self, step: int) -> None:
        """Record the last finished step."""
        self.record["step"] = step
        self._write()

    def error(self, message: str) -> None:
        """Record the Python error this rank is dying with."""
        self.record["error"] = message[-2000:]
        self._write()

    def close(self) -> None:
        self._f.close()


def previous_attempt(run_dir: Path) -> dict[str, Any] | None:
    """A report of the attempt the progress files describe, or None when there are none."""
    folder = run_dir / _DIR
    ranks = []
    for p in sorted(folder.glob("rank*.json")) if folder.is_dir() else []:
        try:
            ranks.append(json.loads(p.read_text()))
        except ValueError:
            continue
    if not ranks:
        return None
    died = [r for r in ranks if r.get("error") is None]
    failed = [r for r in ranks if r.get("error") is not None]
    causes = []
    for r in died:
        causes.append({"rank": r["rank"], "pid": r["pid"], "step": r["step"],
                       "cause": "died without a Python error (killed by a signal, e.g. SIGKILL or the OOM killer, or crashed)"})
    for r in failed:
        causes.append({"rank": r["rank"], "pid": r["pid"], "step": r["step"], "cause": r["error"].strip().splitlines()[-1]})
    return {"attempt": ranks[0]["attempt"], "failures": causes,
            "last_step": max((r["step"] or 0) for r in ranks)}


def report_restart(run_dir: Path, *, attempt: int) -> str | None:
    """On rank 0 of a restarted group: append the previous attempt's report to attempts.jsonl
    and return a one-paragraph message (None when there is nothing to report)."""
    prev = previous_attempt(run_dir)
    if prev is None:
        return None
    prev.update(restarted_as=attempt, time=time.time())
    with open(run_dir / LOG, "a") as f:
        f.write(strict_json.dumps(prev) + "\n")
    lines = [f"dptrain: restart {attempt}: attempt {prev['attempt']} failed (last finished step {prev['last_step']}):"]
    for c in prev["failures"]:
        lines.append(f"  rank {c['rank']} (pid {c['pid']}) at step {c['step']}: {c['cause']}")
    return "\n".join(lines)
