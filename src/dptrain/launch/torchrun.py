"""Turning a config into torchrun arguments, and running torchrun (`torch.distributed.run`).

dptrain never spawns workers itself: `run_torchrun` hands an argv to PyTorch's elastic agent.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import ipaddress
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dptrain.config import ConfigError, LaunchConfig
from dptrain.config.nodes import max_nodes, node_range, parse_rdzv_conf, rdzv_settings, torchrun_nnodes
from dptrain.config.resolve import parse_endpoint
from dptrain.distributed.exit_marks import EXIT_MARKS_ENV, final_status, read_exit_marks
from dptrain.distributed.flight_recorder import enable_by_default
from dptrain.launch.culprit import Mismatch, mismatch_in, name_root_cause
from dptrain.launch.interrupts import EARLY, CtrlC, last_saved, workers_start_with_sigint_blocked
from dptrain.launch.oom import oom_counts, oom_kill_line, uptime_s
from dptrain.launch.rdzv_probe import SilentStoreWatch
from dptrain.launch.warm import WarmServer, client_command

EXIT_RENDEZVOUS = 2
"""The rendezvous did not complete (nobody hosts it, a node never came, its port is taken): one line, no worker ran."""
TORCH_JOIN_TIMEOUT_S = 600
"""torchrun's c10d join_timeout when launch.rdzv_conf sets none."""
RENDEZVOUS_GRACE_S = 5.0
"""How long past join_timeout the launcher waits for torchrun's own verdict before it gives its own."""
FIRST_WAIT_LINE_S = 5.0
"""When a node still waiting at the rendezvous first says who is awaited (then every DPTRAIN_WAIT_REPORT_S)."""

# torchrun with gloo cannot re-rendezvous after a worker dies while the agent shares its TCP
# store with the workers (pytorch#135712); a separate store per restart round makes it work.
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_args(cfg: LaunchConfig, *, nproc_per_node: int, module: str, module_args: list[str]) -> list[str]:
    """The torchrun argv that runs `python -m module module_args...` on every worker."""

    args = ["--nproc-per-node", str(nproc_per_node), "--nnodes", torchrun_nnodes(cfg)]
    if node_range(cfg.nnodes) == (1, 1) and cfg.rdzv_endpoint is None:
        args.append("--standalone")  # picks a free local port; nothing to configure
    else:
        if cfg.rdzv_endpoint is None:
            raise ValueError(
                f"launch.nnodes={cfg.nnodes} needs launch.rdzv_endpoint=host:port (the node running rank 0)"
            )
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", cfg.rdzv_endpoint, "--rdzv-id", cfg.rdzv_id]
        args += ["--node-rank", str(cfg.node_rank)]
        conf = rdzv_settings(cfg)
        if conf:
            args += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())]
    args += ["--max-restarts", str(cfg.max_restarts)]
    return [*args, "--module", module, *module_args]


def describe_rendezvous(cfg: LaunchConfig) -> str:
    """The line the launcher prints before starting workers: where the rendezvous store listens."""
    where = (
        f"c10d rendezvous at {cfg.rdzv_endpoint} (job id {cfg.rdzv_id!r}, {cfg.nnodes} node(s))"
        if cfg.rdzv_endpoint
        else "standalone rendezvous on this node (torchrun picks a free port; rank 0 prints it)"
    )
    return (
        f"dptrain: {where}. torch.distributed's TCPStore is unauthenticated and listens on all interfaces: "
        "run only on a trusted network"
    )


