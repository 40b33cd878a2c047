"""The command torchrun starts for a worker when warm spares are on (launch.warm_workers):
`python -u -m dptrain.launch.warm_client MODULE ARGS...`.

It imports the standard library only (no torch). It connects to this node's warm server (launch/warm_server.py,
socket path in `SOCKET_ENV`), hands it its argv, environment, cwd, signal dispositions and mask, and its fds 0/1/2,
and the server forks a process that already holds torch and dptrain's imports to run `python -m MODULE ARGS...`.
This process stays torchrun's worker: it forwards the signals torchrun sends (`FORWARDED`) to that process, waits
for its status and ends the same way (the same exit code, or killed by the same signal). Killed itself (SIGKILL),
its connection closes and the server SIGKILLs the forked process at once. When there is no server, or it does not
answer, this process runs `python -m MODULE ARGS...` itself (exec), with one line on stderr saying so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
from typing import Any, NoReturn

SOCKET_ENV = "DPTRAIN_WARM_SOCKET"
"""The warm server's Unix socket, set by the launcher (launch/warm.py) for its workers."""
PARENT_ENV = "DPTRAIN_WARM_PARENT_PID"
"""Set by the warm server in a forked worker's environment: its parent, the process whose death it follows
(launch/worker.py `die_with_launcher`)."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
"""The signals this process passes on to the worker it stands for."""
HEADER = struct.Struct("!I")
"""A message: its length (4 bytes, network order), then that many bytes of JSON."""
START_TIMEOUT_S = 120.0
"""How long to wait for the server to fork the worker (it may still be importing torch, slowly under load)."""


def signal_state() -> dict[str, str]:
    """This process's signal dispositions as a fresh interpreter set them up: "ign" (inherited ignored),
    "int" (Python's KeyboardInterrupt handler), "dfl"."""
    state = {}
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if handler == signal.SIG_IGN:
            state[str(int(sig))] = "ign"
        elif handler is signal.default_int_handler:
            state[str(int(sig))] = "int"
        elif handler == signal.SIG_DFL:
            state[str(int(sig))] = "dfl"
    return state


def unbuffered() -> bool:
    """Whether this interpreter runs with -u (torchrun starts workers so)."""
    return bool(getattr(sys.stdout, "write_through", False))


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [HEADER.pack(len(data))], fds)
        sock.sendall(data)
    else:
        sock.sendall(HEADER.pack(len(data)) + data)


def read_exact(sock: socket.socket, n: int) -> bytes:
    """n bytes from `sock`; fewer only at EOF."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_message(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None at EOF."""
    head = read_exact(sock, HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    data = read_exact(sock, n)
    return json.loads(data) if len(data) == n else None


class Forwarder:
    """Catches `FORWARDED` and sends each to the worker once its pid is known (those caught before, then)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        for sig in FORWARDED:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.pid is None:
            self.pending.append(signum)
        else:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def started(self, pid: int) -> None:
        self.pid = pid
        for sig in self.pending:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def run_cold(argv: list[str], why: str, *, mask: set[int], pending: list[int]) -> NoReturn:
    """Run the worker in this process (exec), as torchrun would have: never lose a run to the warm path."""
    if pending:  # torchrun already asked the worker to stop: end as an unhandled first signal would
        die_by(pending[0], mask=mask)
    print(f"dptrain: {why}; starting this worker without it (cold)", file=sys.stderr, flush=True)
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)  # exec resets handlers anyway; no window with ours
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    flags = ["-u"] if unbuffered() else []
    os.execv(sys.executable, [sys.executable, *flags, "-m", *argv])


def die_by(sig: int, *, mask: set[int]) -> NoReturn:
    """End this process killed by `sig`, as the worker was (torchrun reads the same status)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask - {sig})
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default action does not end the process


def main(argv: list[str]) -> None:
    if not argv:
        print("usage: python -m dptrain.launch.warm_client MODULE [ARGS...]", file=sys.stderr)
        os._exit(2)
    state = signal_state()  # before this process installs its own handlers
    mask = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    path = os.environ.get(SOCKET_ENV)
    if not path:
        run_cold(argv, f"no warm server ({SOCKET_ENV} is not set)", mask=mask, pending=[])
    forward = Forwarder()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # the worker gets the mask it had; this process forwards
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "signals": state, "mask": sorted(mask),
               "unbuffered": unbuffered(), "executable": sys.executable}
    try:
        sock.settimeout(START_TIMEOUT_S)
        sock.connect(path)
        send_message(sock, request, [0, 1, 2])
        reply = read_message(sock)
    except OSError as e:
        sock.close()
        run_cold(argv, f"the warm server at {path} did not answer ({e})", mask=mask, pending=forward.pending)
    if reply is None or "pid" not in reply:
        sock.close()
        why = reply.get("refused", "?") if reply else "it closed the connection"
        run_cold(argv, f"the warm server at {path} did not start the worker: {why}", mask=mask,
                 pending=forward.pending)
    forward.started(int(reply["pid"]))
    sock.settimeout(None)
    try:
        status = read_message(sock)
    except OSError:
        status = None
    if status is None:  # the server is gone (its launcher died, or it crashed): the worker got SIGTERM from it
        print("dptrain: the warm server went away before this worker finished", file=sys.stderr, flush=True)
        os._exit(1)
    if "signal" in status:
        die_by(int(status["signal"]), mask=mask)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(status.get("exit", 1)))


if __name__ == "__main__":
    main(sys.argv[1:])
