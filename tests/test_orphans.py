"""Workers whose launcher was killed (SIGKILL): `dptrain launch` scripts end within seconds even when hung in a
collective (launch/worker.py `exit_when_orphaned`), and a `dptrain run` started again in that window describes the
killed launcher's workers as what they are, never the dead launcher as the run directory's owner
(checkpoint/rundir.py `RunDirLock`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from support import ROOT, subprocess_env
from support.run_helpers import start, wait_for_step

HUNG_SCRIPT = """
import os, signal, sys, time
import torch, torch.distributed as dist

if sys.argv[1] == "handler":  # a SIGTERM handler (a save at the next step) that a blocked main thread never runs
    signal.signal(signal.SIGTERM, lambda *a: print("SIGTERM handled", flush=True))
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
with open(os.path.join(sys.argv[2], f"rank{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
if rank == 0:
    dist.all_reduce(t)  # rank 1 skips it: rank 0 waits forever
time.sleep(3600)
"""


def release_file(launcher: int) -> Path:
    return Path(tempfile.gettempdir()) / f"dptrain-test-orphans-release-{launcher}"


def slow_once_orphaned(model, batch):
    """The toy's loss (after 0.02 s); once the launcher is gone, its steps wait (up to 30 s) for the test to
    release them: the killed launcher's workers are still there, saving, when the next command starts."""
    launcher = os.environ["DPTRAIN_LAUNCHER_PID"]
    deadline = time.monotonic() + 30
    time.sleep(0.02)
    while str(os.getppid()) != launcher and not release_file(int(launcher)).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return model(batch)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("handler", ["default", "handler"], ids=["sigterm-default", "sigterm-handler"])
def test_dptrain_launch_workers_hung_in_a_collective_end_seconds_after_a_sigkilled_launcher(tmp_path, handler):
    script = tmp_path / "hang.py"
    script.write_text(HUNG_SCRIPT)
    launcher = subprocess.Popen([sys.executable, "-m", "dptrain", "launch", "--nproc-per-node", "2", str(script),
                                 handler, str(tmp_path)], env=subprocess_env(), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pidfiles = [tmp_path / f"rank{r}.pid" for r in range(2)]
        wait_for(lambda: all(p.is_file() and p.read_text() for p in pidfiles), 60, "the workers did not start")
        workers = [psutil.Process(int(p.read_text())) for p in pidfiles]
        assert all(w.ppid() == launcher.pid for w in workers)  # torchrun's agent runs inside the launcher
        time.sleep(1.0)  # rank 0 is blocked in its all_reduce, rank 1 sleeps
        launcher.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        while any(running(w) for w in workers) and time.monotonic() - t0 < 15:
            time.sleep(0.02)
        took = time.monotonic() - t0
        alive = [w.pid for w in workers if running(w)]
        assert not alive, f"workers {alive} outlived their launcher by more than 15s"
        assert took < 10.0, f"the workers took {took:.1f}s to end after the launcher was killed"
        print(f"workers gone {took:.2f}s after the launcher's SIGKILL ({handler})")
        output = launcher.communicate(timeout=10)[0]
        if handler == "handler":  # the handlers ran (rank 1, asleep) or could not (rank 0, in its all_reduce)
            # whichever rank the thread ends first says so; the other may then fail in gloo, having lost its peer
            assert f": the launcher (pid {launcher.pid}) is gone and this worker is stuck at" in output, output
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in tmp_path.glob("rank*.pid"):  # before reading the output: a live worker holds the pipe open
            if p.read_text() and psutil.pid_exists(int(p.read_text())):
                os.kill(int(p.read_text()), signal.SIGKILL)
        launcher.communicate()


def running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(150)
def test_the_same_command_run_at_once_after_a_sigkilled_launcher_waits_for_its_saving_workers(tmp_path):
    out = tmp_path / "run"
    recipe = ("train.max_steps=40", "checkpoint.every_steps=1000", "train.loss=test_orphans:slow_once_orphaned")
    first = start(out, *recipe)  # only the parent-death save saves
    try:
        wait_for_step(first, out, 3)
        first.send_signal(signal.SIGKILL)  # its workers go on to the next step boundary, save and exit
        first.wait()
        second = start(out, *recipe)  # the same command, at once
        lines = []
        for line in second.stdout:  # until it says it waits for the workers (or it ends)
            lines.append(line)
            if "waiting for them to exit" in line:
                break
        release_file(first.pid).touch()  # the orphaned workers may finish their step, save and exit
        output = "".join(lines) + second.communicate(timeout=120)[0]
    finally:
        for proc in (first, *([second] if "second" in locals() else [])):
            if proc.poll() is None:
                proc.kill()
        release_file(first.pid).unlink(missing_ok=True)
    assert second.returncode == 0, output[-3000:]
    assert f"launcher pid {first.pid}" not in output, output  # never the dead launcher named as the owner
    line = next(ln for ln in output.splitlines() if "of a launcher that was killed" in ln)
    assert f"of a launcher that was killed (pid {first.pid}) are saving their last step (step " in line, line
    assert "waiting for them to exit" in line, line
    print(line)
    assert "they exited after" in output and "resumed from" in output, output[-3000:]

