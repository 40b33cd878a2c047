"""A rank's unfinished collectives as it fails, left for the launcher: who called which collective, how, and where.

gloo aborts a rank (SIGABRT from one of its transport threads: "Received data size doesn't match expected size")
the moment that rank receives another rank's data of another size. So the same collective called with different
shapes on two ranks ends the receiving rank at once, before any watchdog can compare the rings, and the other ranks
fail with "Connection reset by peer" a few milliseconds later; torchrun then names the aborted rank, the victim.
Here every rank leaves its side of the story in the launcher's exit-marks folder (distributed/exit_marks.py) as it
fails, and the launcher compares them (launch/culprit.py `collective_mismatch`):

- `record_failure(error)`: a collective raised in the training thread (called before anything is torn down, while
  the run's SIGTERM handler still defers torchrun's stop);
- `install_abort_record()`: a C-level SIGABRT handler (ctypes) that writes the record of a rank gloo aborts, then
  hands the signal on to the handler it replaced (faulthandler's stack dump, which ends the process).

Each writes `collective_rank_<RANK>.json`: the last collectives of this rank's flight-recorder ring (group, sequence
number, op, shapes, dtypes, done or not) with the line that called each (torch records every entry's Python frames),
and where the training thread was. Nothing is written outside a dptrain launcher or with the flight recorder off.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import signal
import sys
import types
from pathlib import Path
from typing import Any

from dptrain.diagnostics.collective_ring import call_site, main_thread_frame, read_calls
from dptrain.diagnostics.watchdog import active_desync
from dptrain.distributed.exit_marks import COLLECTIVE_RECORD_PREFIX, EXIT_MARKS_ENV

MAX_CALLS = 16
ABORT_WRITE_LIMIT_S = 5
"""A record the aborting process cannot write within this long does not keep it alive: SIGALRM ends it."""
PEERS_WAIT_S = 2.0
"""How long an aborting rank waits for the others' rings (their watchdog threads answer every desync_after_s / 10)."""
_SIG_DFL, _SIG_IGN = 0, 1
_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)
_installed: dict[str, Any] = {}


def failure_record(error: BaseException | None, *, why: str) -> dict[str, Any] | None:
    """This rank's last collectives (done or not: the rank that sent the bigger buffer may have finished the
    mismatched one and failed in the next), each with the line that called it, and where its training thread was
    (from `error`'s traceback, else the main thread's stack); None with the flight recorder off or empty."""
    calls = read_calls(sites=True)[-MAX_CALLS:]
    if not calls:
        return None
    frame = _innermost(error) if error is not None else main_thread_frame()
    site, blocked = call_site(frame)
    text = " ".join(str(error).split())[:300] if error is not None else ""
    return {"rank": int(os.environ.get("RANK", "0")), "pid": os.getpid(), "why": why, "error": text,
            "site": site, "blocked_in": blocked, "calls": [list(c) for c in calls]}


def _peer_snapshots() -> dict[str, Any]:
    """The other ranks' rings and positions, asked for through the store now (diagnostics/desync_watch.py): the ranks
    still alive are blocked in, or just past, the collective this rank was aborted in, and torchrun may stop them
    before they leave their own record once this process is gone. {} without a watchdog in this process."""
    desync = active_desync()
    if desync is None:
        return {}
    rank = int(os.environ.get("RANK", "0"))
    return {str(r): snap for r, snap in desync.ask_all(timeout_s=PEERS_WAIT_S).items() if r != rank}


def _innermost(error: BaseException) -> types.FrameType | None:
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame if tb is not None else None


def write_record(record: dict[str, Any] | None) -> bool:
    """Write `record` for the launcher; whether it was written (never raises)."""
    folder = os.environ.get(EXIT_MARKS_ENV)
    if not folder or record is None:
        return False
    path = Path(folder) / f"{COLLECTIVE_RECORD_PREFIX}{record['rank']}.json"
    try:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def record_failure(error: BaseException) -> bool:
    """A collective (or anything) failed in the training thread: leave this rank's unfinished collectives."""
    if not os.environ.get(EXIT_MARKS_ENV):
        return False
    try:
        return write_record(failure_record(error, why="raised"))
    except Exception:  # a courtesy to the launcher's verdict: the error itself goes on regardless
        return False


def install_abort_record() -> bool:
    """Have a SIGABRT of this process (gloo aborting it) write its record first; whether it was installed (Linux,
    under a dptrain launcher, once per process). The handler it replaces (faulthandler's, installed by torchelastic's
    `record`) still runs after it."""
    if _installed or not sys.platform.startswith("linux") or not os.environ.get(EXIT_MARKS_ENV):
        return bool(_installed)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    handler = _HANDLER(_on_abort)
    previous = libc.signal(signal.SIGABRT, ctypes.cast(handler, ctypes.c_void_p))
    _installed.update(libc=libc, handler=handler, previous=previous or _SIG_DFL)
    atexit.register(_uninstall)  # no Python from a signal handler once the interpreter is finalizing
    return True


def _uninstall() -> None:
    """Put the replaced handler back (at exit: a backend thread that aborts during the interpreter's teardown must not
    call into it)."""
    if _installed:
        _installed["libc"].signal(signal.SIGABRT, _installed["previous"])


def _on_abort(signum: int) -> None:
    """Runs in the aborting thread (ctypes takes the GIL: the training thread waits in a collective without it)."""
    libc = _installed["libc"]
    libc.alarm(ABORT_WRITE_LIMIT_S)
    with contextlib.suppress(BaseException):
        record = failure_record(None, why="aborted (SIGABRT)")
        if record is not None:
            record["peers"] = _peer_snapshots()
        write_record(record)
    libc.alarm(0)
    # Hand the signal on: it is blocked while this handler runs, so raised now it reaches the handler this one
    # replaced (faulthandler's: every thread's stack, then the default action) as soon as this one returns.
    libc.signal(signum, _installed["previous"])
    getattr(libc, "raise")(signum)
