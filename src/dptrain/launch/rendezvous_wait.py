"""Waiting at the rendezvous: a node's periodic line saying who is awaited (NodeWait), the port check made before
torchrun starts (check_rdzv_port: a port another program holds), and torchrun's rendezvous error as one line."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from dptrain.config import ConfigError, LaunchConfig
from dptrain.config.nodes import max_nodes, parse_rdzv_conf
from dptrain.config.resolve import parse_endpoint

EXIT_RENDEZVOUS = 2
"""The rendezvous did not complete (nobody hosts it, a node never came, its port is taken): one line, no worker ran."""
TORCH_JOIN_TIMEOUT_S = 600
"""torchrun's c10d join_timeout when launch.rdzv_conf sets none."""
RENDEZVOUS_GRACE_S = 5.0
"""How long past join_timeout the launcher waits for torchrun's own verdict before it gives its own."""
FIRST_WAIT_LINE_S = 5.0
"""When a node still waiting at the rendezvous first says who is awaited (then every DPTRAIN_WAIT_REPORT_S)."""


def rendezvous_failed(error: BaseException, cfg: LaunchConfig | None, args: Any) -> str:
    """torchrun's rendezvous error as one line: the endpoint, and who or what is missing."""
    # lazy: torch: only after torchrun ran
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    endpoint = cfg.rdzv_endpoint if cfg is not None else args.rdzv_endpoint
    where = f"the rendezvous at {endpoint} (job id {cfg.rdzv_id if cfg is not None else args.rdzv_id!r})"
    if isinstance(error, RendezvousTimeoutError):
        timeout = join_timeout_s(cfg)
        if cfg is not None:
            others = ", ".join(str(r) for r in range(max_nodes(cfg)) if r != cfg.node_rank)
            missing = (f"launch.nnodes={cfg.nnodes} needs the other node(s) (node_rank {others}) and they did not "
                       f"all join (this is node_rank {cfg.node_rank})")
        else:
            missing = f"--nnodes={args.nnodes}: not every node joined"
        return (f"{where} did not complete within join_timeout={timeout}s: {missing}. Start the same command on "
                "every node with the same rdzv_endpoint and rdzv_id, or raise join_timeout in launch.rdzv_conf")
    cause = error.__cause__ or error.__context__
    reason = (str(cause).strip().splitlines() or [""])[0] if cause is not None else str(error)
    if isinstance(error, RendezvousConnectionError):
        return (f"could not connect to the rendezvous store at {endpoint}: {reason or type(cause).__name__}. "
                "Start node_rank 0 first and check that this node reaches that host and port")
    return f"{where} failed: {type(error).__name__}: {reason or error}"


def join_timeout_s(cfg: LaunchConfig | None) -> int:
    """The c10d join_timeout torchrun applies: launch.rdzv_conf's, else torchrun's default."""
    if cfg is None:
        return TORCH_JOIN_TIMEOUT_S
    return parse_rdzv_conf(cfg.rdzv_conf).get("join_timeout", TORCH_JOIN_TIMEOUT_S)


def waiting_line(cfg: LaunchConfig, waited: float) -> str:
    """NodeWait's line: who is awaited, or, on a node other than node_rank 0 (which hosts the store), that nothing
    listens at the endpoint."""
    where = f"the rendezvous {cfg.rdzv_endpoint} (job id {cfg.rdzv_id!r})"
    if cfg.node_rank != 0 and cfg.rdzv_endpoint and refuses_connections(cfg.rdzv_endpoint):
        return (f"dptrain: waiting {waited:.0f}s: nothing listens at {where}: this is node_rank {cfg.node_rank}, and "
                "its connections are refused. Check launch.rdzv_endpoint on this node (the host and port node_rank 0 "
                "uses), or start node_rank 0")
    others = ", ".join(str(r) for r in range(max_nodes(cfg)) if r != cfg.node_rank)
    return (f"dptrain: waiting {waited:.0f}s at {where} for the other node(s) of launch.nnodes={cfg.nnodes}: this is "
            f"node_rank {cfg.node_rank}; node_rank(s) {others} have not all joined. Start the same command there with "
            "launch.node_rank set, the same rdzv_endpoint and rdzv_id")


def refuses_connections(endpoint: str) -> bool:
    """Whether a TCP connection to `endpoint` is refused right now (nothing listens there)."""
    host, port = parse_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # unreachable, timed out, unresolvable: not a plain refusal
        return False


