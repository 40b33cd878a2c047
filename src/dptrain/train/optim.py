"""The optimizer and learning-rate schedule of a run, built from `OptimConfig`.

The trainer asks `make_optimizer` and `make_scheduler`. They build dptrain's own (SGD/Adam/AdamW/LAMB/1-bit Adam and
1-bit LAMB, `build_optimizer`; warmup + cosine/linear/constant decay or DeepSpeed's schedules, `build_scheduler`), or,
when `optim.factory` / `optim.scheduler_factory` name one by import path, any torch.optim optimizer and scheduler or a
user's function returning one. The optimizer is built by the `ParallelModel` (zero1 shards its state).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from dptrain.config import ConfigError, OptimConfig
from dptrain.config.imports import import_object
from dptrain.parallel import ParallelModel
from dptrain.parallel.momentum_exchange import MomentumExchange
from dptrain.train.lamb import Lamb
from dptrain.train.onebit_adam import OneBitAdam
from dptrain.train.onebit_lamb import OneBitLamb
from dptrain.train.schedules import SCHEDULERS


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; leave biases and norm gains (1-D tensors) undecayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def optimizer_spec(cfg: OptimConfig, *, lr: float) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """(optimizer class, its keyword arguments) for `cfg`: SGD, Adam, AdamW or 1-bit Adam (train/onebit_adam.py;
    without an `exchange` keyword it exchanges nothing: `build_optimizer` passes the run's)."""
    if cfg.name == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": cfg.momentum}
    if cfg.name == "adam":
        return torch.optim.Adam, {"lr": lr, "betas": cfg.betas, "eps": cfg.eps}
    if cfg.name == "adamw":
        return torch.optim.AdamW, {"lr": lr, "betas": cfg.betas, "eps": cfg.eps}
    if cfg.name == "onebit_adam":
        return OneBitAdam, {"lr": lr, "betas": cfg.betas, "eps": cfg.eps, "freeze_step": cfg.freeze_step}
    lamb = {"lr": lr, "betas": cfg.betas, "eps": cfg.eps, "eps_inside_sqrt": cfg.eps_inside_sqrt,
            "max_coeff": cfg.max_coeff, "min_coeff": cfg.min_coeff}
    if cfg.name == "lamb":
        return Lamb, {**lamb, "bias_correction": cfg.bias_correction}
    if cfg.name == "onebit_lamb":
        return OneBitLamb, {**lamb, "freeze_step": cfg.freeze_step, "coeff_beta": cfg.coeff_beta,
                            "factor_max": cfg.factor_max, "factor_min": cfg.factor_min,
                            "factor_threshold": cfg.factor_threshold}
    raise ValueError(f"optim.name={cfg.name!r} is not valid; choose one of: sgd, adam, adamw, onebit_adam, lamb, "
                     "onebit_lamb")


def build_optimizer(
    pmodel: ParallelModel, *, cfg: OptimConfig, lr: float, exchange: MomentumExchange | None = None
) -> torch.optim.Optimizer:
    """The configured SGD/Adam/AdamW/1-bit Adam over `plan`'s parameters (no decay on 1-D ones), built
    by the ParallelModel, which shards its state under zero1 (ZeroRedundancyOptimizer: parallel/zero.py).
    onebit_adam: `exchange` is the state of its DDP hook (parallel/comm_hooks.py), which exchanges
    the momenta after the warm-up."""
    cls, defaults = optimizer_spec(cfg, lr=lr)
    if cfg.name in ("onebit_adam", "onebit_lamb"):
        defaults["exchange"] = exchange
    return pmodel.optimizer(cls, param_groups(pmodel.module, weight_decay=cfg.weight_decay), **defaults)


def lr_lambda(
    step: int, *, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float,
    warmup_type: str = "linear", warmup_start_ratio: float = 0.0, convention: str = "dptrain",
) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): warmup, then cosine/linear decay
    or constant. convention='deepspeed' reproduces DeepSpeed's lr_schedules.py (see `_deepspeed_ratio`)."""
    if convention == "deepspeed":
        return _deepspeed_ratio(step - 1, warmup_steps=warmup_steps, total_steps=max_steps, schedule=schedule,
                                min_ratio=min_lr_ratio, warmup_type=warmup_type, start=warmup_start_ratio)
    if warmup_steps and step < warmup_steps:
        # both curves reach the peak at step warmup_steps - 1
        frac = math.log(step + 2) / math.log(warmup_steps + 1) if warmup_type == "log" else (step + 1) / warmup_steps
        return warmup_start_ratio + (1.0 - warmup_start_ratio) * frac
    if schedule == "constant":
        return 1.0
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def _deepspeed_ratio(
    it: int, *, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float, warmup_type: str, start: float
) -> float:
    """DeepSpeed's WarmupLR (constant), WarmupDecayLR (linear) and WarmupCosineLR (cosine) as a fraction of
    the peak at scheduler iteration `it`. DeepSpeed steps its scheduler after each optimizer step, so
    optimizer step s trains at iteration s - 1; before the first step (it < 0) the rate is warmup_min_lr
    (WarmupLR, WarmupDecayLR) or 0 (WarmupCosineLR). Warmup lasts max(2, warmup_num_steps) iterations."""
    if it < 0:
        return 0.0 if schedule == "cosine" else start
    w = max(2, warmup_steps)
    if it < w:
        gamma = math.log(it + 1) / math.log(w) if warmup_type == "log" else it / w
        return start + (1.0 - start) * gamma
    if schedule == "constant":
        return 1.0
    if schedule == "linear":  # WarmupDecayLR: linear from the peak down to warmup_min_lr at total_num_steps
        gamma = max(0.0, (total_steps - it) / max(1.0, total_steps - w))
        return min_ratio + (1.0 - min_ratio) * gamma
    shape = (1.0 + math.cos(math.pi * min(1.0, (it - w + 1) / max(1, total_steps - w)))) / 2  # clamped (0.19)
    return max(0.0, min_ratio + (1.0 - min_ratio) * shape)


