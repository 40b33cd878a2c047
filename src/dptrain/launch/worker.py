"""The process torchrun starts on every rank:
`python -m dptrain.launch.worker RUN_DIR [--resume X] [--trust-checkpoint]`.

The launcher has already resolved and validated the config and written it to `--config` (RUN_DIR/
config.pending.yaml); rank 0 writes RUN_DIR/config.yaml once the run has trained its first step.
Exit codes (a final stop exits 0 under a dptrain launcher, with a final exit mark carrying its code: see `final`):
0 done, 130 interrupted (Ctrl-C) and 143 preempted (SIGTERM), both with a checkpoint of the last
finished step committed; 2 a ConfigError only the run could find (e.g. a loss that is not a scalar); 4 stopped
by `diagnostics.nonfinite` (error, or too many consecutive skips; recorded in diagnostics.jsonl); 1 any other failure,
with one line instead of a traceback when this rank only lost a peer (the rank that died is the root cause).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import psutil

from dptrain.distributed.exit_marks import clear_exit_mark, mark_exit
from dptrain.launch.culprit import PEER_LOST_ERRORS, PEER_LOST_MARK
from dptrain.launch.warm_client import PARENT_ENV

EXIT_INTERRUPTED = 130  # = dptrain.checkpoint.preempt.EXIT_INTERRUPTED (not imported: it imports torch)
EXIT_PREEMPTED = 143
EXIT_NONFINITE = 4
"""diagnostics.nonfinite stopped the run (the launcher maps it, launch/torchrun.py)."""
PEER_LOST_GRACE_S = 10.0
"""How long a rank that only lost a peer on its own node waits before it exits (its agent ends it sooner)."""
REMOTE_PEER_LOST_GRACE_S = 2.0
"""The same wait when the peer was on another node. This node's agent never sees that rank die, so the wait only
gives the other node's agent time to re-join the rendezvous (then this agent stops the worker without spending one of
its restarts); a node that is gone never re-joins, and waiting longer only delays the survivors' new group."""
LAUNCHER_PID = "DPTRAIN_LAUNCHER_PID"
"""Set by the launcher (launch/torchrun.py) for its workers: the process whose death they must follow."""
ORPHAN_STUCK_S = 2.0
"""How long a user's script (`dptrain launch`) whose launcher is gone may stay at one point of its code (a
collective that can no longer complete) before it ends itself."""
ORPHAN_MAX_S = 10.0
"""The most such a script outlives its launcher while it still moves (a SIGTERM handler saving its last step)."""


def die_with_launcher() -> None:
    """No orphans: when the launcher dies, whatever killed it (SIGKILL, an OOM kill, a closed SSH
    session), the kernel sends this worker SIGTERM (Linux's parent-death signal), and the run's
    preemption handling saves the last finished step on every rank and exits 143. A launcher that
    died before this call is noticed at once: the worker exits without training. A worker forked by a warm server
    (launch/warm_server.py) follows that server instead, which itself dies with the launcher."""
    expected = os.environ.get(PARENT_ENV) or os.environ.get(LAUNCHER_PID)
    if expected is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(expected):  # the launcher is already gone: nobody would watch this worker
        os.write(2, b"dptrain: the launcher is gone before this worker started; exiting\n")
        os._exit(EXIT_PREEMPTED)


def exit_when_orphaned(*, stuck_s: float = ORPHAN_STUCK_S, max_s: float = ORPHAN_MAX_S,
                       poll_s: float = 0.25) -> threading.Thread | None:
    """A user's script under `dptrain launch` never outlives its launcher by more than a few seconds: the
    parent-death signal (SIGTERM, as `die_with_launcher`) ends a script that keeps SIGTERM's default at once, and a
    daemon thread ends one whose handler cannot run or does not finish (the main thread blocked in a collective
    that will never complete): once the launcher is gone, when the main thread has stayed at one point of its code
    for `stuck_s`, or has kept moving for `max_s`, the process exits (143) with one line saying where it stood. The
    thread (None without a dptrain launcher) polls os.getppid(), which works while the main thread holds no GIL
    in a collective."""
    expected = os.environ.get(LAUNCHER_PID)
    if expected is None or not expected.isdigit():
        return None
    die_with_launcher()
    watch = threading.Thread(target=_follow, args=(int(expected), stuck_s, max_s, poll_s), daemon=True,
                             name="dptrain-launcher-watch")
    watch.start()
    return watch


