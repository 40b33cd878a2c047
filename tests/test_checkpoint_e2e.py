"""End-to-end: `dptrain run` under torchrun, workers killed with real signals, resumed by the CLI.

A reference run goes uninterrupted; the others are killed (SIGKILL to a worker, SIGTERM to the job)
and must end with the same per-step losses (float.hex) and the same final weights (SHA-256).
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from dptrain.checkpoint import manifest as mf
from support.run_helpers import (
    dptrain,
    logged_steps,
    losses,
    start,
    wait_for_step,
    wait_training_again,
    weights,
    worker,
)


@pytest.fixture
def reference(slow_toy_reference: Path) -> Path:
    return slow_toy_reference  # conftest.py: one uninterrupted run, shared with the other end-to-end tests


@pytest.mark.timeout(150)
def test_sigkill_a_worker_elastic_restart_resumes_bit_identical(reference, tmp_path):
    out = tmp_path / "run"
    proc = start(out, flags=("--max-restarts", "1"))
    wait_for_step(proc, out, 12)
    victim = worker(proc, 1)
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    wait_training_again(proc, out, attempt=1)
    recovery_s = time.monotonic() - killed_at
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output[-3000:]
    report = json.loads((out / "attempts.jsonl").read_text())
    died = [f for f in report["failures"] if f["rank"] == 1]
    assert died and died[0]["step"] >= 12 and "without a Python error" in died[0]["cause"]
    assert "restart 1: attempt 0 failed" in output and "resumed from" in output
    assert losses(out) == losses(reference)
    assert weights(out) == weights(reference)
    print(f"\nSIGKILL of rank 1 at step >= 12: training again after {recovery_s:.2f}s")


@pytest.mark.timeout(150)
def test_sigterm_saves_the_current_step_exits_143_and_resumes_exactly(reference, tmp_path):
    out = tmp_path / "run"
    proc = start(out, "checkpoint.every_steps=0")  # only the preemption checkpoint
    wait_for_step(proc, out, 10)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 143, output[-3000:]
    saved = [mf.step_of(p) for p in mf.step_dirs(out / "checkpoints")]
    assert saved == [max(logged_steps(out))], "the preemption checkpoint must hold the last finished step"
    assert mf.inspect_dir(mf.step_dirs(out / "checkpoints")[0]).valid
    r = dptrain("run", "--out", str(out))  # the run directory's own config.yaml; resume auto
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"at step {saved[0]}" in r.stderr
    assert losses(out) == losses(reference)
    assert weights(out) == weights(reference)


@pytest.mark.timeout(150)
def test_restart_budget_is_honoured_exactly(tmp_path):
    out = tmp_path / "run"
    proc = start(out, "train.max_steps=200", flags=("--max-restarts", "1"))
    wait_for_step(proc, out, 8)
    worker(proc, 1).send_signal(signal.SIGKILL)
    wait_training_again(proc, out, attempt=1)
    worker(proc, 0).send_signal(signal.SIGKILL)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, output[-3000:]
    assert "worker(s) failed" in output  # dptrain's line, after torchrun's own report:
    root = output[output.index("Root Cause (first observed failure):"):]
    assert "rank      : 0 (local_rank: 0)" in root and "exitcode  : -9" in root and "SIGKILL" in root
    assert len((out / "attempts.jsonl").read_text().splitlines()) == 1  # one restart, no second
    attempts = {json.loads(p.read_text())["attempt"] for p in (out / "attempts").glob("rank*.json")}
    assert attempts == {1}
    assert max(logged_steps(out)) < 200


@pytest.mark.timeout(150)
def test_ckpt_commands_and_refusals_before_any_worker_starts(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    newest = mf.step_dirs(run / "checkpoints")[-1]
    r = dptrain("ckpt", "export", str(run), "--out", str(tmp_path / "m.safetensors"))
    assert r.returncode == 0, r.stderr
    exported, final = load_file(tmp_path / "m.safetensors"), load_file(run / "final" / "model.safetensors")
    assert exported.keys() == final.keys() and all((exported[k] == final[k]).all() for k in final)
    expected = mf.sha256_file(newest / "model.pt")
    data = bytearray((newest / "model.pt").read_bytes())
    data[-100] ^= 0xFF
    (newest / "model.pt").write_bytes(bytes(data))
    t0 = time.monotonic()
    r = dptrain("run", "train.max_steps=40", "--out", str(run), "--resume", str(newest))
    assert r.returncode == 2 and time.monotonic() - t0 < 30
    assert "model.pt" in r.stderr and expected in r.stderr and mf.sha256_file(newest / "model.pt") in r.stderr
    r = dptrain("ckpt", "verify", str(run))
    assert r.returncode == 1 and "CORRUPT" in r.stdout and "model.pt" in r.stdout
    r = dptrain("ckpt", "ls", str(run))
    assert r.returncode == 0 and "corrupt" in r.stdout and "committed" in r.stdout
    r = dptrain("run", "model.kwargs.hidden=64", "--out", str(run))
    assert r.returncode == 2 and "model.kwargs" in r.stderr and "another model" in r.stderr
