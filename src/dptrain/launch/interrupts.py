"""The launcher's Ctrl-C: before any worker (`EARLY`: remembered, so that a KeyboardInterrupt lost inside torch's
import still stops the run), what is saved (`last_saved`), its SIGINT handler (`CtrlC`: the first hands over to
torchrun's shutdown, the second kills the workers), and workers that start with SIGINT blocked
(`workers_start_with_sigint_blocked`), so that a Ctrl-C in the instant one starts reaches its own handler."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dptrain.checkpoint import manifest as mf


class EarlyCtrlC:
    """Ctrl-C while the launcher checks its input, before the run's own handler exists. Python's default handler
    raises KeyboardInterrupt wherever the main thread is; inside `import torch` that is sometimes C++ code that
    swallows it (measured: `import torch` with a SIGINT at a random instant finished in 13 of 30 tries), and the
    run then started and trained to the end as if nothing was pressed. This handler raises the same
    KeyboardInterrupt and also remembers it: `check` raises it again at the last point before workers start."""

    def __init__(self) -> None:
        self.seen = False

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise KeyboardInterrupt if a Ctrl-C came, even one something swallowed on its way up."""
        if self.seen:
            raise KeyboardInterrupt


EARLY = EarlyCtrlC()


def exit_after_early_ctrl_c(code: int) -> None:
    """The process's exit once `main` has handled an early Ctrl-C. CPython kills itself with SIGINT at exit (the
    shell then sees status -2, not `code`) whenever a KeyboardInterrupt once escaped a C-level `PyRun_*` call,
    as one can inside torch's import, even though `main` handled it; `os._exit` keeps `code`."""
    if EARLY.seen:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


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
        raise self.exception()

    @staticmethod
    def exception() -> Exception:
        """What torchrun's agent takes as "shut the workers down" (`agent.run` catches it)."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        return SignalException(f"Process {os.getpid()} got signal: SIGINT", sigval=signal.SIGINT)

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._previous)


@contextlib.contextmanager
def workers_start_with_sigint_blocked(interrupts: CtrlC) -> Iterator[None]:
    """While torchrun's agent starts dptrain's workers, SIGINT is blocked in this (the spawning) thread, so the
    workers start with it blocked: the mask survives fork and exec. torchrun ends workers with SIGINT on Ctrl-C;
    one sent in the instant a worker's interpreter starts then stays pending until the worker has installed its own
    handler (launch/worker.py unblocks it there), instead of raising KeyboardInterrupt in its imports with a
    traceback. A Ctrl-C to this launcher during a spawn is handled just after it; one that came before the spawn
    (`interrupts.count`) but was swallowed on the way (the rendezvous retries what fails) stops it here."""
    # lazy: torch: only when workers are started
    from torch.distributed.elastic.agent.server import local_elastic_agent as agent

    start = getattr(agent, "start_processes", None)
    if start is None:  # another torch layout: workers start as torchrun starts them
        yield
        return

    @functools.wraps(start)
    def start_blocked(*args: Any, **kwargs: Any) -> Any:
        if interrupts.count:
            raise interrupts.exception()
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
