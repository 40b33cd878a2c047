"""Multi-process test harness: run a function on W forked ranks that form a real gloo group.

`run_ranks(fn, world_size, *args)` forks one child per rank with the environment torchrun would
set (so `DistEnv.from_env().launched` is True and `Trainer`/`init_process_group` join a real
process group), calls `fn(rank, *args)` in each, and returns the ranks' return values in rank
order. Every failing rank writes its own traceback to a file; the parent raises ONE error that
lists all of them (the first reported failure is often the victim, not the culprit) and says
which ranks timed out or were killed. Survivors are killed on timeout or after another rank
failed, so no orphan keeps a port or a CPU busy.

Fork, not spawn: spawn re-imports torch in every child (~50x slower here). Forking is only safe
while the parent has no process group and no CUDA context; both are checked.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["RankError", "find_free_port", "run_ranks", "in_group", "local_bytes", "DIST_ENV_VARS"]

# Variables the harness sets in the children; the parent must never carry them (see conftest).
DIST_ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")

# After one rank fails, the others usually block in a collective until the gloo timeout;
# give them this long to fail on their own (their tracebacks may be the informative ones).
FAILURE_GRACE_S = 5.0


class RankError(RuntimeError):
    """One or more ranks failed or timed out; the message holds every failing rank's traceback."""

    def __init__(self, message: str, *, failed: dict[int, str], timed_out: list[int], killed: list[int]) -> None:
        super().__init__(message)
        self.failed = failed
        self.timed_out = timed_out
        self.killed = killed


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, picked at random below Linux's ephemeral range (32768 and
    up): the kernel's own pick for port 0 is an ephemeral port, which an outgoing connection of a test running
    alongside may take before this one's server binds it (a rendezvous then meets a stranger)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port in 20000-32000 on 127.0.0.1")


def _child(fn: Callable[..., Any], rank: int, args: tuple, env: dict[str, str], workdir: str) -> None:
    # Own process group: the parent can kill this rank together with anything it started.
    os.setpgid(0, 0)
    os.environ.update(env)
    result_path = Path(workdir) / f"rank{rank}.pkl"
    error_path = Path(workdir) / f"rank{rank}.err"
    # On timeout the parent sends SIGUSR1 first: every thread's Python stack lands here.
    stack_file = open(Path(workdir) / f"rank{rank}.stack", "w")  # noqa: SIM115 - lives until _exit
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    code = 0
    try:
        import torch

        torch.set_num_threads(1)
        result = fn(rank, *args)
        tmp = result_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, result_path)
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit/KeyboardInterrupt
        error_path.write_text(traceback.format_exc())
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # Skip atexit handlers and finalizers inherited from the parent (pytest's among them).
    os._exit(code)


