"""Helpers for the diagnostics tests: the `dptrain` command in a subprocess, orphan checks, and
test-only factories and loss functions that misbehave on one rank (selected by environment
variables, which torchrun passes on to its workers)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import torch
from torch import nn

TOY = [
    "model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
    "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
    "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_every_steps=2",
    "train.eval_every_steps=0", "optim.name=sgd", "optim.lr=0.05", "optim.warmup_steps=0",
]

TP_LLAMA = [  # the built-in LM, tiny, splittable over tp = 2
    "model.kwargs.dim=32", "model.kwargs.n_layers=1", "model.kwargs.max_seq_len=32", "data.kwargs.seq_len=32",
    "train.global_batch_size=4", "train.micro_batch_size=4", "train.log_every_steps=2", "train.eval_every_steps=0",
    "optim.name=sgd", "optim.lr=0.05", "optim.warmup_steps=0",
]


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains `text` (e.g. a run directory): orphans."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(text in a for a in p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


_calls = {"train": 0}


def _training_call(model: nn.Module) -> int:
    """How many training-mode loss calls this process has made (evaluation calls are not counted)."""
    if model.training:
        _calls["train"] += 1
    return _calls["train"]


def sleepy_loss(model: nn.Module, batch) -> torch.Tensor:
    """The model's loss, except that rank $HANG_RANK sleeps forever in its $HANG_STEP-th training call."""
    n = _training_call(model)
    if _rank() == int(os.environ.get("HANG_RANK", "-1")) and n == int(os.environ.get("HANG_STEP", "0")):
        Path(os.environ["HANG_MARK"]).write_text(str(time.time()))
        while True:
            time.sleep(3600)
    return model(batch)


def mlp_wider_on_rank1(**kwargs) -> nn.Module:
    """The toy MLP, with a wider second block on rank 1 only (a model that differs on one rank)."""
    from dptrain.models.toy import build_mlp

    model = build_mlp(**kwargs)
    if _rank() == 1:
        model.layers[1] = type(model.layers[1])(32, 48)
        model.head = nn.Linear(48, 4)
    return model


def train(rank: int, out_dir: str, overrides: list[str]) -> dict:
    """Run `Trainer.fit()` on this rank (for tests/mp.run_ranks) and return its summary."""
    from dptrain.config.load import load_config
    from dptrain.train.trainer import Trainer

    cfg = load_config(None, [*TOY, "log.progress=false", *overrides])
    return Trainer(cfg, out_dir=out_dir).fit()


def nan_batch_loss(model: nn.Module, batch) -> torch.Tensor:
    """The model's loss, with a NaN written into the batch of rank $NAN_RANK at training calls $NAN_STEPS."""
    n = _training_call(model)
    steps = {int(s) for s in os.environ.get("NAN_STEPS", "").split(",") if s}
    if _rank() == int(os.environ.get("NAN_RANK", "-1")) and n in steps:
        x, y = batch
        x = x.clone()
        x[0, 0] = float("nan")
        batch = (x, y)
    return model(batch)


class _SlowData(torch.utils.data.Dataset):
    """The toy regression data; every item costs $SLOW_S seconds on rank $SLOW_RANK."""

    def __init__(self, inner: torch.utils.data.Dataset) -> None:
        self.inner = inner
        slow = _rank() == int(os.environ.get("SLOW_RANK", "-1")) and os.environ.get("SLOW_WHERE") == "data"
        self.delay = float(os.environ.get("SLOW_S", "0")) if slow else 0.0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if self.delay:
            time.sleep(self.delay)
        return self.inner[i]


def slow_data(**kwargs) -> torch.utils.data.Dataset:
    """Data factory: the toy regression data, slow to load on one rank (see `_SlowData`)."""
    from dptrain.models.toy import build_regression_data

    return _SlowData(build_regression_data(**kwargs))


def slow_loss(model: nn.Module, batch) -> torch.Tensor:
    """The model's loss; rank $SLOW_RANK spends $SLOW_S more seconds per call when $SLOW_WHERE=compute."""
    if _rank() == int(os.environ.get("SLOW_RANK", "-1")) and os.environ.get("SLOW_WHERE") == "compute":
        time.sleep(float(os.environ["SLOW_S"]))
    return model(batch)


def nudging_loss(model: nn.Module, batch) -> torch.Tensor:
    """The model's loss; in training call $NUDGE_STEP, rank $NUDGE_RANK adds 1e-6 to one weight of
    `layers.1.fc.weight` (a replica that silently drifts)."""
    n = _training_call(model)
    if _rank() == int(os.environ.get("NUDGE_RANK", "-1")) and n == int(os.environ.get("NUDGE_STEP", "0")):
        module = getattr(model, "module", model)
        with torch.no_grad():
            module.layers[1].fc.weight[0, 0] += 1e-6
    return model(batch)


_kept: list[torch.Tensor] = []


def leaky_loss(model: nn.Module, batch) -> torch.Tensor:
    """The model's loss; rank $LEAK_RANK keeps a fresh 4 MiB tensor alive on every training call."""
    if model.training and _rank() == int(os.environ.get("LEAK_RANK", "-1")):
        _kept.append(torch.ones(2**20))  # ones, not empty: the pages are touched, so RSS grows
    return model(batch)


def mismatched_collective_loss(model: nn.Module, batch) -> torch.Tensor:
    """The model's loss; in training call 2 every rank all-reduces a tensor of a rank-dependent shape
    (a bug that otherwise hangs or corrupts memory)."""
    import torch.distributed as dist

    if _training_call(model) == 2:
        dist.all_reduce(torch.ones(2 + _rank()))
    return model(batch)


def gil_holding_loss(model: nn.Module, batch) -> torch.Tensor:
    """The model's loss, except that rank $HANG_RANK, in its $HANG_STEP-th training call, enters a
    regular expression that backtracks for hours without releasing the GIL (its own threads freeze)."""
    import re

    n = _training_call(model)
    if _rank() == int(os.environ.get("HANG_RANK", "-1")) and n == int(os.environ.get("HANG_STEP", "0")):
        Path(os.environ["HANG_MARK"]).write_text(str(time.time()))
        re.match(r"(a|aa)+$", "a" * 200 + "b")
    return model(batch)


_collates = {"n": 0}


def sleepy_collate(samples):
    """default_collate, except that rank $HANG_RANK sleeps forever in its $HANG_STEP-th call (data loading)."""
    _collates["n"] += 1
    if _rank() == int(os.environ.get("HANG_RANK", "-1")) and _collates["n"] == int(os.environ.get("HANG_STEP", "0")):
        Path(os.environ["HANG_MARK"]).write_text(str(time.time()))
        while True:
            time.sleep(3600)
    return torch.utils.data.default_collate(samples)
