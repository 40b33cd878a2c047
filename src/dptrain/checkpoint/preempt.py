"""Preemption and Ctrl-C: SIGTERM or SIGINT sets a flag; every rank agrees, one step later, to stop and save.

A scheduler (Slurm, Kubernetes, a spot reclaim) sends SIGTERM and kills a while later. The
handler only sets a flag (nothing unsafe runs inside a signal handler). The job then saves and
exits with `EXIT_PREEMPTED` (143 = 128 + SIGTERM, the code a shell reports for a SIGTERM'd process).
The first Ctrl-C (SIGINT; under torchrun the agent forwards it to the workers, which run in
sessions of their own) does the same and exits `EXIT_INTERRUPTED` (130 = 128 + SIGINT); a second
one aborts at once, saying which step is the last one saved.

The agreement never blocks a step. At every step boundary each rank

1. collects the result of the all-reduce (MAX) it started at the previous boundary, and
2. starts a new one (`async_op=True`) of its flags as they are now: [SIGTERM or SIGINT
   received, a background checkpoint write still running on this rank, SIGINT received].

The flags travel as a 2-element CPU tensor over a gloo process group of their own, created once,
on every rank, when the flag is made (at setup). On CPU, reading the result is a memory read; on
a GPU run the training tensors never take part, so there is no host-device sync, and the
dedicated group keeps these reductions from interleaving with the gradient collectives of DDP or
FSDP on the default group. By the time a step has been computed, the small reduction started one
step earlier has long finished, so `collect` does not wait in practice.

Every rank starts and collects exactly one reduction per step, so the k-th reduction is read at
the same step on every rank: a SIGTERM that reaches any rank during step N is agreed at the end
of step N+1 on all of them, and all save that step and stop. The "busy" flag rides on the same
reduction: a background save is committed only once every rank reported its write finished
(see CheckpointManager.maybe_save). At world size 1 the same protocol runs without a process
group (the flags are handed from one boundary to the next), so a run behaves alike at any size.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from dptrain.distributed import collectives

EXIT_PREEMPTED = 143
EXIT_INTERRUPTED = 130


def abort_now(last_saved: str) -> None:
    """A second Ctrl-C: leave at once (no cleanup: a half-written checkpoint is never committed)."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"\ndptrain: second Ctrl-C: aborted without saving; {last_saved}\n".encode())
    os._exit(EXIT_INTERRUPTED)


class PreemptionFlag:
    """Installs a SIGTERM handler (main thread only) and agrees, one step later, whether to stop.
    Construct it at the same point on every rank (it creates a process group when world size > 1)."""

    def __init__(self) -> None:
        self.received = False
        self.interrupted = False  # SIGINT (Ctrl-C) rather than SIGTERM
        self.interrupted_agreed = False  # some rank was interrupted, as of the last `collect`
        self.last_saved = "no checkpoint of this run was committed"  # for a second Ctrl-C's message
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        self._group = dist.new_group(backend="gloo") if collectives.world_size() > 1 else None
        self._buf = torch.zeros(3)
        self._work: Any = None
        self._direct = (False, False, False)  # world size 1: the flags of the last `start`

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self.interrupted:
                abort_now(self.last_saved)
            self.interrupted = True
            if os.environ.get("RANK", "0") == "0" and not os.environ.get("TORCHELASTIC_RUN_ID"):
                # one process, no launcher to say it: the first Ctrl-C's promise
                os.write(2, b"\ndptrain: Ctrl-C: finishing the step, saving a checkpoint, then stopping "
                            b"(Ctrl-C again aborts without saving)\n")
        self.received = True

    def collect(self) -> tuple[bool, bool]:
        """(any rank received SIGTERM or SIGINT, any rank was busy), as of the last `start`; (False,
        False) before the first. The same on every rank (so is `interrupted_agreed`). Waits only if
        that reduction is still running."""
        if self._group is None:
            (stop, busy, self.interrupted_agreed), self._direct = self._direct, (False, False, False)
            return stop, busy
        if self._work is None:
            return False, False
        self._work.wait()
        self._work = None
        flags = self._buf.numpy()  # a CPU tensor: no device involved
        self.interrupted_agreed = bool(flags[2] > 0)
        return bool(flags[0] > 0), bool(flags[1] > 0)

    def start(self, *, busy: bool) -> None:
        """Start agreeing on this rank's flags now; `collect` reads the result. Collective."""
        if self._group is None:
            self._direct = (self.received, busy, self.interrupted)
            return
        if self._work is not None:
            raise RuntimeError(
                "PreemptionFlag.start called twice without collect: the ranks' reductions would pair up wrongly"
            )
        self._buf = torch.tensor([float(self.received), float(busy), float(self.interrupted)])
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def close(self, *, wait: bool = True) -> None:
        """Finish the reduction in flight (`wait`, on every rank: it is collective) and put the
        previous SIGTERM handler back. Without `wait` (a failing run) the reduction is abandoned."""
        if self._work is not None and wait:
            self._work.wait()
        self._work = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
