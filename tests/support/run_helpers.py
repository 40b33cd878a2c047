"""For tests that start the real `dptrain` command in a subprocess: the toy recipe as `dptrain run`
overrides, `dptrain(...)` run to completion or `start(...)`ed in the background, and what a run
directory is judged by (logged steps, losses as float.hex, final weights)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from support import ROOT, overrides, subprocess_env
from support import overrides as join

__all__ = ["ROOT", "SLOW_TOY", "TOY_RUN", "dptrain", "logged_steps", "losses", "start", "subprocess_env",
           "wait_for_step", "wait_training_again", "weights", "worker", "workers_of"]

TOY_RUN = [
    "model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
    "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every_steps=1", "train.eval_every_steps=0",
    "log.progress=false",
]
"""The tests' MLP on its regression data: 8 samples a step in micro-batches of 2, a log record every
step, no evaluation, no progress line."""


SLOW_TOY = [*TOY_RUN, "train.loss=support.slow_loss:slow_loss", "train.max_steps=30", "checkpoint.every_steps=5"]
"""TOY_RUN slowed (support/slow_loss.py) so a signal lands mid-run: 30 steps, a checkpoint every 5."""


def dptrain(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m dptrain ARGS` from the checkout, with its src/ and tests/ importable in every worker."""
    return subprocess.run([sys.executable, "-m", "dptrain", *overrides(args)], capture_output=True, text=True,
                          timeout=timeout, env={**subprocess_env(), **(env or {})}, cwd=ROOT)


def start(out: Path, *overrides: str, flags: tuple[str, ...] = ()) -> subprocess.Popen:
    argv = [sys.executable, "-m", "dptrain", "run", *join(SLOW_TOY, overrides), "--nproc-per-node", "2",
            "--out", str(out), *flags]
    return subprocess.Popen(argv,
                            env=subprocess_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def logged_steps(out: Path) -> list[int]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in lines if '"loss"' in line and line.endswith("}")]


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while max(logged_steps(out), default=0) < step:
        assert proc.poll() is None, f"run ended before step {step}: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout}s"
        time.sleep(0.005)


def worker(proc: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "dptrain.launch.worker" in " ".join(child.cmdline()) and child.environ().get("RANK") == str(rank):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker process of rank {rank}")


def workers_of(run_dir: Path) -> list[int]:
    """Pids of this run's worker processes, its launcher alive or not (their command line names the run directory)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"dptrain.launch.worker" in cmd and str(run_dir).encode() in cmd:
                out.append(int(p.name))
    return out


def wait_training_again(proc: subprocess.Popen, out: Path, *, attempt: int, timeout: float = 60) -> None:
    """Until every rank of restart `attempt` has finished a step."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the worker group did not train again"
        try:
            recs = [json.loads(p.read_text()) for p in (out / "attempts").glob("rank*.json")]
        except ValueError:
            recs = []
        if len(recs) == 2 and all(r["attempt"] == attempt and r["step"] is not None for r in recs):
            return
        time.sleep(0.005)


def losses(out: Path) -> list[tuple[int, str]]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], float.hex(r["loss"])) for r in recs if "loss" in r]


def weights(out: Path) -> bytes:
    return (out / "final" / "model.safetensors").read_bytes()
