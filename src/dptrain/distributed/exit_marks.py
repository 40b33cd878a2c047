"""Exit marks: how a process says that dptrain itself chose its exit status.

The launcher (`launch/torchrun.py`) gives its workers an empty folder in `DPTRAIN_EXIT_MARKS`. dptrain code
that ends a process with one of its own statuses (3: the hang watchdog, 4: the non-finite policy, ...)
first calls `mark_exit`, which writes `rank_<RANK>.json` there. For a user's script under `dptrain
launch` the launcher gives a status dptrain's meaning only when such a mark says dptrain caused it; any
other status is reported as the script's own. Standard library only: any layer may call it, even from
a thread that is about to `os._exit`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

EXIT_MARKS_ENV = "DPTRAIN_EXIT_MARKS"
COLLECTIVE_RECORD_PREFIX = "collective_rank_"
"""`collective_rank_<RANK>.json`: a failing rank's last collectives (diagnostics/collective_record.py), in the same
folder; the launcher compares them (launch/culprit.py)."""


def mark_exit(code: int, reason: str, *, detail: str = "", final: bool = False) -> bool:
    """Record that this process is about to exit with `code` because of dptrain. `reason`: what stopped it, as a
    noun phrase (the launcher says "dptrain: stopped by the <reason>: rank 0 (exit 3), ...; see <detail>"), e.g.
    "hang watchdog"; `detail`: where to read more. `final`: a status that a restart cannot change (the
    non-finite policy, bad input): the process then exits 0 so that torchrun does not restart it, and the
    launcher exits with `code` (see `final_status`). Whether a mark was written: nothing outside a dptrain
    launcher; never raises."""
    folder = os.environ.get(EXIT_MARKS_ENV)
    if not folder:
        return False
    rank = os.environ.get("RANK", "0")
    path = Path(folder) / f"rank_{rank}.json"
    try:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"code": code, "reason": reason, "detail": detail, "final": final}))
        os.replace(tmp, path)
    except OSError:
        return False  # a mark is a courtesy to the launcher's message; the exit goes ahead regardless
    return True


def clear_exit_mark() -> None:
    """Remove this rank's mark and collective record left by an earlier attempt (torchrun restarts workers under the
    same launcher)."""
    folder = os.environ.get(EXIT_MARKS_ENV)
    if folder:
        rank = os.environ.get("RANK", "0")
        Path(folder, f"rank_{rank}.json").unlink(missing_ok=True)
        Path(folder, f"{COLLECTIVE_RECORD_PREFIX}{rank}.json").unlink(missing_ok=True)


def read_exit_marks(folder: str | Path | None) -> dict[int, dict[str, Any]]:
    """{global rank: {"code", "reason", "detail"}} of the marks in `folder`."""
    out: dict[int, dict[str, Any]] = {}
    if folder is None or not Path(folder).is_dir():
        return out
    for p in Path(folder).glob("rank_*.json"):
        try:
            out[int(p.stem.removeprefix("rank_"))] = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
    return out


def final_status(marks: dict[int, dict[str, Any]]) -> int | None:
    """The status the workers chose as final (`mark_exit(..., final=True)`), if any: the launcher's exit code
    after torchrun saw every worker exit 0."""
    codes = [int(m["code"]) for _, m in sorted(marks.items()) if m.get("final")]
    return codes[0] if codes else None