def port_holder(endpoint: str, *, any_program: bool = False) -> str | None:
    """Who listens on the endpoint's port on this machine when it is not this process (a program
    that is not torchrun's store), as 'pid N (command)'; None when nobody or this process does, or
    when the host is not this machine. A dptrain or torchrun launcher counts as a store unless
    `any_program` (the endpoint was seen not to answer as one)."""
    import psutil

    host, port = parse_endpoint(endpoint)
    try:
        addrs = {ipaddress.ip_address(a[4][0]) for a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        local = {ipaddress.ip_address(a.address) for nics in psutil.net_if_addrs().values() for a in nics
                 if a.family in (socket.AF_INET, socket.AF_INET6) and "%" not in a.address}
    except (OSError, ValueError):
        return None
    if not any(a.is_loopback or a in local for a in addrs):
        return None
    try:
        listeners = [c for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    except psutil.Error:
        return None
    for c in listeners:
        if c.pid == os.getpid():
            return None
    for c in listeners:
        if c.pid is None:
            return "another user's program"
        try:
            cmd = " ".join(psutil.Process(c.pid).cmdline()) or psutil.Process(c.pid).name()
        except psutil.Error:
            cmd = "?"
        if not any_program and ("dptrain" in cmd or "torch.distributed.run" in cmd or "torchrun" in cmd):
            return None  # another node's launcher on this machine: a real store
        return f"pid {c.pid} ({' '.join(cmd.split())[:120]})"
    if not listeners:  # bound without listening (connections are refused): our own bind tells
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return "a program on this machine that binds it without listening"
    return None


def check_rdzv_port(endpoint: str | None) -> None:
    """Refuse at once a rendezvous endpoint whose port on this machine another program holds (torchrun would
    connect to it as to a store and wait out its join timeout)."""
    holder = port_holder(endpoint) if endpoint else None
    if holder is not None:
        raise ConfigError(
            f"launch.rdzv_endpoint={endpoint!r}: its port is held by another program on this machine, {holder}, "
            "which is not a torch.distributed store; pick a free port for launch.rdzv_endpoint (the same on every "
            "node) or stop that program"
        )


class NodeWait:
    """While this node's workers have not started (torchrun is still waiting for the other nodes at
    the rendezvous), print a line after 5 s, then every `DPTRAIN_WAIT_REPORT_S` seconds (30), saying who is
    awaited; a node whose rendezvous endpoint refuses connections says that instead (a wrong port or host on
    this node, or node_rank 0 not started yet): torch's store client would retry for a minute in silence.
    torchrun ends a rendezvous that does not complete at join_timeout (RendezvousTimeoutError), but
    not one stuck connecting to a port that another program holds (its store client waits for an
    answer that never comes): join_timeout + RENDEZVOUS_GRACE_S after the start, with still no
    worker, this thread says so in one line and ends the launcher (exit 2)."""

    def __init__(self, cfg: LaunchConfig, *, abandon: Callable[[], None] | None = None,
                 ignore: set[int] | None = None) -> None:
        self.cfg, self.abandon, self.ignore = cfg, abandon, ignore or set()
        self.every = float(os.environ.get("DPTRAIN_WAIT_REPORT_S", "30"))
        self.deadline_s = join_timeout_s(cfg) + RENDEZVOUS_GRACE_S
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        threading.Thread(target=self._loop, name="dptrain-node-wait", daemon=True).start()

    def _loop(self) -> None:
        import psutil

        me = psutil.Process()
        next_line = min(FIRST_WAIT_LINE_S, self.every)
        while not self._stop.wait(min(1.0, self.every)):
            if {c.pid for c in me.children()} - self.ignore:  # the rendezvous completed: the workers are running
                return
            waited = time.monotonic() - self._t0
            if waited >= self.deadline_s:
                self._give_up(waited)
            if waited < next_line:
                continue
            next_line = waited + self.every
            print(waiting_line(self.cfg, waited), file=sys.stderr, flush=True)

    def _give_up(self, waited: float) -> None:
        endpoint = self.cfg.rdzv_endpoint or "?"
        holder = port_holder(endpoint) if self.cfg.rdzv_endpoint else None
        if holder is not None:
            why = (f"its port is held by another program, {holder}, which is not a torch.distributed store; pick a "
                   "free port for launch.rdzv_endpoint (the same on every node) or stop that program")
        else:
            why = ("no rendezvous store answered there; start node_rank 0 first and check that this node reaches "
                   "that host and port")
        if self._stop.is_set():
            return
        print(f"dptrain: error: the rendezvous at {endpoint} (job id {self.cfg.rdzv_id!r}) did not start within "
              f"{waited:.0f}s (join_timeout={join_timeout_s(self.cfg)}s): {why}", file=sys.stderr, flush=True)
        if self.abandon is not None:
            with contextlib.suppress(Exception):
                self.abandon()
        sys.stdout.flush()
        os._exit(EXIT_RENDEZVOUS)  # the main thread is inside torchrun's store client (C++): nothing else ends it

    def stop(self) -> None:
        self._stop.set()
