"""A node's warm server: `python -m dptrain.launch.warm_server DIR LISTEN_FD LAUNCHER_PID [MODULE...]`.

The launcher starts it (launch/warm.py) with the environment its workers inherit. It imports torch and dptrain's
worker and trainer modules once, then serves the clients torchrun starts as workers (launch/warm_client.py): for
each it forks a process that takes the client's argv, environment, cwd, fds 0/1/2, signal dispositions and mask, and
runs `python -m MODULE ARGS...` there, then sends the client that process's status. It stays single-threaded (it
forks; a fork of a process with other threads would copy their locks mid-use), never touches CUDA or a process group,
dies with the launcher (PR_SET_PDEATHSIG, then removes DIR), and a forked worker whose client is gone is SIGKILLed
(by the server, and by a thread of its own that watches the connection).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import io
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from dptrain.launch.warm_client import HEADER, PARENT_ENV, read_exact, send_message

PRELOAD = (
    "torch",
    "torch.distributed.elastic.multiprocessing.errors",
    "dptrain.launch.worker",
    "dptrain.launch.elastic",
    "dptrain.metrics.console_log",
    "dptrain.checkpoint.preempt",
    "dptrain.checkpoint.rundir",
    "dptrain.config.load",
    "dptrain.diagnostics.nonfinite",
    "dptrain.train.trainer",
)
"""What a worker imports, imported here once (the modules `python -m dptrain.launch.worker` loads)."""
READY_FILE = "ready.json"
"""Written into DIR once the imports are done: their time and this process's RSS then (benchmarks read it)."""
REQUEST_TIMEOUT_S = 10.0
STARTUP_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONHASHSEED", "PYTHONOPTIMIZE",
               "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "PYTHONDEVMODE", "PYTHONUTF8")
"""What an interpreter reads once at its start: a worker whose values differ from the server's runs cold."""


def mismatch(request: dict[str, Any]) -> str | None:
    """Why this server cannot stand for the client's own interpreter, or None."""
    if request.get("executable") != sys.executable:
        return f"the worker runs {request.get('executable')}, the warm server {sys.executable}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use CUDA
        return "CUDA was initialised in the warm server"
    env = request["env"]
    for key in STARTUP_ENV:
        if env.get(key) != os.environ.get(key):
            return f"the worker's {key} differs from the warm server's"
    return None


def threads() -> int:
    """This process's OS threads (not only Python's)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def stop_blas_threads() -> None:
    """End OpenBLAS's idle thread pool (numpy's, started when torch imports numpy with more than one BLAS thread).
    OpenBLAS does the same itself before a fork (its pthread_atfork handler) and starts the pool again on the next
    BLAS call, in the forked worker; done here, this process stays single-threaded."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return
    libs = {line.split()[-1] for line in maps.splitlines() if "openblas" in line.rsplit("/", 1)[-1]}
    for lib in sorted(libs):
        try:
            shutdown = ctypes.CDLL(lib).blas_thread_shutdown_
        except (OSError, AttributeError):
            continue
        shutdown()