def _follow(launcher: int, stuck_s: float, max_s: float, poll_s: float) -> None:
    while os.getppid() == launcher:
        time.sleep(poll_s)
    gone = moved = time.monotonic()
    where = _main_position()
    while True:
        time.sleep(poll_s)
        now, here = time.monotonic(), _main_position()
        if here != where:
            where, moved = here, now
        if now - moved >= stuck_s or now - gone >= max_s:
            break
    why = (f"stuck at {where[0]}:{where[1]} for {now - moved:.0f}s" if now - moved >= stuck_s
           else f"still running {max_s:.0f}s later")
    with contextlib.suppress(OSError):  # the launcher's end of a pipe may be gone with it
        os.write(2, f"dptrain: rank {os.environ.get('RANK', '?')}: the launcher (pid {launcher}) is gone and this "
                    f"worker is {why}; exiting\n".encode())
    os._exit(EXIT_PREEMPTED)


def _main_position() -> tuple[str, int, int]:
    """Where the main thread is: file, line and instruction of its innermost frame (('?', 0, 0) when it ended)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return ("?", 0, 0)
    return (frame.f_code.co_filename, frame.f_lineno or 0, frame.f_lasti)


def main(argv: list[str] | None = None, *, keep: list | None = None) -> int:
    """Train the run in RUN_DIR on this rank; the exit code. `keep` receives the Trainer so that the
    caller decides when it (and the process groups its model holds) is destroyed."""
    p = argparse.ArgumentParser(prog="python -m dptrain.launch.worker")
    p.add_argument("run_dir")
    p.add_argument("--config", help="the config to run (default: RUN_DIR/config.yaml)")
    p.add_argument("--resume", default="auto")
    p.add_argument("--trust-checkpoint", action="store_true")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    run_dir = Path(args.run_dir)
    clear_exit_mark()  # an earlier attempt's, under launch.max_restarts
    if os.environ.get("RANK", "0") == "0":  # rank 0's console, copied to RUN_DIR/console.log
        # lazy: torch: after the SIGINT handler is installed (main)
        from dptrain.metrics.console_log import console_log

        with console_log(run_dir):
            return _train(args, run_dir, keep=keep)
    return _train(args, run_dir, keep=keep)


def _train(args: argparse.Namespace, run_dir: Path, *, keep: list | None) -> int:
    # lazy: torch: after the SIGINT handler is installed (main)
    from dptrain.checkpoint.manifest import CheckpointError
    from dptrain.checkpoint.preempt import EXIT_PREEMPTED
    from dptrain.checkpoint.rundir import RunDirLock
    from dptrain.config import ConfigError
    from dptrain.config.load import load_config
    from dptrain.config.nodes import is_elastic, max_nodes
    from dptrain.diagnostics.nonfinite import NonFiniteError
    from dptrain.launch.elastic import worker_config
    from dptrain.train.trainer import Trainer

    cfg = load_config(Path(args.config) if args.config else run_dir / "config.yaml")
    # A shared hold on the run directory for as long as this process lives: a second job is refused
    # even after the launcher died, until this worker has saved and exited (checkpoint/rundir.py).
    RunDirLock(run_dir, per_host=max_nodes(cfg.launch) > 1).hold_shared()
    if is_elastic(cfg.launch) and "WORLD_SIZE" in os.environ:  # the group torchrun formed may be smaller or larger
        try:
            cfg = worker_config(
                cfg,
                run_dir=run_dir,
                world_size=int(os.environ["WORLD_SIZE"]),
                rank=int(os.environ.get("RANK", "0")),
                attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            )
        except ConfigError as e:
            if os.environ.get("RANK", "0") == "0":
                print(f"dptrain: error: {e}", file=sys.stderr)
            return 2
    trainer = Trainer(cfg, out_dir=run_dir, resume=args.resume, trust_checkpoint=args.trust_checkpoint)
    if keep is not None:
        keep.append(trainer)
    try:
        summary = trainer.fit()
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler was installed (during setup)
        if trainer.env.is_main:
            print("dptrain: interrupted (Ctrl-C) before training started: nothing to save", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ConfigError, CheckpointError) as e:  # bad input only the run could find (a checkpoint written for
        # another model config, or by a newer format): one clean line, exit 2
        trainer.ckpt.record_error(traceback.format_exc())
        if trainer.env.is_main:
            print(f"dptrain: error: {e}", file=sys.stderr)
        return final(2, "bad input")
    except NonFiniteError as e:  # the policy's report: recorded in diagnostics.jsonl, one line, exit 4
        trainer.ckpt.record_error(f"NonFiniteError: {e}")
        if trainer.env.is_main:
            print(f"dptrain: stopped: {e}; recorded in {run_dir / 'diagnostics.jsonl'}", file=sys.stderr)
        return final(EXIT_NONFINITE, "non-finite policy", detail=str(run_dir / "diagnostics.jsonl"))
    except Exception as e:
        full = trainer.ckpt.disk_full_line(e)
        if full is not None:  # a record (metrics, config.yaml, final weights) did not fit: one line, exit 2
            trainer.ckpt.record_error(traceback.format_exc())
            print(f"dptrain: error: rank {trainer.env.rank}: {full}", file=sys.stderr, flush=True)
            return final(2, "disk full")
        if peer_lost(e):  # another rank died (its own failure is the root cause): one line, not a traceback
            line = f"{type(e).__name__}: {first_line(e)}"
            trainer.ckpt.record_error(f"lost a peer rank: {line}")
            print(f"dptrain: rank {trainer.env.rank}: lost a peer rank during step {trainer.state.step + 1} ({line})",
                  file=sys.stderr)
            mark_exit(1, PEER_LOST_MARK)  # a victim: never named as the root cause (launch/culprit.py)
            # Let the rank that failed be the first failure torchrun observes (its report names the root
            # cause by time): torchrun stops this one as soon as it sees that rank gone.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nothing left to save: torchrun's stop ends the wait
            if not getattr(trainer.ckpt.preemption, "received", False):  # a stop that came first: no wait
                time.sleep(REMOTE_PEER_LOST_GRACE_S if peer_is_remote(e) else PEER_LOST_GRACE_S)
            return 1
        trainer.ckpt.record_error(traceback.format_exc())  # for the restart report (attempts.jsonl)
        raise
    except BaseException:
        trainer.ckpt.record_error(traceback.format_exc())
        raise
    if summary.get("preempted"):
        return EXIT_INTERRUPTED if summary.get("interrupted") else EXIT_PREEMPTED
    return 0


def final(code: int, reason: str, *, detail: str = "") -> int:
    """This worker's exit status for a stop that a restart would only repeat (bad input, the non-finite policy):
    under a dptrain launcher, 0 with a final exit mark (torchrun restarts failed workers under
    launch.max_restarts; the launcher then exits with `code`); `code` itself elsewhere."""
    return 0 if mark_exit(code, reason, detail=detail, final=True) else code


def peer_lost(error: BaseException) -> bool:
    """Whether `error` is a collective failing because another rank's process is gone (the messages the launcher
    also takes for a victim's: launch/culprit.py PEER_LOST_ERRORS)."""
    return isinstance(error, RuntimeError) and PEER_LOST_ERRORS.search(str(error)) is not None


