"""Turning a config into torchrun arguments, and running torchrun (`torch.distributed.run`).

dptrain never spawns workers itself: `run_torchrun` hands an argv to PyTorch's elastic agent.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dptrain.config import LaunchConfig
from dptrain.config.nodes import max_nodes, node_range, rdzv_settings, torchrun_nnodes
from dptrain.distributed.exit_marks import EXIT_MARKS_ENV, final_status, read_exit_marks
from dptrain.distributed.flight_recorder import enable_by_default
from dptrain.launch.culprit import Mismatch, mismatch_in, name_root_cause
from dptrain.launch.interrupts import EARLY, CtrlC, last_saved, workers_start_with_sigint_blocked
from dptrain.launch.oom import oom_counts, oom_kill_line, uptime_s
from dptrain.launch.rdzv_probe import SilentStoreWatch
from dptrain.launch.rendezvous_wait import EXIT_RENDEZVOUS, NodeWait, port_holder, rendezvous_failed
from dptrain.launch.warm import WarmServer, client_command

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