class Server:
    def __init__(self, folder: Path, listener: socket.socket, launcher: int) -> None:
        self.folder, self.listener, self.launcher = folder, listener, launcher
        self.start_cwd = os.getcwd()  # sys.path[0] of `python -m` (a worker's is its own cwd)
        self.selector = selectors.DefaultSelector()
        self.workers: dict[int, socket.socket] = {}  # worker pid -> its client's connection
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector (wakeup fd); reaped below
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        while True:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    self.accept()
                elif key.data == "wake":
                    with_retry(os.read, self.wake_r, 512)
                elif self.closed(key.fileobj):
                    self.client_closed(key.data)
            self.reap()
            if os.getppid() != self.launcher:  # the death signal is lost if the launcher died before prctl
                self.shutdown()

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(True)
        conn.settimeout(REQUEST_TIMEOUT_S)
        fds: list[int] = []
        try:
            head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
            head += read_exact(conn, HEADER.size - len(head))
            (n,) = HEADER.unpack(head)
            request = json.loads(read_exact(conn, n))
            if len(fds) != 3:
                raise ValueError(f"expected fds 0/1/2, got {len(fds)}")
            refused = mismatch(request)
            if refused is None and threads() != 1:  # a fork would copy other threads' locks mid-use
                refused = f"the warm server has {threads()} threads; it forks only with one"
            if refused is not None:  # the client runs the worker cold, and says why
                send_message(conn, {"refused": refused})
                conn.close()
                return
            pid = self.fork(conn, request, fds)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            print(f"dptrain: warm server: a worker request failed: {e}", file=sys.stderr, flush=True)
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        self.workers[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        try:
            send_message(conn, {"pid": pid})
        except OSError:  # the client is already gone
            self.client_closed(pid)

    def fork(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # nothing runs our handlers there
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = self.become(conn, request, fds)
            except BaseException:  # never return into the server loop in the child
                traceback.print_exc()
            finally:
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return pid

    def become(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> int:
        """In the forked child: take the client's place and run its module as `python -m` would; its exit code."""
        os.setsid()  # a session of its own, as torchrun starts workers
        signal.set_wakeup_fd(-1)
        watch_client(conn.dup())
        for sock in (conn, self.listener, *self.workers.values()):
            sock.close()
        self.selector.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[PARENT_ENV] = str(os.getppid())
        reset_stdio(unbuffered=bool(request.get("unbuffered")))
        if sys.path and sys.path[0] == self.start_cwd:
            sys.path[0] = request["cwd"]
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGINT):  # the server's own handlers
            signal.signal(sig, signal.SIG_DFL)
        for num, how in request["signals"].items():
            handler: Any = (signal.SIG_IGN if how == "ign" else signal.default_int_handler if how == "int"
                            else signal.SIG_DFL)
            try:
                signal.signal(int(num), handler)
            except (ValueError, OSError):
                pass
        numpy = sys.modules.get("numpy")
        if numpy is not None:  # its global generator was seeded once, in the server: a fresh one per worker, as cold
            numpy.random.seed()
        module, *args = request["argv"]
        sys.argv = [module, *args]
        signal.pthread_sigmask(signal.SIG_SETMASK, {signal.Signals(s) for s in request["mask"]})
        sys.modules.pop(module, None)  # preloaded: `python -m` runs it as __main__ only (and runpy warns otherwise)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = exit_code(e.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            atexit._run_exitfuncs()
            flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # as CPython ends on an unhandled Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)
            code = 130
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
        flush()
        return code

    @staticmethod
    def closed(conn: Any) -> bool:
        """Whether a client's readable connection is at EOF (or broken); a client sends nothing after its request."""
        try:
            return conn.recv(64, socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def client_closed(self, pid: int) -> None:
        """The client's connection closed (it was SIGKILLed, or the server already reported): kill its worker."""
        conn = self.workers.pop(pid, None)
        if conn is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.drop(conn)

    def drop(self, conn: socket.socket) -> None:
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.workers.pop(pid, None)
            if conn is None:
                continue
            message = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                       else {"exit": os.waitstatus_to_exitcode(status)})
            try:
                conn.setblocking(True)
                conn.settimeout(REQUEST_TIMEOUT_S)
                send_message(conn, message)
            except OSError:
                pass
            self.drop(conn)

    def shutdown(self, *_: Any) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        os._exit(0)  # the forked workers get SIGTERM from their own parent-death signal and save, as cold ones do


def watch_client(conn: socket.socket) -> None:
    """In the forked worker: SIGKILL itself once its client's connection closes (the client was killed), even if
    the server cannot do it. A daemon thread blocked in recv; the client sends nothing after its request."""

    def watch() -> None:
        conn.settimeout(None)
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="dptrain-warm-watch", daemon=True).start()


def with_retry(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except (BlockingIOError, InterruptedError):
        return None


def exit_code(code: Any) -> int:
    """The status CPython exits with for `SystemExit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def reset_stdio(*, unbuffered: bool) -> None:
    """New sys.stdin/stdout/stderr on fds 0/1/2 (now the client's), buffered as a fresh interpreter's would be."""
    flush()
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        tty = os.isatty(fd)
        if mode == "r":
            stream: io.TextIOWrapper = open(fd, closefd=False)  # noqa: SIM115
        else:
            raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
            stream = io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                                      line_buffering=tty or fd == 2, write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def die_with_launcher(launcher: int, folder: Path) -> None:
    """SIGTERM when the launcher dies; then remove `folder` and exit."""
    def stop(signum: int, frame: Any) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != launcher:
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)


def main(argv: list[str]) -> int:
    folder, fd, launcher = Path(argv[0]), int(argv[1]), int(argv[2])
    die_with_launcher(launcher, folder)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C reaches the workers through torchrun
    listener = socket.socket(fileno=fd)
    t0 = time.monotonic()
    for name in argv[3:] or PRELOAD:
        importlib.import_module(name)
    stop_blas_threads()
    rss = 0
    try:
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    ready = {"pid": os.getpid(), "import_s": round(time.monotonic() - t0, 3), "rss_bytes": rss, "threads": threads()}
    (folder / READY_FILE).write_text(json.dumps(ready))
    Server(folder, listener, launcher).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
