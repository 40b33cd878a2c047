"""Preemption: SIGTERM sets a flag; at the next step boundary every rank agrees and saves.

A scheduler (Slurm, Kubernetes, a spot reclaim) sends SIGTERM and kills a while later. The
handler only sets a flag (nothing unsafe runs inside a signal handler); the trainer calls
`should_stop` after every step, which all-reduces the flag (MAX) so that a signal seen by any
one rank stops all of them at the same step. The job then saves and exits with
`EXIT_PREEMPTED` (143 = 128 + SIGTERM, the code a shell reports for a SIGTERM'd process).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 143


class PreemptionFlag:
    """Installs a SIGTERM handler (main thread only) and tells, collectively, whether to stop."""

    def __init__(self, *, device: torch.device) -> None:
        self.device = device
        self.received = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def should_stop(self, *, busy: bool = False) -> tuple[bool, bool]:
        """(any rank received SIGTERM, any rank is `busy`), the same on every rank; one small
        all-reduce. `busy` carries the background checkpoint writer's state. Collective."""
        flags = [self.received, busy]
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return flags[0], flags[1]
        t = torch.tensor([1.0 if f else 0.0 for f in flags], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0].item()), bool(t[1].item())

    def restore(self) -> None:
        """Put the previous SIGTERM handler back."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
