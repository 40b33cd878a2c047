"""Which of the failed ranks torchrun reports caused the others to fail.

torchrun names as root cause the failure with the earliest timestamp, which its error files keep in whole seconds,
ties going to the lowest rank. When one rank raises, its peers fail within the same second in the collective that
rank left ("Connection closed by peer"), or are terminated by torchrun (SIGTERM), so rank 0 was named for rank 1's
error whenever a peer's own failure was observed first. Here a rank is a victim when its failure only says that a
peer went away; the root cause is the earliest failure that is not a victim's, then the earliest of all."""

from __future__ import annotations

import re
import signal
from typing import Any

PEER_LOST_MARK = "lost peer"
"""The exit mark's reason (distributed/exit_marks.py) of a dptrain worker that stopped because another rank died."""

PEER_LOST_ERRORS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
    r"NCCL communicator was aborted|ProcessGroupNCCL.*(aborted|Watchdog caught collective)|"
    r"Socket Timeout|DistNetworkError|recvBytes|sendBytes",
    re.IGNORECASE,
)
"""What a rank's error reads when it failed only because a peer left the collective (gloo, NCCL, the TCP store)."""


def message(failure: Any) -> str:
    """The failure's error text: the error file's message (a string, or torchelastic's dict form), else ''."""
    msg = getattr(failure, "message", "") or ""
    if isinstance(msg, dict):
        return str(msg.get("message", "")) + "\n" + str(msg.get("extraInfo", {}).get("py_callstack", ""))
    return str(msg)


def is_victim(failure: Any) -> bool:
    """The rank failed because another did: torchrun terminated it, or its error says that a peer went away."""
    if failure.exitcode == -signal.SIGTERM:
        return True
    return bool(PEER_LOST_ERRORS.search(message(failure)))


def root_cause(failures: dict[int, Any], *, victims: set[int] | frozenset[int] = frozenset()) -> int:
    """The rank whose failure caused the others' (module docstring); `victims`: ranks known to have stopped because
    another did (a dptrain worker's exit mark says so: PEER_LOST_MARK)."""
    causes = [rank for rank, f in failures.items() if rank not in victims and not is_victim(f)] or list(failures)
    return min(causes, key=lambda rank: (failures[rank].timestamp, rank))


def name_root_cause(error: Any, marks: dict[int, dict[str, Any]] | None = None) -> tuple[int, Any]:
    """Make torchrun's ChildFailedError report (format_msg's 'Root Cause') name `root_cause`; returns it. `marks`:
    the workers' exit marks (read_exit_marks)."""
    victims = {rank for rank, mark in (marks or {}).items() if mark.get("reason") == PEER_LOST_MARK}
    rank = root_cause(error.failures, victims=victims)
    error.get_first_failure = lambda: (rank, error.failures[rank])
    return rank, error.failures[rank]
