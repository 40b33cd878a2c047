"""What tests/test_hosting.py names by import path or compares with: a classification view of the toy data
(an uneven validation set), an accuracy eval_fn, a collate taking keyword arguments, and the plain-PyTorch
reference loop for `optim.factory` / `optim.scheduler_factory` (torch's own classes, one process, the
global batch of each step in `GlobalBatchSampler`'s order)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Subset, default_collate

from dptrain.data import GlobalBatchSampler
from dptrain.models.toy import build_mlp, build_regression_data

SEED = 1234
MLP = {"in_dim": 8, "hidden": 16, "out_dim": 4, "depth": 2}
DATA = {"n": 32, "in_dim": 8, "out_dim": 4, "seed": 0}


def base(*, steps: int, global_batch: int = 8, strategy: str = "ddp", world: int = 2) -> list[str]:
    """The toy MLP on 32 regression samples (4 steps an epoch at a global batch of 8), fp32 on the CPU."""
    return [
        "model.factory=dptrain.models.toy:build_mlp", *(f"model.kwargs.{k}={v}" for k, v in MLP.items()),
        "data.factory=dptrain.models.toy:build_regression_data", *(f"data.kwargs.{k}={v}" for k, v in DATA.items()),
        "data.num_workers=0", "data.pin_memory=false", f"train.max_steps={steps}", f"train.seed={SEED}",
        "train.log_every_steps=1", "train.eval_every_steps=0", f"train.global_batch_size={global_batch}",
        f"train.micro_batch_size={global_batch // world}", f"parallel.strategy={strategy}", "parallel.device=cpu",
        "parallel.timeout_s=60", "log.progress=false", "optim.weight_decay=0", "optim.grad_clip=null",
        "checkpoint.keep_last=null",
    ]


def torch_reference(*, steps: int, opt_cls: type, opt_kwargs: dict[str, Any], sched_cls: type,
                    sched_kwargs: dict[str, Any], per_epoch: bool, global_batch: int = 8
                    ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch: (final weights, the lr each step trained at)."""
    ds = build_regression_data(**DATA)
    torch.manual_seed(SEED)
    net = build_mlp(**MLP)
    opt = opt_cls(net.parameters(), **opt_kwargs)
    sched = sched_cls(opt, **sched_kwargs)
    order = GlobalBatchSampler(dataset_len=len(ds), global_batch_size=global_batch, micro_batch_size=global_batch,
                               grad_accum_steps=1, dp_rank=0, dp_world_size=1, seed=SEED, shuffle=True)
    lrs = []
    for step in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        net(default_collate([ds[i] for i in order.global_batch_indices(step)])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not per_epoch or (step + 1) % order.steps_per_epoch == 0:
            sched.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, lrs


def classes(*, n: int = 64, n_val: int = 13, in_dim: int = 8, out_dim: int = 4, seed: int = 0) -> tuple[Any, Any]:
    """(train, val) of the toy regression data; the class of a sample is argmax(y). `n_val` samples are held out
    (13 by default: uneven over 2 ranks, and not a multiple of the micro-batch)."""
    ds = build_regression_data(n=n + n_val, in_dim=in_dim, out_dim=out_dim, seed=seed)
    return Subset(ds, range(n)), Subset(ds, range(n, n + n_val))


class Classifier(torch.nn.Module):
    """Two linear layers; forward(x) returns the logits (an eval_fn calls the model as a user's would)."""

    def __init__(self, in_dim: int = 8, hidden: int = 16, n_classes: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(in_dim, hidden), torch.nn.Linear(hidden, n_classes)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.relu(self.layers[0](x)))


def build_classifier(**kwargs: Any) -> Classifier:
    return Classifier(**kwargs)


def ce_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """train.loss: cross-entropy against the class argmax(y)."""
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y.argmax(-1))


def accuracy(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """eval_fn: the batch's fraction of samples whose predicted class is the target's, and its mean loss
    (a second metric)."""
    x, y = batch
    logits = model(x)
    pred, target = logits.argmax(-1), y.argmax(-1)
    pos, true = pred == POSITIVE, target == POSITIVE  # binary F1 of one class: per-sample tp, fp, fn indicators
    return {"accuracy": (pred == target).float().mean(),
            "ce": torch.nn.functional.cross_entropy(logits, target),
            "tp": (pos & true).float().mean(), "fp": (pos & ~true).float().mean(), "fn": (~pos & true).float().mean()}


POSITIVE = 1
"""The class whose F1 the tests' eval_summary reports."""


def f1(metrics: dict[str, float]) -> dict[str, float]:
    """eval_summary: F1 = 2 tp / (2 tp + fp + fn) from the exact means of the indicators (0 when undefined)."""
    denom = 2 * metrics["tp"] + metrics["fp"] + metrics["fn"]
    return {"f1": 2 * metrics["tp"] / denom if denom else 0.0}


def reference_accuracy(weights: dict[str, torch.Tensor], val: Any) -> float:
    """Accuracy of `weights` over the whole of `val`, in one plain forward."""
    pred, target = _predictions(weights, val)
    return float((pred == target).float().mean())


def reference_f1(weights: dict[str, torch.Tensor], val: Any) -> float:
    """Binary F1 of class POSITIVE over the whole of `val` from the confusion counts, in one plain forward."""
    pred, target = _predictions(weights, val)
    tp = int(((pred == POSITIVE) & (target == POSITIVE)).sum())
    fp = int(((pred == POSITIVE) & (target != POSITIVE)).sum())
    fn = int(((pred != POSITIVE) & (target == POSITIVE)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def _predictions(weights: dict[str, torch.Tensor], val: Any) -> tuple[torch.Tensor, torch.Tensor]:
    net = Classifier()
    net.load_state_dict(weights)
    x, y = default_collate([val[i] for i in range(len(val))])
    with torch.no_grad():
        return net(x).argmax(-1), y.argmax(-1)


def scaled_collate(samples: list[Any], *, scale: float) -> Any:
    """A collate that takes a keyword argument (data.collate_kwargs.scale): default_collate, inputs times scale."""
    x, y = default_collate(samples)
    return x * scale, y


def make_offset_collate(offset: float):
    """A closure factory (the documented way: a module-level result, `offset_collate` below)."""
    def collate(samples: list[Any]) -> Any:
        x, y = default_collate(samples)
        return x + offset, y
    return collate


offset_collate = make_offset_collate(0.0)


def make_adadelta(params: Any, *, lr: float, rho: float) -> torch.optim.Optimizer:
    """optim.factory as a function (`mypkg.mod:make_opt`): returns torch's Adadelta."""
    return torch.optim.Adadelta(params, lr=lr, rho=rho)
