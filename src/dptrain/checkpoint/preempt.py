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

from dptrain.distributed.collectives import all_reduce_max

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
        stop, any_busy = all_reduce_max([float(self.received), float(busy)], device=self.device)
        return bool(stop), bool(any_busy)

    def restore(self) -> None:
        """Put the previous SIGTERM handler back."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
