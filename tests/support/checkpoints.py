"""Checkpoint and resume on forked ranks running the Trainer: the toy run, `fit` (one rank's run),
variants that die at a commit or capture the state saved/loaded, and what resume is judged by
(per-step losses as float.hex, final weights by SHA-256)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from dptrain.checkpoint import manifest as mf
from dptrain.config.load import load_config
from dptrain.train.trainer import Trainer

TOY = [
    "model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
    "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every_steps=1", "train.eval_every_steps=0",
    "optim.warmup_steps=2", "log.progress=false", "checkpoint.keep_last=null",
]


def fit(rank: int, out: Path, overrides: list[str], resume: str = "auto", trust: bool = False) -> dict:
    strategy = [] if any(o.startswith("parallel.strategy") for o in overrides) else ["parallel.strategy=ddp"]
    cfg = load_config(None, [*TOY, *strategy, *overrides])
    return Trainer(cfg, out_dir=out, resume=resume, trust_checkpoint=trust).fit()


def fit_dying_at_commit(rank: int, out: Path, overrides: list[str], step: int) -> dict:
    """Rank 0 dies (os._exit, no cleanup) after the data files of `step` are written, before its marker."""
    real = mf.commit

    def commit(ckpt_dir: Path, *, manifest_sha256: str) -> None:
        if mf.step_of(ckpt_dir) == step:
            os._exit(9)
        real(ckpt_dir, manifest_sha256=manifest_sha256)

    mf.commit = commit
    return fit(rank, out, overrides)


def fit_capturing(rank: int, out: Path, overrides: list[str], what: str) -> dict:
    """fit(), writing the full model+optimizer state right after each save (`saved`) or after the resume
    (`loaded`) to out/<what>_<step>.pt, as seen through get_state_dict(full_state_dict=True)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from dptrain.checkpoint.manager import CheckpointManager

    def capture(state) -> None:  # the CheckpointState the Trainer hands to the manager
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd, osd = get_state_dict(state.model_parts[0].module, state.optimizers[0].optimizer, options=opts)
        if rank == 0:
            torch.save({"model": msd, "optim": osd}, out / f"{what}_{state.train.step}.pt")

    name = "save" if what == "saved" else "maybe_resume"
    real = getattr(CheckpointManager, name)

    def wrapped(self, state, **kwargs):
        result = real(self, state, **kwargs)
        capture(state)
        return result

    setattr(CheckpointManager, name, wrapped)
    return fit(rank, out, overrides)


def losses(run_dir: Path) -> list[tuple[int, str]]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], float.hex(r["loss"])) for r in recs if "loss" in r]


def weights_sha(run_dir: Path) -> str:
    return hashlib.sha256((run_dir / "final" / "model.safetensors").read_bytes()).hexdigest()


def assert_restored_exactly(run_dir: Path, step: int, optimizer_keys: tuple[str, ...]) -> None:
    """The full model and optimizer state fit_capturing wrote right after saving step `step`
    (`saved_<step>.pt`) equal, bit for bit, what it wrote right after resuming from it (`loaded_<step>.pt`)."""
    saved, loaded = (torch.load(run_dir / f"{w}_{step}.pt", weights_only=True) for w in ("saved", "loaded"))
    assert saved["model"].keys() == loaded["model"].keys()
    for k in saved["model"]:
        assert torch.equal(saved["model"][k], loaded["model"][k]), k
    s_state, l_state = saved["optim"]["state"], loaded["optim"]["state"]
    assert s_state.keys() == l_state.keys() and len(s_state) > 0
    for name in s_state:
        for key in optimizer_keys:
            assert torch.equal(torch.as_tensor(s_state[name][key]), torch.as_tensor(l_state[name][key])), (name, key)