def run_torchrun(
    argv: list[str],
    *,
    restarts: bool,
    ckpt_root: Path | None = None,
    launch_cfg: LaunchConfig | None = None,
    abandon: Callable[[], None] | None = None,
    own_workers: bool = True,
    warm: bool = False,
) -> int:
    """Run torchrun in this process; the exit code: 0 done, 1 a worker failed (after torchrun's
    failure report, root-cause rank first: host, exit code, error file, traceback; then dptrain's
    one-line list of failed ranks), 2 the workers refused their input, 3 the hang watchdog
    stopped the run, 4 diagnostics.nonfinite stopped it, 130 interrupted
    (Ctrl-C) and 143 preempted (SIGTERM), both with the last finished step checkpointed.
    `ckpt_root`: where the run's checkpoints go, to say what a second Ctrl-C leaves unsaved;
    `launch_cfg`: for the lines printed while other nodes are awaited. A rendezvous that does not complete
    (RendezvousError, or torchrun still stuck connecting join_timeout + RENDEZVOUS_GRACE_S after the start)
    ends with one line naming the endpoint and what is missing, exit 2; `abandon` is called before the
    launcher exits in the second case (torchrun cannot be unwound from there).
    `own_workers=False` (`dptrain launch`: the user's script): a failed run exits with the root-cause
    rank's own status ("your script exited with status N on rank R"); dptrain's meanings of 2/3/4/130/143
    apply only to ranks whose exit mark (distributed/exit_marks.py) says dptrain caused them.
    `warm`: the workers (a `--module`) are forked by a warm server that imported them ahead (launch/warm.py)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    # lazy: torch: the launcher imports it only to start workers
    from dptrain.checkpoint.preempt import EXIT_INTERRUPTED, EXIT_PREEMPTED
    from dptrain.diagnostics.watchdog import EXIT_HANG
    from dptrain.launch.worker import EXIT_NONFINITE

    if restarts:
        os.environ.update(RESTART_ENV)
    os.environ["DPTRAIN_LAUNCHER_PID"] = str(os.getpid())  # the workers die with this process (launch/worker.py)
    enable_by_default()  # every worker's collective ring, for the desync watchdog (a small one unless the user set it)
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun would pin every worker to 1 thread (with a warning); share the cores instead.
        value = option_value(torchrun_options(argv), "--nproc-per-node", "--nproc_per_node")
        nproc = int(value) if value and value.isdigit() else 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(nproc, 1)))
    if "--signals-to-handle" in _value_options():  # torchrun handles SIGINT itself unless told not to
        argv = ["--signals-to-handle", "SIGTERM,SIGHUP,SIGQUIT", *argv]
    args = get_args_parser().parse_args(argv)
    marks_dir = tempfile.mkdtemp(prefix="dptrain-exit-")  # the workers' exit marks: which statuses are dptrain's
    os.environ[EXIT_MARKS_ENV] = marks_dir
    EARLY.check()  # a Ctrl-C during the checks that something swallowed: no worker starts
    server = WarmServer.start() if warm and args.module else None  # with the environment the workers inherit
    if server is not None:
        args.training_script, args.training_script_args = client_command(args.training_script,
                                                                          args.training_script_args)
    interrupts = CtrlC(ckpt_root)
    oom_before, started_s = oom_counts(), uptime_s()  # the kernel's OOM kills so far: its kill, or a `kill -9`?
    waiting = (NodeWait(launch_cfg, abandon=abandon, ignore={server.pid} if server else set())
               if launch_cfg is not None and max_nodes(launch_cfg) > 1 else None)
    probe = (SilentStoreWatch(args.rdzv_endpoint, conf=args.rdzv_conf, abandon=abandon,
                              setting="launch.rdzv_endpoint" if launch_cfg is not None else "--rdzv-endpoint",
                              holder=functools.partial(port_holder, any_program=True),
                              ignore={server.pid} if server else set())
             if args.rdzv_backend == "c10d" and args.rdzv_endpoint and not args.standalone else None)
    try:
        with workers_start_with_sigint_blocked(interrupts) if own_workers else contextlib.nullcontext():
            run(args)
    except RendezvousError as e:
        print(f"dptrain: error: {rendezvous_failed(e, launch_cfg, args)}", file=sys.stderr)
        return EXIT_RENDEZVOUS
    except SignalException as e:  # torchrun itself got SIGTERM/SIGINT: workers were signalled and saved
        if e.sigval == signal.SIGINT:
            if interrupts.count == 1:
                print(
                    f"dptrain: interrupted (Ctrl-C): {last_saved(ckpt_root)}; run the same command to resume",
                    file=sys.stderr,
                )
            return EXIT_INTERRUPTED
        print(f"dptrain: stopped by signal {e.sigval.name}", file=sys.stderr)
        return EXIT_PREEMPTED
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        marks = read_exit_marks(marks_dir)  # which ranks' statuses dptrain chose (distributed/exit_marks.py)
        mismatch = mismatch_in(marks_dir)  # a collective called differently: the odd rank is the cause
        oom = oom_kill_line(e.failures, oom_before, since_s=started_s)
        if not own_workers:
            code = _script_failed(e, args, marks, mismatch)
            if oom is not None:
                print(f"dptrain: {oom}", file=sys.stderr)
            return code
        final = final_status(marks)
        if final is not None:  # a rank stopped for good (its line is above); the others only lost it
            return final
        if codes == {EXIT_PREEMPTED}:
            print("dptrain: preempted (SIGTERM): the last finished step is checkpointed", file=sys.stderr)
            return EXIT_PREEMPTED
        if codes == {EXIT_INTERRUPTED}:
            print(f"dptrain: interrupted (Ctrl-C): {last_saved(ckpt_root)}", file=sys.stderr)
            return EXIT_INTERRUPTED
        if codes == {2}:
            return 2  # the workers refused their input; rank 0 said why (one line, above)
        if EXIT_NONFINITE in codes and codes <= {EXIT_NONFINITE, -signal.SIGTERM, EXIT_PREEMPTED}:
            return EXIT_NONFINITE  # diagnostics.nonfinite stopped every rank; rank 0 said why (one line, above)
        failures = ", ".join(f"rank {rank} (exit {f.exitcode})" for rank, f in sorted(e.failures.items()))
        # a frozen rank is SIGKILLed by the watchdog; torchrun SIGTERMs ranks still leaving when the first exits
        if EXIT_HANG in codes and codes <= {EXIT_HANG, -signal.SIGKILL, -signal.SIGTERM}:
            report = next((m["detail"] for m in marks.values() if m.get("code") == EXIT_HANG and m.get("detail")),
                          "hang_report.txt in the run directory")
            print(f"dptrain: stopped by the hang watchdog: {failures}; see {report}", file=sys.stderr)
            return EXIT_HANG
        if args.module and args.training_script == "dptrain.launch.record_script" and args.training_script_args:
            e.name = args.training_script_args[0]  # the report's title names the user's script, not the shim
        # torchrun's own report first: the root-cause rank, host, exit code, error file, traceback
        name_root_cause(e, marks, cause=mismatch.odd[0] if mismatch else None)
        print(e.format_msg(), file=sys.stderr)
        print(f"dptrain: worker(s) failed: {failures}", file=sys.stderr)
        for line in (mismatch.line if mismatch else None, oom):
            if line is not None:
                print(f"dptrain: {line}", file=sys.stderr)
        return 1
    else:  # every worker exited 0; a final stop (bad input, the non-finite policy) said its status in a mark
        final = final_status(read_exit_marks(marks_dir))
        if final is not None:
            return final  # the workers said why (one line, above); torchrun did not restart them
    finally:
        interrupts.restore()
        if waiting is not None:
            waiting.stop()
        if probe is not None:
            probe.stop()
        if server is not None:
            server.stop()
        shutil.rmtree(marks_dir, ignore_errors=True)
        os.environ.pop(EXIT_MARKS_ENV, None)
    return 0


def _script_failed(e: Any, args: Any, marks: dict[int, dict[str, Any]], mismatch: Mismatch | None = None) -> int:
    """A user's script (`dptrain launch`) failed: the launcher exits with the root-cause rank's status (a signal N:
    128 + N, as a shell says). When that rank's exit mark says dptrain chose the status (the hang watchdog of an
    own loop: 3), one line says what dptrain did; otherwise torchrun's report, then one line naming the status as
    the script's own (and the other ranks'), and a last one naming the `mismatch` of a collective, if any."""
    root_rank, root = name_root_cause(e, marks, cause=mismatch.odd[0] if mismatch else None)
    mark = marks.get(root_rank, {})
    if mark.get("code") == root.exitcode and root.exitcode > 0:
        failures = ", ".join(f"rank {rank} (exit {f.exitcode})" for rank, f in sorted(e.failures.items()))
        detail = f"; see {mark['detail']}" if mark.get("detail") else ""
        print(f"dptrain: stopped by the {mark.get('reason', 'dptrain')}: {failures}{detail}", file=sys.stderr)
        return min(255, root.exitcode)
    if args.module and args.training_script == "dptrain.launch.record_script" and args.training_script_args:
        e.name = args.training_script_args[0]  # the report's title names the user's script, not the shim
    print(e.format_msg(), file=sys.stderr)

    def status(code: int) -> str:
        if code < 0 and -code in {s.value for s in signal.Signals}:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    others = [f"rank {r} {status(f.exitcode)}" for r, f in sorted(e.failures.items()) if r != root_rank]
    print(f"dptrain: your script {status(root.exitcode)} on rank {root_rank}"
          f"{' (then ' + '; '.join(others) + ')' if others else ''}", file=sys.stderr)
    if mismatch is not None:
        print(f"dptrain: {mismatch.line}", file=sys.stderr)
    return min(255, root.exitcode) if root.exitcode > 0 else 128 + (-root.exitcode or 1)


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


def user_script_args(argv: list[str], *, default_nproc: int) -> list[str]:
    """`dptrain launch` arguments with dptrain's defaults filled in: every local GPU (or 2 CPU
    workers) and a standalone rendezvous when the user named neither."""
    out = list(argv)
    opts = torchrun_options(out)
    extra: list[str] = []
    if not any(o.split("=")[0] in ("--nproc-per-node", "--nproc_per_node") for o in opts):
        extra += ["--nproc-per-node", str(default_nproc)]
    if not any(
        o.split("=")[0]
        in ("--rdzv-endpoint", "--rdzv_endpoint", "--standalone", "--master-addr", "--master_addr", "--nnodes")
        for o in opts
    ):
        extra.append("--standalone")
    return extra + out


def record_failures(argv: list[str]) -> list[str]:
    """Run a plain `.py` script through `dptrain.launch.record_script`, which records an uncaught exception
    in torchrun's error file (so the failure report holds the traceback). With -m/--module,
    --no-python or --run-path the user's command runs as given."""
    at = script_index(argv)
    opts = argv[:at]
    if (
        at == len(argv)
        or not argv[at].endswith(".py")
        or any(
            o.split("=")[0] in ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")
            for o in opts
        )
    ):
        return argv
    return [*opts, "--module", "dptrain.launch.record_script", *argv[at:]]


