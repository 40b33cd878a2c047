"""Reports of elastic restarts: which rank died, at which step, and why.

Every rank keeps a tiny progress file (`attempts/rank<R>.json`: attempt, pid, step, and the
error it died with, if it died in Python). The step is written at log steps and checkpoint saves
(not every step), so "the last finished step" below is the last one logged or saved (at most
`train.log_every_steps - 1` steps behind). A rank killed by a signal cannot write anything, so its
file still shows that step and no error. When torchrun restarts the worker
group (TORCHELASTIC_RESTART_COUNT > 0), rank 0 reads the previous attempt's files, appends one
record to `attempts.jsonl` in the run directory and prints it.

In an elastic run (`launch.nnodes=MIN:MAX`) every worker-group start is a *generation*, whatever
caused it: a failure (torchrun's restart count goes up) or a node joining (it does not). The files
carry the generation, the host and the world size, so rank 0 reports the membership change
(nodes left/joined by host name, world size before/after, last finished step, resumed step, steps
lost); a world size whose global batch cannot be split is written as a refusal (`record_refusal`).
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

    def __init__(self, run_dir: Path, *, rank: int, attempt: int, generation: int = 0, host: str = "",
                 world_size: int = 1) -> None:
        folder = run_dir / _DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank}.json"
        now = time.time()
        self.record: dict[str, Any] = {"attempt": attempt, "rank": rank, "pid": os.getpid(), "step": None,
                                       "started": now, "updated": now, "error": None, "generation": generation,
                                       "host": host, "world_size": world_size, "stopped": False}
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
        self.record["updated"] = time.time()
        self._write()

    def stopped(self) -> None:
        """Record that this rank stopped on request (SIGTERM: preemption, or torchrun re-forming the group
        for a node that joins) with its last step checkpointed."""
        self.record["stopped"] = True
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
    newest = max(r.get("generation", 0) for r in ranks)
    ranks = [r for r in ranks if r.get("generation", 0) == newest]  # files of ranks beyond a shrunk world are older
    died = [r for r in ranks if r.get("error") is None and not r.get("stopped")]
    failed = [r for r in ranks if r.get("error") is not None]
    causes = []
    for r in died:
        causes.append(
            {
                "rank": r["rank"],
                "pid": r["pid"],
                "step": r["step"],
                "cause": "died without a Python error (killed by a signal, e.g. SIGKILL or the OOM killer, or crashed)",
            }
        )
    for r in failed:
        causes.append(
            {"rank": r["rank"], "pid": r["pid"], "step": r["step"], "cause": r["error"].strip().splitlines()[-1]}
        )
    return {
        "attempt": max(r["attempt"] for r in ranks),
        "generation": newest,
        "failures": causes,
        "last_step": max((r["step"] or 0) for r in ranks),
        "world_size": len(ranks),
        "hosts": sorted({r.get("host", "") for r in ranks}),
        "last_progress": max(r.get("updated", r["started"]) for r in ranks),
    }


def _append(run_dir: Path, record: dict[str, Any]) -> None:
    with open(run_dir / LOG, "a") as f:
        f.write(strict_json.dumps(record) + "\n")


def report_restart(
    run_dir: Path, *, attempt: int, hosts: list[str] | None = None, resumed_step: int | None = None
) -> str | None:
    """On rank 0 of a re-formed group: append the previous attempt's report to attempts.jsonl
    and return a message (None when there is nothing to report). `hosts`: every rank's host in the
    new group (an elastic run): the record then says which nodes left or joined, the world size
    before and after, and the steps lost (last finished step - `resumed_step`)."""
    prev = previous_attempt(run_dir)
    if prev is None:
        return None
    now = time.time()
    prev.update(restarted_as=attempt, time=now)
    lines = []
    if hosts is not None:
        change = membership(prev, hosts=hosts, resumed_step=resumed_step or 0, now=now)
        if change is None and attempt == prev["attempt"]:
            return None  # same nodes, no failure: a new command continuing the run
        prev.update(change or {})
        if change:
            lines.append(describe_membership(prev))
    _append(run_dir, prev)
    if prev["failures"]:
        lines.append(
            f"dptrain: restart {attempt}: attempt {prev['attempt']} failed (last finished step {prev['last_step']}):"
        )
    for c in prev["failures"]:
        lines.append(f"  rank {c['rank']} (pid {c['pid']}) at step {c['step']}: {c['cause']}")
    return "\n".join(lines) or None


def membership(prev: dict[str, Any], *, hosts: list[str], resumed_step: int, now: float) -> dict[str, Any] | None:
    """The membership change from the previous generation to a group on `hosts` (None: same nodes)."""
    before, after = set(prev["hosts"]), set(hosts)
    if before == after and prev["world_size"] == len(hosts):
        return None
    return {
        "event": "membership",
        "nodes_left": sorted(before - after),
        "nodes_joined": sorted(after - before),
        "world_size_before": prev["world_size"],
        "world_size_after": len(hosts),
        "resumed_step": resumed_step,
        "steps_lost": max(0, prev["last_step"] - resumed_step),
        "seconds_since_last_progress": round(now - prev["last_progress"], 3),
    }


def describe_membership(rec: dict[str, Any]) -> str:
    """The console line of a membership change."""
    parts = [
        f"node(s) {', '.join(rec['nodes_left'])} left" if rec["nodes_left"] else "",
        f"node(s) {', '.join(rec['nodes_joined'])} joined" if rec["nodes_joined"] else "",
    ]
    who = " and ".join(p for p in parts if p) or "the ranks per node changed"
    return (
        f"dptrain: elastic: {who} after step {rec['last_step']}: world size {rec['world_size_before']} -> "
        f"{rec['world_size_after']}, resuming at step {rec['resumed_step']} ({rec['steps_lost']} step(s) lost, "
        f"{rec['seconds_since_last_progress']:.1f}s since the last finished step)"
    )


def record_refusal(run_dir: Path, *, attempt: int, world_size: int, reason: str) -> None:
    """Note in attempts.jsonl that a re-formed group of `world_size` ranks refused to train, and why."""
    _append(
        run_dir,
        {"event": "refused", "attempt": attempt, "world_size": world_size, "reason": reason, "time": time.time()},
    )
