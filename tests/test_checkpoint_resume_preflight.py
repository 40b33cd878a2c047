"""`prepare_resume` (the pre-flight of `dptrain run` on a run directory with checkpoints): a batch that
does not fit the new world size is re-derived; every other config error surfaces as itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from dptrain.checkpoint import manifest as mf
from dptrain.cli.ckpt import prepare_resume
from dptrain.cli.main import main
from dptrain.config import ConfigError
from dptrain.config.load import load_config

pytestmark = pytest.mark.timeout(60)


def _fake_checkpoint(run_dir: Path, *, global_batch: int = 32, world_size: int = 2) -> None:
    """A committed checkpoint folder whose manifest meta is all the pre-flight reads."""
    step = run_dir / "checkpoints" / "step_000010"
    step.mkdir(parents=True)
    sha = mf.write_manifest(
        step, files={}, meta={"global_batch_size": global_batch, "world_size": world_size, "step": 10}
    )
    mf.commit(step, manifest_sha256=sha)


def _prepare(run_dir: Path, *overrides: str, world_size: int):
    cfg = load_config(None, ["parallel.device=cpu", *overrides])
    return prepare_resume(cfg, run_dir=run_dir, resume="auto", trust=False, world_size=world_size)


def test_accumulation_is_rederived_for_a_new_world_size(tmp_path):
    _fake_checkpoint(tmp_path)
    cfg = _prepare(
        tmp_path, "train.global_batch_size=32", "train.micro_batch_size=8", "train.grad_accum_steps=2", world_size=4
    )
    assert (cfg.train.global_batch_size, cfg.train.grad_accum_steps) == (32, None)


@pytest.mark.fast
@pytest.mark.parametrize(
    "override,message",
    [
        ("precision.dtype=fp8", "precision.dtype='fp8' is not valid"),
        ("optim.lr_scaling=cubic", "optim.lr_scaling='cubic' is not valid"),
        # Was replaced silently by a re-derived accumulation: the user's bad value vanished.
        ("train.grad_accum_steps=0", "train.grad_accum_steps=0 is not valid"),
    ],
)
def test_a_real_config_error_surfaces_as_itself(tmp_path, override, message):
    _fake_checkpoint(tmp_path)
    with pytest.raises(ConfigError) as info:
        _prepare(tmp_path, override, world_size=4)
    assert message in str(info.value)
    assert "global batch" not in str(info.value), "the error must not be blamed on the checkpoint's batch"


@pytest.mark.fast
def test_dptrain_run_exits_2_with_the_message(tmp_path, capsys):
    _fake_checkpoint(tmp_path)
    assert main(["run", "--out", str(tmp_path), "precision.dtype=fp8", "parallel.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dptrain: error: precision.dtype='fp8' is not valid"), err