def _kill(proc: mp.process.BaseProcess) -> None:
    if proc.pid is None:
        return
    for target in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: os.kill(proc.pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass
    proc.join(5)


def _check_fork_safe() -> None:
    if "torch" not in sys.modules:
        return
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "run_ranks: the parent process has an initialised torch.distributed process group; "
            "forked children would inherit it. Destroy it first (or run the collective code inside fn)."
        )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError("run_ranks: CUDA is initialised in the parent; fork would break it in the children")


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    grace: float = FAILURE_GRACE_S,
) -> list[Any]:
    """Run `fn(rank, *args)` on `world_size` forked ranks; return their results in rank order.

    `fn` and `args` are not pickled (fork), but each return value is, so return plain data
    (tensors are fine, DTensors are not: call `.full_tensor()` first). `env` adds variables to
    every child's environment. Once a rank has failed, the others get `grace` seconds to finish or
    fail on their own before they are killed. Raises RankError listing every failing rank's
    traceback, and the Python stacks of the ranks that timed out or were killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _check_fork_safe()
    ctx = mp.get_context("fork")
    port = find_free_port()
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    with tempfile.TemporaryDirectory(prefix="dptrain-mp-") as workdir:
        procs: list[mp.process.BaseProcess] = []
        try:
            for rank in range(world_size):
                child_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                p = ctx.Process(
                    target=_child, args=(fn, rank, args, child_env, workdir), name=f"rank{rank}", daemon=False
                )
                p.start()
                procs.append(p)
            timed_out, killed = _wait(procs, timeout, grace, Path(workdir))
        finally:
            for p in procs:  # also on KeyboardInterrupt in the parent: no orphans
                if p.is_alive():
                    _kill(p)
        return _collect(procs, Path(workdir), timed_out, killed, timeout, grace)


def _wait(
    procs: list[mp.process.BaseProcess], timeout: float, grace: float, workdir: Path
) -> tuple[list[int], list[int]]:
    """Wait for all ranks; kill the rest on timeout or `grace` seconds after a rank failed."""
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            return [], []
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        now = time.monotonic()
        if now >= deadline:
            ranks = [procs.index(p) for p in alive]
            _dump_stacks(alive, workdir)
            for p in alive:
                _kill(p)
            return ranks, []
        if failed_at is not None and now - failed_at >= grace:
            ranks = [procs.index(p) for p in alive]
            _dump_stacks(alive, workdir)
            for p in alive:
                _kill(p)
            return [], ranks
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=min(0.2, deadline - now))


# Frames of the Python interpreter itself: noise in a native stack (the Python stack is dumped separately).
_INTERPRETER_FRAME = re.compile(
    r"Python/|Objects/|Include/|Modules/|Programs/|\b_?Py[A-Z_]\w* \(|pybind11::|libc-start|_start \("
)


def _dump_stacks(procs: list[mp.process.BaseProcess], workdir: Path) -> None:
    """Before hung ranks are killed: their Python stacks (faulthandler on SIGUSR1) and, when gdb is
    installed, their native stacks (a hang inside C++ shows no Python frame: a deadlock in a
    destructor, a collective waiting for a peer)."""
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(0.5)
    gdb = shutil.which("gdb") if os.environ.get("DPTRAIN_TEST_NATIVE_STACKS", "1") != "0" else None
    if gdb is None:
        return
    for p in procs:
        rank = int(p.name.removeprefix("rank"))
        try:
            out = subprocess.run(
                [gdb, "-p", str(p.pid), "-batch", "-nx", "-ex", "thread apply all bt 25"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
        except (subprocess.TimeoutExpired, OSError):
            continue
        frames = [
            line[:180]
            for line in out.splitlines()
            if line.startswith("Thread ") or (line.startswith("#") and not _INTERPRETER_FRAME.search(line))
        ]
        (workdir / f"rank{rank}.native").write_text("\n".join(frames[:400]))


def _collect(
    procs: list[mp.process.BaseProcess],
    workdir: Path,
    timed_out: list[int],
    killed: list[int],
    timeout: float,
    grace: float,
) -> list[Any]:
    results: list[Any] = []
    failed: dict[int, str] = {}  # rank -> traceback (or why there is none)
    hung: dict[int, str] = {}  # rank -> its Python stacks when it was killed
    for rank, p in enumerate(procs):
        err, res, stack, native = (workdir / f"rank{rank}.{ext}" for ext in ("err", "pkl", "stack", "native"))
        if err.exists():
            failed[rank] = err.read_text()
        elif rank in timed_out or rank in killed:
            hung[rank] = (stack.read_text().strip() if stack.exists() else "") or "(no Python stack dump)"
            if native.exists():
                hung[rank] += "\n--- native stacks (gdb) ---\n" + native.read_text()
        elif p.exitcode != 0 or not res.exists():
            failed[rank] = f"exited with code {p.exitcode} without a traceback (crashed or killed by a signal)"
        if res.exists() and rank not in failed and rank not in hung:
            with open(res, "rb") as f:
                results.append(pickle.load(f))
        else:
            results.append(None)
    if failed or hung:
        parts = [f"{len(failed)} of {len(procs)} rank(s) failed"]
        if timed_out:
            parts.append(f"rank(s) {timed_out} timed out after {timeout:g}s and were killed")
        if killed:
            parts.append(f"rank(s) {killed} were still running {grace:g}s after a failure and were killed")
        msg = "; ".join(parts)
        for rank, tb in sorted(failed.items()):
            msg += f"\n\n===== rank {rank}: traceback =====\n{tb.rstrip()}"
        for rank, st in sorted(hung.items()):
            msg += f"\n\n===== rank {rank}: killed while running; its stacks =====\n{st}"
        raise RankError(msg, failed=failed, timed_out=timed_out, killed=killed)
    return results


# ------------------------------------------------------------------ inside a rank
def in_group(fn: Callable[[], Any]) -> Any:
    """Run fn() inside this rank's process group; free what fn made before the group goes."""
    import gc

    import torch

    from dptrain.distributed.env import DistEnv
    from dptrain.distributed.process_group import destroy_process_group, init_process_group

    init_process_group(DistEnv.from_env(), backend="gloo", device=torch.device("cpu"), timeout_s=60)
    try:
        return fn()
    finally:
        gc.collect()
        destroy_process_group()


def local_bytes(t: Any) -> int:
    """Bytes this rank holds of a tensor or a DTensor (its local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()
