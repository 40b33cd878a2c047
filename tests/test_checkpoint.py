"""Checkpoint and resume on real gloo process groups (forked ranks running the Trainer).

Per-step losses are compared as float.hex and final weights by SHA-256: resume must be exact.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from dptrain.checkpoint import manifest as mf
from support.checkpoints import (
    assert_restored_exactly,
    fit,
    fit_capturing,
    fit_dying_at_commit,
    losses,
    weights_sha,
)
from support.mp import RankError, run_ranks


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("strategy", "log_every"), [("ddp", 1), ("zero1", 1), ("ddp", 3)])
def test_crash_between_data_files_and_marker_is_ignored_and_resume_is_exact(tmp_path, capfd, strategy, log_every):
    # log_every=3 with saves every 2 steps: the resumed run starts inside a logging window
    over = ["train.max_steps=8", "checkpoint.every_steps=2", f"parallel.strategy={strategy}",
            f"train.log_every_steps={log_every}"]
    run_ranks(fit, 2, tmp_path / "ref", over)
    crash = tmp_path / "crash"
    with pytest.raises(RankError):
        run_ranks(fit_dying_at_commit, 2, crash, over, 6, timeout=60)
    step6 = crash / "checkpoints" / "step_000006"
    assert (step6 / "manifest.json").exists() and not (step6 / "COMMITTED").exists()
    capfd.readouterr()
    run_ranks(fit, 2, crash, over)
    err = capfd.readouterr().err
    assert "skipping checkpoint" in err and "step_000006: uncommitted" in err
    assert "resumed from" in err and "step_000004 at step 4" in err
    assert losses(crash) == losses(tmp_path / "ref")  # metrics.jsonl reads as one run, bit for bit
    assert weights_sha(crash) == weights_sha(tmp_path / "ref")
    assert mf.inspect_dir(step6).valid  # rewritten and committed by the resumed run


DAMAGED_RUN = ["train.max_steps=6", "checkpoint.every_steps=3", "parallel.strategy=fsdp"]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """A finished 2-rank FSDP run with checkpoints at steps 3 and 6; each damage test works on a copy."""
    run = tmp_path_factory.mktemp("fsdp") / "run"
    run_ranks(fit, 2, run, DAMAGED_RUN)
    return run


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_shard_is_refused_named_and_the_previous_checkpoint_used(fsdp_run, tmp_path, capfd, damage):
    run, over = tmp_path / "run", DAMAGED_RUN
    shutil.copytree(fsdp_run, run)
    expected_losses, expected_sha = losses(run), weights_sha(run)
    shard = run / "checkpoints" / "step_000006" / "dcp" / "__1_0.distcp"
    sha = mf.sha256_file(shard)
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-7])
    else:
        shard.unlink()
    capfd.readouterr()
    run_ranks(fit, 2, run, over)
    err = capfd.readouterr().err
    assert "step_000006: corrupt" in err and "dcp/__1_0.distcp" in err and sha in err
    assert "step_000003 at step 3" in err
    assert losses(run) == expected_losses and weights_sha(run) == expected_sha


def _rehash(ckpt: Path) -> None:
    """Re-sign a tampered checkpoint so that only the loaders' own safety stands in the way."""
    entries = {rel: mf.file_entry(ckpt / rel) for rel in mf.data_files(ckpt)}
    meta = json.loads((ckpt / "manifest.json").read_text())["meta"]
    mf.commit(ckpt, manifest_sha256=mf.write_manifest(ckpt, files=entries, meta=meta))


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_pickle_payload_in_a_re_hashed_checkpoint_never_runs(tmp_path, strategy):
    run = tmp_path / "run"
    over = ["train.max_steps=2", f"parallel.strategy={strategy}"]
    run_ranks(fit, 1, run, over)
    ckpt = run / "checkpoints" / "step_000002"
    marker = tmp_path / "pwned"
    if strategy == "ddp":
        torch.save({"state": _Payload(str(marker)), "param_groups": []}, ckpt / "optim.pt")
    else:
        (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    _rehash(ckpt)
    assert mf.inspect_dir(ckpt).valid  # the manifest cannot tell: only the restricted loaders protect
    with pytest.raises(RankError) as e:
        run_ranks(fit, 1, run, ["train.max_steps=3", *over[1:]], str(ckpt), timeout=60)
    assert "weights_only" in str(e.value) or "does not load" in str(e.value)
    assert not marker.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("strategy", "before", "after"), [("ddp", 2, 1), ("ddp", 1, 2), ("fsdp", 2, 1), ("fsdp", 1, 2)]
)
def test_world_size_change_restores_model_and_optimizer_exactly(tmp_path, strategy, before, after):
    run = tmp_path / "run"
    over = [f"parallel.strategy={strategy}", "checkpoint.every_steps=3"]
    run_ranks(fit_capturing, before, run, ["train.max_steps=3", *over], "saved")
    run_ranks(fit_capturing, after, run, ["train.max_steps=5", *over], "loaded")
    assert_restored_exactly(run, 3, ("exp_avg", "exp_avg_sq", "step"))
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4, 5]  # continues at the next global step
    meta = json.loads((run / "checkpoints" / "step_000005" / "manifest.json").read_text())["meta"]
    assert meta["world_size"] == after and meta["global_batch_size"] == 8 and meta["sampler"]["step"] == 5


def fit_slow_writes(rank: int, out: Path, overrides: list[str]) -> dict:
    """fit() with background checkpoint writes that take 0.3 s per file (many steps long)."""
    import threading
    import time

    from dptrain.checkpoint import storage

    real = storage.save_torch

    def slow(path: Path, obj) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        real(path, obj)

    storage.save_torch = slow
    return fit(rank, out, overrides)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_async_save_commits_only_complete_checkpoints_and_resumes_exactly(tmp_path, capfd, strategy):
    over = [f"parallel.strategy={strategy}", "train.max_steps=8", "checkpoint.every_steps=2"]
    run_ranks(fit, 2, tmp_path / "ref", over)
    run = tmp_path / "run"
    run_ranks(fit_slow_writes, 2, run, [*over, "checkpoint.async_save=true"])
    infos = mf.list_checkpoints(run / "checkpoints")
    assert [(i.step, i.state) for i in infos] == [(s, "committed") for s in (2, 4, 6, 8)], [i.reason for i in infos]
    assert losses(run) == losses(tmp_path / "ref") and weights_sha(run) == weights_sha(tmp_path / "ref")
    for step in (6, 8):  # resume from the background-written step 4
        shutil.rmtree(run / "checkpoints" / mf.step_dir_name(step))
    capfd.readouterr()
    run_ranks(fit, 2, run, [*over, "checkpoint.async_save=true"])
    assert "step_000004 at step 4" in capfd.readouterr().err
    assert losses(run) == losses(tmp_path / "ref") and weights_sha(run) == weights_sha(tmp_path / "ref")


@pytest.mark.timeout(60)
def test_export_consolidates_sharded_checkpoints_without_a_process_group(tmp_path):
    import argparse

    from safetensors.torch import load_file

    from dptrain.cli.ckpt import cmd_export

    run = tmp_path / "run"
    run_ranks(fit, 2, run, ["train.max_steps=2", "parallel.strategy=fsdp"])
    out = tmp_path / "exported.safetensors"
    assert cmd_export(argparse.Namespace(target=str(run), out=str(out), trust_checkpoint=False)) == 0
    exported, final = load_file(out), load_file(run / "final" / "model.safetensors")
    assert exported.keys() == final.keys()
    for k in final:
        assert torch.equal(exported[k], final[k]), k
