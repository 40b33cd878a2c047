"""Nothing lost, nothing silent: Ctrl-C (one and two), re-running a run directory (finished, records
without a checkpoint, only corrupt checkpoints), a failed start followed by a corrected one, a
forward that returns a vector, a loss that is NaN from the first step, waiting for a missing node.

Each `dptrain run` here is the real command (torchrun, 2 gloo workers) on the toy MLP; the Ctrl-C
is a real SIGINT to the launcher's process group, as a terminal sends it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dptrain.checkpoint import manifest as mf
from support import ROOT
from support import overrides as join
from support.mp import find_free_port
from support.run_helpers import SLOW_TOY as TOY
from support.run_helpers import dptrain, logged_steps, losses, subprocess_env, wait_for_step, weights


def start(out: Path, *overrides: str) -> subprocess.Popen:
    """`dptrain run` in a process group of its own (a terminal's foreground job), stdout+stderr piped."""
    return subprocess.Popen([sys.executable, "-m", "dptrain", "run", *join(TOY, overrides), "--nproc-per-node", "2",
                             "--out", str(out)], env=subprocess_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def ctrl_c(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole foreground process group


@pytest.fixture
def reference(slow_toy_reference: Path) -> Path:
    return slow_toy_reference  # conftest.py: one uninterrupted run, shared with the other end-to-end tests


# ---------------------------------------------------------------------- Ctrl-C
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_saves_the_step_exits_130_without_tracebacks_and_resumes_bit_identical(reference, tmp_path):
    out = tmp_path / "run"
    proc = start(out, "checkpoint.every_steps=0")  # only the interrupt's checkpoint
    wait_for_step(proc, out, 8)
    ctrl_c(proc)
    output = proc.communicate(timeout=90)[0]
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert "Ctrl-C again aborts without saving" in output
    saved = [mf.step_of(p) for p in mf.step_dirs(out / "checkpoints")]
    assert saved == [max(logged_steps(out))], "the interrupt's checkpoint holds the last finished step"
    assert mf.inspect_dir(mf.step_dirs(out / "checkpoints")[0]).valid
    assert f"interrupted (Ctrl-C): the last committed checkpoint is {mf.step_dirs(out / 'checkpoints')[0]}" in output
    r = dptrain("run", "--out", str(out), timeout=150)  # the run directory's own config.yaml; resume auto
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(out) == losses(reference)
    assert weights(out) == weights(reference)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_second_ctrl_c_aborts_at_once_saying_what_was_not_saved(tmp_path):
    out = tmp_path / "run"
    proc = start(out, "checkpoint.every_steps=3", "train.max_steps=400")
    wait_for_step(proc, out, 4)
    while not any(mf.inspect_dir(p).valid for p in mf.step_dirs(out / "checkpoints")):
        time.sleep(0.01)
    ctrl_c(proc)
    time.sleep(0.05)
    ctrl_c(proc)
    t0 = time.monotonic()
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, output[-3000:]
    assert time.monotonic() - t0 < 20
    assert "second Ctrl-C: workers killed without saving; the last committed checkpoint is" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


# ---------------------------------------------------------------------- re-running a run directory
@pytest.mark.timeout(240)
def test_a_finished_run_rerun_changes_nothing_and_more_steps_continue(reference, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    r = dptrain("run", "--out", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "is a finished run" in r.stderr and "nothing was changed" in r.stderr, r.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # summary, metrics: untouched
    r = dptrain("run", "--out", str(run), "train.max_steps=33", timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "at step 30" in r.stderr
    assert [s for s, _ in losses(run)] == list(range(1, 34))
    assert losses(run)[:30] == losses(reference)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 33 and summary["final_loss"] is not None


@pytest.mark.timeout(120)
def test_records_without_a_checkpoint_are_refused_and_resume_none_keeps_them_aside(reference, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints")
    old_metrics = (run / "metrics.jsonl").read_bytes()
    r = dptrain("run", "--out", str(run))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "holds records of an earlier run (metrics.jsonl (30 records)" in r.stderr and "--resume none" in r.stderr
    assert (run / "metrics.jsonl").read_bytes() == old_metrics
    r = dptrain("run", *TOY, "train.max_steps=3", "--nproc-per-node", "2", "--out", str(run), "--resume", "none")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"were moved to {run / 'previous' / '1'}" in r.stderr
    assert (run / "previous" / "1" / "metrics.jsonl").read_bytes() == old_metrics  # kept, not deleted
    assert [s for s, _ in losses(run)] == [1, 2, 3]


@pytest.mark.timeout(120)
def test_explicit_resume_of_a_run_dir_whose_checkpoints_are_all_corrupt_is_exit_2(reference, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    folders = mf.step_dirs(run / "checkpoints")
    for d in folders:
        victim = next(p for p in sorted(d.iterdir()) if p.suffix in (".pt", ".safetensors"))
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    r = dptrain("run", *TOY, "--nproc-per-node", "2", "--out", str(tmp_path / "new"), "--resume", str(run))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "no valid checkpoint under" in r.stderr
    for d in folders:
        assert f"{d}: corrupt" in r.stderr  # every folder named, with why
    assert not (tmp_path / "new" / "metrics.jsonl").exists()


@pytest.mark.timeout(150)
def test_a_failed_start_leaves_no_config_and_the_corrected_command_runs(tmp_path):
    out = tmp_path / "run"
    # a loss that only the workers can judge: a per-sample vector
    loss = "train.loss=support.bad_losses:per_sample_loss"
    r = dptrain("run", *TOY, loss, "--nproc-per-node", "2", "--out", str(out))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "returned a loss of shape (2,), not a scalar" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("not a scalar") == 1  # one line, not one per rank
    assert not (out / "config.yaml").exists() and not (out / "config.pending.yaml").exists()
    r = dptrain("run", *TOY, "train.max_steps=3", "--nproc-per-node", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bad_losses" not in (out / "config.yaml").read_text()  # nothing inherited from the failed start


@pytest.mark.timeout(150)
def test_a_loss_that_is_nan_from_the_first_step_is_reported_loudly_with_nonfinite_off(tmp_path):
    """With no per-step check, a log step whose mean loss is NaN says so loudly and names the rank whose data went
    non-finite first (rank 1 at step 2), then the rank the averaged gradients spread it to (rank 0, step 3)."""
    out = tmp_path / "run"
    r = dptrain(
        "run",
        *TOY,
        "train.loss=support.bad_losses:nan_loss_on_rank_1_from_step_2",
        "train.micro_batch_size=4",  # no accumulation: a rank's n-th training micro-batch is step n's
        "train.max_steps=4",
        "train.log_every_steps=3",
        "diagnostics.nonfinite=off",
        "--nproc-per-node",
        "2",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    line = "WARNING: the loss is nan at step 3, mean of the last 3 step(s) over the data-parallel ranks"
    origin = ", first from the data of rank(s) 1 at step 2; then rank 0 (step 3);"
    assert line + origin in r.stderr, r.stderr[-3000:]  # log.progress=false: on stderr
    diag = [json.loads(line) for line in (out / "diagnostics.jsonl").read_text().splitlines()]
    found = [(d["step"], d["first_step"]) for d in diag if d["kind"] == "nonfinite_loss"]
    assert found == [(3, {"1": 2, "0": 3}), (4, {"0": 4, "1": 4})]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nonfinite_loss"] == {"first_step": 3, "log_steps": 2}


# ---------------------------------------------------------------------- waiting for other nodes
@pytest.mark.timeout(120)
def test_waiting_for_a_node_that_never_arrives_says_who_is_awaited(tmp_path):

    port = find_free_port()
    env = {**subprocess_env(), "DPTRAIN_WAIT_REPORT_S": "2"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dptrain",
            "run",
            *TOY,
            "--nproc-per-node",
            "1",
            "launch.nnodes=2",
            "launch.node_rank=0",
            f"launch.rdzv_endpoint=127.0.0.1:{port}",
            "--out",
            str(tmp_path / "r"),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + 90
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "for the other node(s)" in line or time.monotonic() > deadline:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    said = "".join(lines)
    assert (
        "for the other node(s) of launch.nnodes=2: this is node_rank 0; node_rank(s) 1 have not all joined" in said
    ), said
