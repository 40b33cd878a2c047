"""The launcher's Ctrl-C: what is saved (`last_saved`), its SIGINT handler (`CtrlC`: the first hands over to
torchrun's shutdown, the second kills the workers), and workers that start with SIGINT blocked
(`workers_start_with_sigint_blocked`), so that a Ctrl-C in the instant one starts reaches its own handler."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dptrain.checkpoint import manifest as mf


def last_saved(ckpt_root: Path | None) -> str:
    """What is saved of the run: its newest committed checkpoint (hashes not re-checked here)."""
    if ckpt_root is None:
        return "the last finished step is checkpointed"

    committed = [i for i in mf.list_checkpoints(ckpt_root, check_hashes=False) if i.valid]
    if not committed:
        return f"no checkpoint was committed under {ckpt_root}"
    return f"the last committed checkpoint is {committed[-1].path} (step {committed[-1].step})"


class CtrlC:
    """The launcher's SIGINT handler. torchrun's agent handles SIGINT like SIGTERM (it forwards the
    signal to the workers, which run in sessions of their own, and waits for them); dptrain takes
    SIGINT out of the signals torchrun handles (`--signals-to-handle`) to count them: the
    first says what happens and hands over to torchrun's shutdown (the workers finish the step, agree,
    save, exit 130); the second kills the workers at once and says what was not saved."""

    def __init__(self, ckpt_root: Path | None) -> None:
        self.ckpt_root, self.count = ckpt_root, 0
        self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        self.count += 1
        if self.count == 1:
            print(
                "\ndptrain: Ctrl-C: finishing the current step, saving a checkpoint, then stopping "
                "(Ctrl-C again aborts without saving)",
                file=sys.stderr,
                flush=True,
            )
        else:
            import psutil

            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
            print(
                f"\ndptrain: second Ctrl-C: workers killed without saving; {last_saved(self.ckpt_root)}",
                file=sys.stderr,
                flush=True,
            )
        raise SignalException(f"Process {os.getpid()} got signal: SIGINT", sigval=signal.SIGINT)

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._previous)


@contextlib.contextmanager
def workers_start_with_sigint_blocked() -> Iterator[None]:
    """While torchrun's agent starts dptrain's workers, SIGINT is blocked in this (the spawning) thread, so the
    workers start with it blocked: the mask survives fork and exec. torchrun ends workers with SIGINT on Ctrl-C;
    one sent in the instant a worker's interpreter starts then stays pending until the worker has installed its own
    handler (launch/worker.py unblocks it there), instead of raising KeyboardInterrupt in its imports with a
    traceback. A Ctrl-C to this launcher during a spawn is handled just after it."""
    # lazy: torch: only when workers are started
    from torch.distributed.elastic.agent.server import local_elastic_agent as agent

    start = getattr(agent, "start_processes", None)
    if start is None:  # another torch layout: workers start as torchrun starts them
        yield
        return

    @functools.wraps(start)
    def start_blocked(*args: Any, **kwargs: Any) -> Any:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return start(*args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    agent.start_processes = start_blocked
    try:
        yield
    finally:
        agent.start_processes = start
