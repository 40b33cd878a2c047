"""What every fault shares: this process's rank, the step it is at, and the injection time stamp."""

from __future__ import annotations

import os
import time
from pathlib import Path

_calls = {"train": 0}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def culprit() -> int:
    return int(os.environ.get("FAULT_RANK", "-1"))


def fault_step() -> int:
    return int(os.environ.get("FAULT_STEP", "0"))


def is_culprit() -> bool:
    return rank() == culprit()


def training_step(model) -> int:
    """The 1-based training call of the loss in this process (evaluation calls are not counted)."""
    if model.training:
        _calls["train"] += 1
    return _calls["train"]


def mark() -> None:
    """Write the injection time (the first one wins: a fault is injected once)."""
    path = os.environ.get("FAULT_MARK")
    if path and not Path(path).exists():
        tmp = Path(f"{path}.{os.getpid()}")
        tmp.write_text(repr(time.time()))
        tmp.replace(path)


def stall_forever() -> None:
    """A rank stuck in Python outside any collective (what a deadlocked lock or an endless wait looks like)."""
    while True:
        time.sleep(3600)
