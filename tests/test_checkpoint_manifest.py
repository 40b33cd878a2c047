"""Unit tests of the commit protocol, verification, checkpoint choice and the restricted loaders (fast)."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint.attempts import ProgressFile, report_restart
from dptrain.checkpoint.resume import choose_checkpoint, truncate_metrics
from dptrain.checkpoint.rng import get_rng_state, set_rng_state
from dptrain.checkpoint.safe_dcp import load_metadata
from dptrain.checkpoint.storage import load_torch, save_torch

pytestmark = pytest.mark.fast


def make_ckpt(root: Path, step: int, *, commit: bool = True, files: dict[str, bytes] | None = None) -> Path:
    d = root / mf.step_dir_name(step)
    (d / "dcp").mkdir(parents=True)
    for rel, data in (files or {"model.pt": b"m" * 100, "dcp/__0_0.distcp": os.urandom(64)}).items():
        (d / rel).write_bytes(data)
    entries = {rel: mf.file_entry(d / rel) for rel in mf.data_files(d)}
    digest = mf.write_manifest(d, files=entries, meta={"step": step})
    if commit:
        mf.commit(d, manifest_sha256=digest)
    return d


@pytest.mark.timeout(10)
def test_committed_checkpoint_verifies_and_lists(tmp_path):
    d = make_ckpt(tmp_path, 5)
    assert mf.verify(d) == {"step": 5}
    assert sorted(os.listdir(d)) == ["COMMITTED", "dcp", "manifest.json", "model.pt"]  # no temp files left
    info = mf.inspect_dir(d)
    assert info.valid and info.step == 5
    body = json.loads((d / "manifest.json").read_text())
    assert set(body["files"]) == {"model.pt", "dcp/__0_0.distcp"}
    assert body["files"]["model.pt"]["size"] == 100


@pytest.mark.timeout(10)
def test_without_marker_the_folder_is_uncommitted(tmp_path):
    d = make_ckpt(tmp_path, 3, commit=False)
    info = mf.inspect_dir(d)
    assert info.state == "uncommitted" and "COMMITTED" in info.reason
    with pytest.raises(mf.CheckpointError, match="not committed"):
        mf.verify(d)


@pytest.mark.timeout(10)
def test_flipped_byte_is_named_with_both_hashes(tmp_path):
    d = make_ckpt(tmp_path, 1)
    shard = d / "dcp" / "__0_0.distcp"
    expected = mf.sha256_file(shard)
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(mf.CheckpointError) as e:
        mf.verify(d)
    msg = str(e.value)
    assert "dcp/__0_0.distcp" in msg and expected in msg and mf.sha256_file(shard) in msg


@pytest.mark.timeout(10)
def test_truncated_missing_and_extra_files_are_refused(tmp_path):
    d = make_ckpt(tmp_path, 1)
    with open(d / "model.pt", "r+b") as f:
        f.truncate(50)
    with pytest.raises(mf.CheckpointError, match=r"model\.pt: size 50 bytes, expected 100"):
        mf.verify(d)
    d2 = make_ckpt(tmp_path, 2)
    (d2 / "dcp" / "__0_0.distcp").unlink()
    with pytest.raises(mf.CheckpointError, match=r"__0_0\.distcp: missing"):
        mf.verify(d2)
    d3 = make_ckpt(tmp_path, 3)
    (d3 / "dcp" / "__1_0.distcp").write_bytes(b"x")
    with pytest.raises(mf.CheckpointError, match=r"__1_0\.distcp: file not listed"):
        mf.verify(d3)


@pytest.mark.timeout(10)
def test_a_changed_manifest_does_not_match_the_marker(tmp_path):
    d = make_ckpt(tmp_path, 1)
    body = json.loads((d / "manifest.json").read_text())
    body["meta"]["step"] = 99
    (d / "manifest.json").write_text(json.dumps(body))
    with pytest.raises(mf.CheckpointError, match="manifest.json: SHA-256 mismatch"):
        mf.verify(d)


@pytest.mark.timeout(10)
def test_uncommit_and_prune_only_touch_committed_folders(tmp_path):
    for s in (1, 2, 3, 4):
        make_ckpt(tmp_path, s)
    make_ckpt(tmp_path, 5, commit=False)  # being written
    mf.uncommit(tmp_path / "step_000004")
    assert mf.inspect_dir(tmp_path / "step_000004").state == "uncommitted"
    deleted = mf.prune(tmp_path, keep_last=2)
    assert [p.name for p in deleted] == ["step_000001"]
    assert [p.name for p in mf.step_dirs(tmp_path)] == ["step_000002", "step_000003", "step_000004", "step_000005"]
    assert mf.prune(tmp_path, keep_last=None) == []


@pytest.mark.timeout(10)
def test_auto_resume_skips_bad_folders_and_says_why(tmp_path):
    make_ckpt(tmp_path, 2)
    make_ckpt(tmp_path, 4)
    bad = make_ckpt(tmp_path, 6)
    (bad / "model.pt").write_bytes(b"M" * 100)  # same size, other bytes
    make_ckpt(tmp_path, 8, commit=False)
    choice = choose_checkpoint("auto", root=tmp_path)
    assert choice.path == str(tmp_path / "step_000004") and choice.meta == {"step": 4}
    assert "step_000008" in choice.messages[0] and "uncommitted" in choice.messages[0]
    assert "step_000006" in choice.messages[1] and "corrupt" in choice.messages[1] and "model.pt" in choice.messages[1]
    assert choose_checkpoint("none", root=tmp_path).path is None
    assert choose_checkpoint(str(tmp_path), root=tmp_path).path == str(tmp_path / "step_000004")


@pytest.mark.timeout(10)
def test_explicit_unverified_checkpoint_needs_trust(tmp_path):
    d = make_ckpt(tmp_path, 3, commit=False)
    refused = choose_checkpoint(str(d), root=tmp_path)
    assert refused.path is None and "--trust-checkpoint" in refused.error and "uncommitted" in refused.error
    trusted = choose_checkpoint(str(d), root=tmp_path, trust=True)
    assert trusted.path == str(d) and "UNVERIFIED" in trusted.messages[0]
    (d / "manifest.json").unlink()
    assert choose_checkpoint(str(d), root=tmp_path, trust=True).error  # no step known without a manifest


@pytest.mark.timeout(10)
def test_truncate_metrics_keeps_one_run(tmp_path):
    p = tmp_path / "metrics.jsonl"
    recs = [{"step": 0, "val_loss": 2.5}, {"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9}, {"step": 3, "loss": 0.8}]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 4, "lo')  # torn last line
    assert truncate_metrics(p, step=2) == 2.5
    assert [json.loads(line)["step"] for line in p.read_text().splitlines()] == [0, 1, 2]


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.timeout(10)
def test_pickle_payloads_never_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "optim.pt"
    torch.save({"state": _Payload(marker)}, path)
    with pytest.raises(mf.CheckpointError, match="weights_only"):
        load_torch(path)
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        load_metadata(pickle.dumps(_Payload(marker)))
    assert not marker.exists()


@pytest.mark.timeout(10)
def test_rng_state_round_trips_through_weights_only_files(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    save_torch(tmp_path / "rng.pt", get_rng_state())
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_torch(tmp_path / "rng.pt"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    buf = io.BytesIO()
    torch.save(get_rng_state(), buf)
    assert buf.tell() > 0


@pytest.mark.timeout(10)
def test_restart_report_names_the_dead_rank_and_its_step(tmp_path):
    p0 = ProgressFile(tmp_path, rank=0, attempt=0)
    p1 = ProgressFile(tmp_path, rank=1, attempt=0)
    p0.step(7)
    p1.step(6)
    p0.error("Traceback ...\nRuntimeError: Connection closed by peer")
    p0.close(), p1.close()
    text = report_restart(tmp_path, attempt=1)
    assert "rank 1" in text and "at step 6" in text and "without a Python error" in text
    assert "rank 0" in text and "Connection closed by peer" in text
    rec = json.loads((tmp_path / "attempts.jsonl").read_text())
    assert rec["attempt"] == 0 and rec["restarted_as"] == 1 and {f["rank"] for f in rec["failures"]} == {0, 1}


def _run_dir_with_checkpoint(tmp_path: Path, overrides: list[str]) -> Path:
    from dptrain.config.load import dump_yaml, load_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_yaml(load_config(None, overrides)))
    d = make_ckpt(run / "checkpoints", 4)
    body = json.loads((d / "manifest.json").read_text())
    meta = {"step": 4, "global_batch_size": 8, "world_size": 2}
    mf.commit(d, manifest_sha256=mf.write_manifest(d, files=body["files"], meta=meta))
    return run


@pytest.mark.timeout(30)
def test_resume_keeps_the_global_batch_and_re_derives_accumulation(tmp_path):
    from dptrain.cli.ckpt import prepare_resume
    from dptrain.config import ConfigError, resolve
    from dptrain.config.load import load_config

    base = ["train.global_batch_size=8", "train.micro_batch_size=2", "train.grad_accum_steps=2"]
    run = _run_dir_with_checkpoint(tmp_path, base)
    cfg = prepare_resume(load_config(None, base), run_dir=run, resume="auto", trust=False, world_size=1)
    res = resolve(cfg, world_size=1)
    assert (res.global_batch_size, res.micro_batch_size, res.grad_accum_steps) == (8, 2, 4)
    with pytest.raises(ConfigError, match="global batch of 8 at world size 3"):
        prepare_resume(load_config(None, base), run_dir=run, resume="auto", trust=False, world_size=3)
    with pytest.raises(ConfigError, match="global_batch_size=8, this run asks for 16"):
        prepare_resume(load_config(None, [*base[1:], "train.global_batch_size=16"]), run_dir=run, resume="auto",
                       trust=False, world_size=2)
    with pytest.raises(ConfigError, match=r"another model \(model.kwargs"):
        prepare_resume(load_config(None, [*base, "model.kwargs.dim=64"]), run_dir=run, resume="auto", trust=False,
                       world_size=2)
    with pytest.raises(ConfigError, match="--resume none, but"):
        prepare_resume(load_config(None, base), run_dir=run, resume="none", trust=False, world_size=2)
