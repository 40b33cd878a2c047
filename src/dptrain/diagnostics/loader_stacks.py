"""Where a rank's DataLoader workers are, when its main thread waits for them.

A worker is another process, out of reach of the rank's own stack. When `LOADER_STACKS_ENV` names a folder (the
diagnostics hub sets it to RUN_DIR/stacks), every worker of `build_dataloader` registers faulthandler on SIGUSR2
(data/loader.py): on that signal it writes the stack of each of its threads to FOLDER/loader-PID.txt. `worker_sites`
signals this process's workers that have such a file and reads back each one's innermost line outside torch and the
standard library: the line a stalled `__getitem__` or collate waits in.
"""

from __future__ import annotations

import os
import re
import signal
import sysconfig
import time
import types
from pathlib import Path

import psutil
import torch

from dptrain.data.loader import LOADER_STACKS_ENV

_DATALOADER_FILE = "torch/utils/data/dataloader.py"
_WORKER_LOOP_FILE = "torch/utils/data/_utils/worker.py"
SKIPPED_DIRS = tuple(  # the standard library and torch: where a process waits, not why
    p.replace("\\", "/") + "/" for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
                                         os.path.dirname(torch.__file__)})
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def waits_for_loader(frame: types.FrameType | None) -> bool:
    """Whether the stack ending in `frame` is inside torch's DataLoader (fetching the next batch)."""
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith(_DATALOADER_FILE):
            return True
        frame = frame.f_back
    return False


def innermost_own_line(dump: str) -> str | None:
    """The first line of a faulthandler dump (most recent call first) outside torch and the standard library:
    "data.py:31 in __getitem__"; "idle" for a worker waiting for work in torch's worker loop (the frames below it
    are the parent's, copied by fork)."""
    for line in dump.splitlines():
        m = _FRAME.match(line)
        if m is None:
            continue
        path = m["path"].replace("\\", "/")
        if path.endswith(_WORKER_LOOP_FILE):
            return "idle (waiting for an index)"
        if not path.startswith(SKIPPED_DIRS) and not path.startswith("<"):
            return f"{os.path.basename(path)}:{m['line']} in {m['func']}"
    return None


def worker_sites(*, timeout_s: float = 1.0) -> list[str]:
    """For each DataLoader worker of this process that registered its stack file: "worker pid N at data.py:31 in
    __getitem__" (or "... at an unknown line" when it did not answer within `timeout_s`)."""
    folder = os.environ.get(LOADER_STACKS_ENV)
    if not folder:
        return []
    asked: dict[int, tuple[Path, int]] = {}
    for child in psutil.Process().children():
        path = Path(folder) / f"loader-{child.pid}.txt"
        try:
            before = path.stat().st_size
            os.kill(child.pid, signal.SIGUSR2)
        except (OSError, psutil.Error):  # not a worker of ours, or gone
            continue
        asked[child.pid] = (path, before)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.stat().st_size == n for p, n in asked.values()):
        time.sleep(0.02)
    out = []
    for pid, (path, before) in asked.items():
        with open(path) as f:
            f.seek(before)
            line = innermost_own_line(f.read())
        where = line if line and line.startswith("idle") else f"at {line or 'an unknown line'}"
        out.append(f"worker pid {pid} {where}")
    return out
