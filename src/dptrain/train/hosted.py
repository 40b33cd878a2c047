"""An optimizer and an LR scheduler named by import path (`optim.factory`, `optim.scheduler_factory`):
any torch.optim optimizer and scheduler, or a user's function returning one, in place of dptrain's
SGD/Adam/AdamW and warmup + decay schedule (train/optim.py, which builds those). The trainer asks
`make_optimizer` and `make_scheduler`; without the factory fields they hand over to train/optim.py."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from dptrain.config import ConfigError, OptimConfig
from dptrain.config.imports import import_object
from dptrain.parallel import ParallelModel
from dptrain.parallel.momentum_exchange import MomentumExchange
from dptrain.train.optim import build_optimizer, build_scheduler, param_groups


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
    plan: ParallelModel, *, cfg: OptimConfig, lr: float, exchange: MomentumExchange | None = None
) -> torch.optim.Optimizer:
    """`optim.factory(params, lr=lr, [weight_decay=...], **optim.kwargs)` built by the plan (zero1 shards it:
    ZeroRedundancyOptimizer calls the factory with each rank's share), else dptrain's own optimizer (`exchange`:
    onebit_adam's, see `build_optimizer`)."""
    if cfg.factory is None:
        return build_optimizer(plan, cfg=cfg, lr=lr, exchange=exchange)
    factory = import_object(cfg.factory)
    params = factory_params(plan.module, weight_decay=cfg.weight_decay)
    try:
        opt = plan.optimizer(factory, params, **factory_defaults(cfg, lr=lr))
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