def peer_is_remote(error: BaseException) -> bool:
    """Whether the peer gloo names in `error` ("Connection closed by peer [10.0.0.2]:28363") is on another host:
    its address is none of this host's. False when the message names no address."""
    addrs = {a for a in re.findall(r"\[([0-9A-Fa-f:.]+)\]:\d+", str(error)) if valid_ip(a)}
    if not addrs:
        return False
    try:
        local = {a.address.split("%")[0] for nics in psutil.net_if_addrs().values() for a in nics}
    except (OSError, psutil.Error):
        return False
    return not any(ipaddress.ip_address(a).is_loopback or a in local for a in addrs)


def valid_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def first_line(error: BaseException) -> str:
    """The error's message without the C++ call sites gloo appends ("...: Connection closed by peer ...")."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    callback = "Got the following error when running the callback: "
    while line.startswith(callback):  # DDP's comm hook wraps the error once per future: "...: RuntimeError: ..."
        line = line.removeprefix(callback)
        name, sep, rest = line.partition(": ")
        if sep and name.isidentifier():
            line = rest
    return line[:300]


def _interrupted_during_setup(signum: int, frame: object) -> None:
    """Ctrl-C before the run's own handler exists (importing torch, building): nothing to save yet."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, b"dptrain: interrupted (Ctrl-C) before training started: nothing to save\n")
    os._exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted_during_setup)  # until the checkpoint manager installs its own
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # the launcher starts its workers with it blocked
    die_with_launcher()
    # Under `record` (imported after the handler above: it imports torch), an uncaught exception also
    # goes to torchrun's error file (TORCHELASTIC_ERROR_FILE): torchrun's failure report shows its traceback.
    from torch.distributed.elastic.multiprocessing.errors import record

    _trainer: list = []
    code = record(main)(keep=_trainer) or 0
    # Everything is written and the process group destroyed; skip the interpreter's teardown. Freeing a
    # DDP model there drops the last reference to its gloo process group, whose destructor joins a
    # worker thread that may be waiting for the GIL (seen as a hang of a finished rank under load).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