def script_index(argv: list[str]) -> int:
    """Where the script starts in `dptrain launch`'s arguments (len(argv) if there is none): the
    first argument that is neither an option nor the value of one of torchrun's options that take
    a value (read off torchrun's own parser)."""
    return next(
        (i for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or not _takes_value(argv[i - 1]))),
        len(argv),
    )


def torchrun_options(argv: list[str]) -> list[str]:
    """The torchrun options of `dptrain launch`'s arguments: everything before the script. The
    script's own arguments (its `--max-restarts`, `--nproc-per-node`) are never read as torchrun's."""
    return argv[: script_index(argv)]


def option_value(opts: list[str], *names: str) -> str | None:
    """The value of the last of `names` in `opts` (`--name value` or `--name=value`), or None."""
    value = None
    for i, a in enumerate(opts):
        name, eq, v = a.partition("=")
        if name in names:
            value = v if eq else (opts[i + 1] if i + 1 < len(opts) else "")
    return value


def _takes_value(opt: str) -> bool:
    """Whether torchrun's option `opt` consumes the next argument."""
    return opt in _value_options()


@functools.cache
def _value_options() -> frozenset[str]:
    """torchrun's options that take a value, read off torchrun's own parser (no copy to keep in step)."""
    from torch.distributed.run import get_args_parser

    return frozenset(o for a in get_args_parser()._actions if a.nargs != 0 for o in a.option_strings)
