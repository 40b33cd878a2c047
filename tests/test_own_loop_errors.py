"""Errors in the caller's words: API calls name their own parameters (not the config's `train.*` / `parallel.*`,
not `dptrain run`'s `--resume`), `dptrain ckpt ls|verify|export` name their own argument, and the error classes
are importable from `dptrain` to catch by type."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import dptrain
from dptrain.cli.main import main as cli

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]


def test_api_calls_name_their_own_parameters():
    data = TensorDataset(torch.arange(10))
    with pytest.raises(dptrain.BatchSizeError) as e:
        dptrain.prepare_dataloader(data, global_batch_size=3, micro_batch_size=2)
    assert str(e.value).startswith("prepare_dataloader: global_batch_size=3 is not divisible") and "train." not in \
        str(e.value)
    with pytest.raises(dptrain.ConfigError, match=r"^prepare_dataloader: micro_batch_size=0 is not valid"):
        dptrain.prepare_dataloader(data, micro_batch_size=0)
    with pytest.raises(dptrain.ConfigError, match=r"^parallelize: strategy='bogus' is not valid"):
        dptrain.parallelize(torch.nn.Linear(1, 1), strategy="bogus")
    with pytest.raises(dptrain.ConfigError, match=r"^parallelize: activation_checkpointing='x' is not valid"):
        dptrain.parallelize(torch.nn.Linear(1, 1), activation_checkpointing="x")
    assert issubclass(dptrain.BatchSizeError, dptrain.ConfigError)


def test_checkpointer_resume_path_errors_name_resume(tmp_path):
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(dptrain.CheckpointError) as e:
        dptrain.Checkpointer(tmp_path, model, opt, resume="checkpoints/step_000099").resume()
    assert str(e.value) == "Checkpointer(resume='checkpoints/step_000099'): no such file or directory"
    ckpt = dptrain.Checkpointer(tmp_path / "run", model, opt)
    step = ckpt.save(1)
    (step / "model.pt").write_bytes(b"corrupt")
    with pytest.raises(dptrain.CheckpointError) as e:
        dptrain.Checkpointer(tmp_path / "run", model, opt, resume=str(step)).resume()
    assert str(e.value).startswith(f"Checkpointer(resume={str(step)!r}): corrupt") and "--" not in str(e.value)
    with pytest.raises(dptrain.CheckpointError, match=r"Checkpointer\(resume=.*no valid checkpoint under"):
        dptrain.Checkpointer(tmp_path / "other", model, opt, resume=str(tmp_path / "run")).resume()


@pytest.mark.parametrize("corrupt", [False, True])
def test_ckpt_commands_name_their_own_argument_on_an_empty_or_all_corrupt_folder(tmp_path, capsys, corrupt):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    if corrupt:
        model = torch.nn.Linear(1, 1)
        step = dptrain.Checkpointer(run, model, torch.optim.SGD(model.parameters(), lr=0.1)).save(1)
        (step / "model.pt").write_bytes(b"corrupt")
    capsys.readouterr()
    assert cli(["ckpt", "export", str(run), "--out", str(tmp_path / "w.safetensors")]) == 2
    err = capsys.readouterr().err
    want = "no valid checkpoint under" if corrupt else "holds no step_NNNNNN checkpoint folders"
    assert f"dptrain: error: ckpt export {run}: {want}" in err and "--resume" not in err, err
    assert ("Pass one step folder with --trust-checkpoint" in err) == corrupt
    assert cli(["ckpt", "ls", str(run)]) == (0 if corrupt else 1)
    assert cli(["ckpt", "verify", str(run)]) == 1
    out = capsys.readouterr()
    assert "--resume" not in out.out + out.err
    assert ("CORRUPT" in out.out) if corrupt else (f"no checkpoints under {run / 'checkpoints'}" in out.err)
