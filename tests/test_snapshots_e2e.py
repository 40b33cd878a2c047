"""End-to-end: a worker SIGKILLed under `--max-restarts 1` resumes from the in-memory snapshot, not the disk
(the full format: ddp; and DCP shards: fsdp).

The disk checkpoint interval is larger than the run, so no disk checkpoint exists when the worker dies:
a resume at a step above 0 can only come from memory. The run must then end with the per-step losses
(float.hex) and final weights (bytes) of the uninterrupted reference run (conftest's `slow_toy_reference`,
the same recipe, which saves to disk every 5 steps and has no memory snapshots).
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from dptrain.checkpoint import manifest as mf
from support.run_helpers import SLOW_TOY, dptrain, losses, start, wait_for_step, wait_training_again, weights, worker


@pytest.mark.timeout(150)
def test_sigkill_resumes_from_memory_without_the_disk_bit_identical(slow_toy_reference: Path, tmp_path):
    out, mem = tmp_path / "run", tmp_path / "mem"
    proc = start(out, "checkpoint.every_steps=1000", "checkpoint.snapshot_every_steps=1",
                 f"checkpoint.snapshot_dir={mem}", flags=("--max-restarts", "1"))
    wait_for_step(proc, out, 12)
    assert mf.step_dirs(out / "checkpoints") == []  # nothing on disk to resume from
    worker(proc, 1).send_signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_training_again(proc, out, attempt=1)
    again_s = time.monotonic() - killed
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output[-3000:]
    report = json.loads((out / "attempts.jsonl").read_text())
    found = re.search(r"resumed from memory snapshot step (\d+) \(every rank's files from its own node's memory\)",
                      output)
    assert found, output[-3000:]
    resumed = int(found.group(1))
    lost = report["last_step"] - resumed
    assert resumed >= 11 and lost <= 1, report  # the snapshot of step 12 may still have been in flight
    assert [mf.step_of(p) for p in mf.step_dirs(out / "checkpoints")] == [30]  # only the final save
    assert losses(out) == losses(slow_toy_reference)
    assert weights(out) == weights(slow_toy_reference)
    assert list(mem.iterdir()) == []  # the run ended normally: its memory folder is gone
    print(f"\nSIGKILL: resumed from memory at step {resumed} ({lost} step(s) lost), training again after "
          f"{again_s:.2f}s")


@pytest.mark.timeout(200)
def test_sigkill_under_fsdp_resumes_from_the_memory_shards_bit_identical(tmp_path):
    """FSDP2 (sharded state, the `dcp` format): every rank snapshots its own shards; after the SIGKILL the group
    resumes from them and ends bit-identical to the uninterrupted FSDP run."""
    fsdp = ("parallel.strategy=fsdp", "train.max_steps=16", "checkpoint.every_steps=1000")
    ref = dptrain("run", *SLOW_TOY, *fsdp, "--nproc-per-node", "2", "--out", str(tmp_path / "ref"), timeout=150)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out, mem = tmp_path / "run", tmp_path / "mem"
    proc = start(out, *fsdp, "checkpoint.snapshot_every_steps=1", f"checkpoint.snapshot_dir={mem}",
                 flags=("--max-restarts", "1"))
    wait_for_step(proc, out, 8)
    worker(proc, 0).send_signal(signal.SIGKILL)
    output = proc.communicate(timeout=150)[0]
    assert proc.returncode == 0, output[-3000:]
    found = re.search(r"resumed from memory snapshot step (\d+)", output)
    assert found and int(found.group(1)) >= 7, output[-3000:]
    assert [mf.step_of(p) for p in mf.step_dirs(out / "checkpoints")] == [16]  # only the final save
    assert losses(out) == losses(tmp_path / "ref")
    assert weights(out) == weights(tmp_path / "ref")
