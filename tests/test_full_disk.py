"""A full file system during a run (checkpoint/full_disk.py): one line naming the folder and the free space, the
half-written checkpoint removed, every committed checkpoint intact, and the same command resumes from the last one
once there is room. Real file systems: a small tmpfs mounted for the test (CI runs as root)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import dptrain
from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint.full_disk import CheckpointDiskFull
from support import ROOT, subprocess_env
from support.run_helpers import TOY_RUN


@pytest.fixture
def small_fs(tmp_path) -> Iterator[tuple[Path, object]]:
    """A tmpfs at tmp_path/fs and a function that resizes it (`grow("1m")`); unmounted at the end."""
    where = tmp_path / "fs"
    where.mkdir()

    def mount(size: str, *, remount: bool = False) -> None:
        opts = f"remount,size={size}" if remount else f"size={size}"
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
        if r.returncode != 0:
            if remount:
                raise AssertionError(f"remount failed: {r.stderr}")
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")

    mount("100k")
    try:
        yield where, lambda size: mount(size, remount=True)
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dptrain", "run", *TOY_RUN, "train.max_steps=20",
                           "checkpoint.every_steps=5", *extra, "--nproc-per-node", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=150, env=subprocess_env(), cwd=ROOT)


def committed(root: Path) -> list[Path]:
    return [i.path for i in mf.list_checkpoints(root) if i.valid] if root.is_dir() else []


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where", ["checkpoint.dir", "run directory"])
def test_a_full_disk_during_a_save_is_one_line_and_the_last_checkpoint_resumes(tmp_path, small_fs, where):
    fs, grow = small_fs
    out, ckpt_dir = (tmp_path / "run", fs / "ckpt") if where == "checkpoint.dir" else (fs / "run", fs / "run")
    root = ckpt_dir if where == "checkpoint.dir" else out / "checkpoints"
    extra = [f"checkpoint.dir={ckpt_dir}"] if where == "checkpoint.dir" else []
    total = "100.0 KiB" if where == "checkpoint.dir" else "160.0 KiB"  # room for a checkpoint (62 KiB) or two
    if where != "checkpoint.dir":
        grow("160k")
    r = run(out, *extra)
    output = r.stdout + r.stderr
    assert r.returncode == 2, output[-3000:]
    assert "Traceback" not in output and "enforce fail" not in output, output[-3000:]
    errors = [ln for ln in output.splitlines() if ln.startswith("dptrain: error:")]
    assert len(errors) == 1, output[-3000:]
    line = errors[0]
    assert "No space left on device" in line and f" free of {total} on the file system of " in line, line
    assert ("checkpoint.dir" in line) if "does not fit" in line else ("--out" in line), line
    kept = committed(root)
    assert [p.name for p in mf.step_dirs(root)] == [p.name for p in kept]  # no half-written folder left
    assert kept, output[-3000:]
    assert f"the last good checkpoint, {kept[-1]} (step {mf.step_of(kept[-1])}), is intact" in line, line
    print(line)
    grow("2m")
    again = run(out, *extra)  # the same command once there is room
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    if kept:
        assert f"resumed from {kept[-1]} at step {mf.step_of(kept[-1])}" in again.stderr, again.stderr[-3000:]
    assert mf.step_of(committed(root)[-1]) == 20


@pytest.mark.timeout(60)
def test_an_own_loop_save_on_a_full_disk_raises_one_clear_error_and_keeps_the_last_checkpoint(tmp_path, small_fs):
    fs, _ = small_fs
    torch.manual_seed(0)
    model = torch.nn.Linear(48, 48)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ckpt = dptrain.Checkpointer(fs, model, opt)
    saved = []
    with pytest.raises(CheckpointDiskFull) as e:
        for step in range(1, 10):
            model(torch.randn(2, 48)).sum().backward()
            opt.step()
            ckpt.save(step)
            saved.append(step)
    message = str(e.value)
    assert saved, "the tmpfs was meant to hold one checkpoint"
    last = fs / "checkpoints" / mf.step_dir_name(saved[-1])
    assert message.startswith(f"checkpoint {fs / 'checkpoints' / mf.step_dir_name(saved[-1] + 1)} does not fit: "
                              "No space left on device;"), message
    assert f"the last good checkpoint, {last} (step {saved[-1]}), is intact" in message, message
    assert [p.name for p in mf.step_dirs(fs / "checkpoints")] == [p.name for p in committed(fs / "checkpoints")]
    model2 = torch.nn.Linear(48, 48)
    assert dptrain.Checkpointer(fs, model2, torch.optim.Adam(model2.parameters(), lr=0.1)).resume() == saved[-1]


@pytest.mark.timeout(120)
def test_a_run_directory_too_full_for_its_records_ends_in_one_line_without_a_traceback(tmp_path, small_fs):
    fs, grow = small_fs
    grow("20k")  # the launcher's files fit; config.yaml, metrics and console.log soon do not
    r = run(fs / "run", f"checkpoint.dir={tmp_path / 'ckpt'}")
    output = r.stdout + r.stderr
    assert r.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [ln for ln in output.splitlines() if ln.startswith("dptrain: error:")]
    assert len(errors) == 1, output[-3000:]
    assert "could not write" in errors[0] and "No space left on device" in errors[0] and "--out" in errors[0], errors
