"""A run directory has one owner and loses nothing (issue 26): workers die with their launcher,
whatever kills it; a second job is refused while the first (or its orphans) still writes; a
continue whose every checkpoint is unusable is refused, leaving the folders untouched.

Each `dptrain run` is the real command (torchrun, 2 gloo workers) on the toy MLP.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dptrain.checkpoint import manifest as mf
from support import ROOT, subprocess_env
from support.run_helpers import workers_of

TOY = ["model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
       "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
       "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every_steps=1",
       "train.eval_every_steps=0", "log.progress=false"]
ENV = subprocess_env(tests=False)


def command(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "dptrain", "run", *TOY, *overrides, "--nproc-per-node", "2", "--out", str(out)]


def run(out: Path, *overrides: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(command(out, *overrides), env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def losses(run_dir: Path) -> list[tuple[int, str]]:
    """(step, loss as float.hex) of every whole record; a line still being written by a live run is skipped."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in rec:
            out.append((rec["step"], float.hex(rec["loss"])))
    return out


def weights(run_dir: Path) -> str:
    return hashlib.sha256((run_dir / "final" / "model.safetensors").read_bytes()).hexdigest()


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and any(s >= step for s, _ in losses(run_dir)):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {timeout} s")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_launcher_sigkilled_workers_stop_saving_the_step_and_the_same_command_resumes_bit_identically(tmp_path):
    steps = ["train.max_steps=40", "checkpoint.every_steps=1000"]  # only the parent-death save checkpoints
    reference = tmp_path / "reference"
    r = run(reference, *steps)
    assert r.returncode == 0, r.stderr[-3000:]

    out = tmp_path / "run"
    proc = subprocess.Popen(command(out, *steps), env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for_step(out, 5, proc)
    assert len(workers_of(out)) == 2
    os.kill(proc.pid, signal.SIGKILL)  # an OOM kill, kill -9, a closed SSH session
    proc.wait(timeout=30)
    t0 = time.monotonic()
    while workers_of(out) and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    gone_after = time.monotonic() - t0
    assert not workers_of(out), "orphaned workers still run after their launcher was killed"
    assert gone_after < 10, f"workers took {gone_after:.1f} s to stop"
    saved = [mf.step_of(p) for p in mf.step_dirs(out / "checkpoints")]
    assert saved and mf.inspect_dir(mf.step_dirs(out / "checkpoints")[-1]).valid  # they saved on the way out
    r = run(out, *steps)  # the same command, at once: the directory is free again
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{saved[-1]:06d}'} at step {saved[-1]}" in r.stderr, r.stderr
    assert losses(out) == losses(reference)
    assert weights(out) == weights(reference)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_job_in_a_live_run_directory_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(command(out, "train.max_steps=100000", "checkpoint.every_steps=0"), env=ENV, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for_step(out, 2, first)
        metrics_before = (out / "metrics.jsonl").stat().st_size
        second = run(out, "train.max_steps=100000", timeout=60)
        assert second.returncode == 2, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        assert f"is in use by another dptrain job (launcher pid {first.pid} on host" in second.stderr, second.stderr
        assert (out / "metrics.jsonl").stat().st_size >= metrics_before  # the first run's records go on
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=120)
    assert first.returncode == 143  # preempted: it saved and stopped


def _tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.timeout(300)
def test_a_continue_whose_every_checkpoint_is_corrupt_is_refused_and_touches_nothing(tmp_path):
    out = tmp_path / "run"
    r = run(out, "train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=null")
    assert r.returncode == 0, r.stderr[-3000:]
    folders = mf.step_dirs(out / "checkpoints")
    damage = [
        lambda d: _flip(d / "model.pt"),
        lambda d: (d / "optim.pt").write_bytes((d / "optim.pt").read_bytes()[:64]),
        lambda d: (d / "stray.bin").write_bytes(b"x"),
    ]
    for d, spoil in zip(folders, damage, strict=True):  # a flipped byte, a truncated file, a stray file
        spoil(d)
    before = _tree_hashes(out / "checkpoints")
    r = run(out, "train.max_steps=12")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "no checkpoint to continue from, every checkpoint folder is unusable" in r.stderr
    for d in folders:
        assert f"{d}: corrupt" in r.stderr  # each folder named with its defect
    assert _tree_hashes(out / "checkpoints") == before  # nothing overwritten
    r = run(out, "train.max_steps=3", "--resume", "none")  # starting over moves them aside
    assert r.returncode == 0, r.stderr[-3000:]
    kept = out / "previous" / "1" / "checkpoints"
    assert _tree_hashes(kept) == before
    assert [s for s, _ in losses(out)] == [1, 2, 3]


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