def build_scheduler(optimizer: torch.optim.Optimizer, *, cfg: OptimConfig, max_steps: int) -> LRScheduler:
    if cfg.schedule in SCHEDULERS:  # DeepSpeed's OneCycle / LRRangeTest (train/schedules.py)
        return SCHEDULERS[cfg.schedule](optimizer, cfg.schedule_params)

    def fn(step: int) -> float:
        return lr_lambda(
            step, warmup_steps=cfg.warmup_steps, max_steps=max_steps, schedule=cfg.schedule,
            min_lr_ratio=cfg.min_lr_ratio, warmup_type=cfg.warmup_type, warmup_start_ratio=cfg.warmup_start_ratio,
            convention=cfg.schedule_convention,
        )

    return LambdaLR(optimizer, fn)


def factory_params(model: torch.nn.Module, *, weight_decay: float) -> list[Any]:
    """What `optim.factory` receives as its first argument: the trainable parameters (one group, PyTorch's
    `Opt(model.parameters())`), or dptrain's two groups (decay on matrices only) when weight_decay is not 0."""
    if weight_decay:
        return param_groups(model, weight_decay=weight_decay)
    return [p for p in model.parameters() if p.requires_grad]


def factory_defaults(cfg: OptimConfig, *, lr: float) -> dict[str, Any]:
    """The keyword arguments `optim.factory` is called with."""
    return {"lr": lr, **({"weight_decay": cfg.weight_decay} if cfg.weight_decay else {}), **cfg.kwargs}


def make_optimizer(
    pmodel: ParallelModel, *, cfg: OptimConfig, lr: float, exchange: MomentumExchange | None = None
) -> torch.optim.Optimizer:
    """`optim.factory(params, lr=lr, [weight_decay=...], **optim.kwargs)` built by the ParallelModel (zero1 shards it:
    ZeroRedundancyOptimizer calls the factory with each rank's share), else dptrain's own optimizer (`exchange`:
    onebit_adam's, see `build_optimizer`)."""
    if cfg.factory is None:
        return build_optimizer(pmodel, cfg=cfg, lr=lr, exchange=exchange)
    factory = import_object(cfg.factory)
    params = factory_params(pmodel.module, weight_decay=cfg.weight_decay)
    try:
        opt = pmodel.optimizer(factory, params, **factory_defaults(cfg, lr=lr))
    except TypeError as e:
        raise ConfigError(f"optim.factory={cfg.factory!r} rejected its arguments (lr, optim.kwargs={cfg.kwargs!r}"
                          f"{', weight_decay' if cfg.weight_decay else ''}): {e}") from None
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"optim.factory={cfg.factory!r} returned {type(opt).__name__}, not a torch.optim.Optimizer")
    return opt


def make_scheduler(optimizer: torch.optim.Optimizer, *, cfg: OptimConfig, max_steps: int) -> LRScheduler:
    """`optim.scheduler_factory(optimizer, **optim.scheduler_kwargs)`, else dptrain's warmup + decay."""
    if cfg.scheduler_factory is None:
        return build_scheduler(optimizer, cfg=cfg, max_steps=max_steps)
    factory = import_object(cfg.scheduler_factory)
    try:
        sched = factory(optimizer, **cfg.scheduler_kwargs)
    except TypeError as e:
        raise ConfigError(f"optim.scheduler_factory={cfg.scheduler_factory!r} rejected optim.scheduler_kwargs="
                          f"{cfg.scheduler_kwargs!r}: {e}") from None
    problem = scheduler_problem(sched)
    if problem:
        raise ConfigError(f"optim.scheduler_factory={cfg.scheduler_factory!r} {problem}")
    return sched


def scheduler_problem(sched: Any) -> str | None:
    """Why `sched` cannot be dptrain's scheduler (stepped without arguments, checkpointed), or None."""
    for name in ("step", "state_dict", "load_state_dict", "get_last_lr"):
        if not callable(getattr(sched, name, None)):
            return (f"returned {type(sched).__name__}, which has no {name}(); return a torch.optim.lr_scheduler "
                    "scheduler")
    required = [p.name for p in inspect.signature(sched.step).parameters.values()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        return (f"returned {type(sched).__name__}, whose step() needs {', '.join(required)} (e.g. ReduceLROnPlateau's "
                "metric); dptrain steps the scheduler without arguments")
    return None


def scheduler_period(*, interval: str, steps_per_epoch: int) -> int:
    """Every how many optimizer steps the scheduler steps: after every step (1), or after the last step of each
    epoch of the global data order (the same steps at every world size). The trainer steps it after optimizer
    step number `step` (1-based) when `step % period == 0`."""
    return 1 if interval == "step" else steps_per_epoch
