"""`notebook_launch(fn, *args, nproc=2)`: run a training function on N processes from a Jupyter
kernel and return rank 0's result.

Forking a running kernel is unsafe (its threads, its ZeroMQ sockets, a CUDA context), so the
workers are started by torchrun's own launcher API, `torch.distributed.launcher.api.elastic_launch`,
with the spawn start method: fresh interpreters, a c10d rendezvous on a free local port, the
environment torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), so `dptrain.Trainer`
and `init_process_group` inside `fn` join a real process group.

A spawned interpreter cannot import a function defined in the notebook (it lives in the kernel's
`__main__`) or a lambda. With cloudpickle installed (the `dptrain[notebook]` extra), `fn` and
`args` are pickled by value in the kernel, so such functions work as long as everything they use
is importable or picklable; without it `fn` must live in an importable module (a .py file next to
the notebook), and a `__main__` function or lambda is refused before anything starts, saying so.
The result each rank returns travels back with plain pickle: return plain data (numbers, dicts,
CPU tensors).

The workers' output goes to log files (in `log_dir`, else a temporary folder); rank 0's is copied
into the cell's output as it arrives, every rank's stays in the files.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dptrain.launch.torchrun import RESTART_ENV


class NotPicklableError(TypeError):
    """`fn` or its arguments cannot be sent to a spawned process."""


def notebook_launch(fn: Callable[..., Any], *args: Any, nproc: int = 2, max_restarts: int = 0,
                    log_dir: str | Path | None = None, env: dict[str, str] | None = None) -> Any:
    """Run `fn(*args)` on `nproc` processes of this machine and return what rank 0's returned.

    `max_restarts`: elastic restarts of the whole group after a failure (as `dptrain run
    --max-restarts`); `env`: extra environment variables for the workers. A failing rank raises
    torch's `ChildFailedError`, which names the rank and carries its traceback."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} is not valid; use a positive integer (the number of processes)")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r} is not valid; use an integer >= 0")
    payload = dumps_callable(fn, args)
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with contextlib.ExitStack() as stack:
        root = Path(log_dir) if log_dir is not None else Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="dptrain-notebook-")))
        root.mkdir(parents=True, exist_ok=True)
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"dptrain-nb-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=max_restarts, start_method="spawn",
            logs_specs=DefaultLogsSpecs(log_dir=str(root), redirects=Std.ALL), monitor_interval=0.1,
        )
        extra = {**(RESTART_ENV if max_restarts else {}), **(env or {})}
        if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in extra:
            extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))  # as dptrain run sets it
        stack.enter_context(_environ(extra))  # the agent hands its environment to the workers
        stack.enter_context(_Echo(root, stream=sys.stdout))
        stack.enter_context(_signal_handlers(config.signals_to_handle))
        results = elastic_launch(config, entrypoint=run_pickled)(payload)
    return results[0]


def dumps_callable(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """`(fn, args)` as bytes a spawned interpreter can load (see the module docstring)."""
    if not callable(fn):
        raise NotPicklableError(f"notebook_launch needs a function; got {type(fn).__name__} {fn!r}")
    try:
        import cloudpickle
    except ImportError:
        cloudpickle = None
    name = getattr(fn, "__qualname__", repr(fn))
    if cloudpickle is None and (getattr(fn, "__module__", None) == "__main__" or "<" in name):
        raise NotPicklableError(
            f"notebook_launch: {name!r} is defined in the notebook (or is a lambda or nested function), and the "
            "spawned workers cannot import it. Install cloudpickle (pip install 'dptrain[notebook]'), which sends "
            "it by value, or move the function into a .py module next to the notebook and import it from there")
    try:
        return (cloudpickle or pickle).dumps((fn, args))
    except Exception as e:  # pickle raises PicklingError, TypeError, AttributeError, ...
        raise NotPicklableError(
            f"notebook_launch: cannot send {name!r} and its arguments to the workers ({type(e).__name__}: {e}); "
            "pass plain data (paths, numbers, config overrides) and build models, loaders and process groups "
            "inside the function") from e


def run_pickled(payload: bytes) -> Any:
    """Runs in each worker: load `(fn, args)` and call it."""
    fn, args = pickle.loads(payload)  # cloudpickle's output loads with pickle when cloudpickle is importable
    return fn(*args)


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _signal_handlers(names: str) -> Iterator[None]:
    """The agent installs its own handlers for these signals (they raise SignalException) and leaves
    them behind; the kernel's own (SIGINT: interrupt the cell) come back afterwards."""
    sigs = [getattr(signal, n.strip()) for n in names.split(",") if hasattr(signal, n.strip())]
    old = {s: signal.getsignal(s) for s in sigs}
    try:
        yield
    finally:
        for s, handler in old.items():
            if handler is not None:
                signal.signal(s, handler)


class _Echo:
    """Copies local rank 0's stdout/stderr log files (every attempt) to `stream` while they grow."""

    def __init__(self, root: Path, *, stream: Any, every_s: float = 0.3) -> None:
        self.root, self.stream, self.every_s = root, stream, every_s
        self._offsets: dict[Path, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dptrain-notebook-echo", daemon=True)

    def __enter__(self) -> _Echo:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()  # what was written after the last poll

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._poll()

    def _poll(self) -> None:
        for path in sorted(self.root.glob("*/attempt_*/0/std*.log")):
            with contextlib.suppress(OSError):
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    data = f.read()
                if data:
                    self._offsets[path] = self._offsets.get(path, 0) + len(data)
                    self.stream.write(data.decode(errors="replace"))
                    self.stream.flush()
