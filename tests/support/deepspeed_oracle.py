"""DeepSpeed itself as the oracle for DeepSpeed files: one config read by DeepSpeed's own code and by dptrain,
compared row by row (tests/test_deepspeed_conformance.py, benchmarks/acceptance/deepspeed_conformance.py).

DeepSpeed's reading: `deepspeed.runtime.config.DeepSpeedConfig` (given a stand-in mpu for the data-parallel
size, and deepspeed.comm's rank stubbed so it takes it), the optimizer class its engine would build
(`_configure_basic_optimizer`: FusedAdam, or torch's Adam/AdamW under torch_adam, or torch.optim.<type>;
defaults read from that class's own signature), the scheduler object from `deepspeed.runtime.lr_schedules`
stepped as the engine steps it (after each optimizer step), and its fp16 config. A config DeepSpeed refuses
is one where any of these raises, or one its engine refuses at initialize (max_grad_norm; optimizer
types it has no class for).

dptrain's reading: `translate_deepspeed` -> `build_config` -> `resolve` at the same data-parallel size (times
the pipeline stages), the optimizer spec and the torch scheduler `build_scheduler` builds, stepped the same way.
"""

from __future__ import annotations

import copy
import inspect
import math
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import deepspeed.comm
import torch
from deepspeed.ops.adam import FusedAdam
from deepspeed.ops.lamb import FusedLamb
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import DeepSpeedConfig

from dptrain.config import ConfigError, resolve
from dptrain.config.deepspeed import translate_deepspeed
from dptrain.config.deepspeed.batch import BATCH_KEYS
from dptrain.config.load import build_config
from dptrain.config.pipeline import settle_pipeline
from dptrain.train.optim import build_scheduler, optimizer_spec

LR_REL_TOL = 1e-12
"""LR rows agree when every step's rate is within this relative error: dptrain computes peak x ratio where
DeepSpeed's WarmupLR/WarmupDecayLR compute min + (max - min) x gamma (same value, different rounding);
OneCycle and LRRangeTest run DeepSpeed's arithmetic and agree exactly."""


class DataParallelMpu:
    """The `mpu` DeepSpeedConfig asks for the data-parallel size."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@dataclass
class Reading:
    """What one side made of a config: None in `refused` when it accepted it."""

    refused: str | None = None
    rows: dict[str, Any] = field(default_factory=dict)


def _signature_defaults(cls: type) -> dict[str, Any]:
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


LAMB_ROW = ("lr", "weight_decay", "betas", "eps", "bias_correction", "eps_inside_sqrt", "max_coeff", "min_coeff")


def _ds_lamb(params: dict[str, Any], *, dynamic_scale: bool) -> tuple[tuple[Any, ...], float]:
    """FusedLamb(**params) as the engine builds it (its signature: an unknown parameter is a TypeError), with the
    engine's assertion that Lamb runs with dynamic loss scaling; FusedLamb itself needs CUDA, so its
    signature is read rather than the object built."""
    sig = _signature_defaults(FusedLamb)
    unknown = set(params) - set(sig)
    if unknown:
        raise TypeError(f"FusedLamb.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    if params.get("amsgrad"):
        raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
    if not dynamic_scale:
        raise AssertionError("DeepSpeed lamb optimizer requires dynamic loss scaling")
    p = {**sig, **params}
    return ("lamb", *(tuple(p[k]) if k == "betas" else p[k] for k in LAMB_ROW)), p["lr"]


def _ds_optimizer(name: str | None, params: dict[str, Any] | None, *,
                  dynamic_scale: bool = True) -> tuple[tuple[Any, ...], float]:
    """(optimizer row, lr) of the optimizer DeepSpeed's engine builds; raises where the engine raises."""
    params = dict(params or {})
    if name is None:
        raise ValueError("no optimizer block (the row needs one)")
    if "max_grad_norm" in params:
        raise ValueError("'max_grad_norm' is not supported as an optimizer parameter (deepspeed.initialize)")
    low = name.lower()
    if low == "lamb":
        return _ds_lamb(params, dynamic_scale=dynamic_scale)
    if low in ("adam", "adamw"):
        adam_w = params.pop("adam_w_mode", True)
        eff = low == "adamw" or adam_w
        if params.pop("torch_adam", False):
            cls: type = torch.optim.AdamW if eff else torch.optim.Adam
        else:
            cls = FusedAdam
        p = {**_signature_defaults(cls), **params}
        return ("adamw" if eff else "adam", p["lr"], p["weight_decay"], tuple(p["betas"]), p["eps"]), p["lr"]
    if not hasattr(torch.optim, name):  # Lamb: FusedLamb, a CUDA kernel; removed 1-bit types: no class
        raise ValueError(f"DeepSpeed's engine builds no {name!r} optimizer on this machine")
    cls = getattr(torch.optim, name)
    p = {**_signature_defaults(cls), **params}
    if cls is torch.optim.SGD:
        return ("sgd", p["lr"], p["weight_decay"], p["momentum"]), p["lr"]
    return (name.lower(), p["lr"]), p["lr"]


def _trajectory(opt: torch.optim.Optimizer, step: Callable[[], None], steps: int,
                betas: list[tuple[float, float]] | None = None) -> list[float]:
    """The rate of each optimizer step (no parameter moves: only the schedule is stepped); `betas` collects
    Adam's (beta1, beta2) at each step (OneCycle cycles them)."""
    lrs = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        for _ in range(steps):
            lrs.append(float(opt.param_groups[0]["lr"]))
            if betas is not None:
                betas.append(tuple(opt.param_groups[0]["betas"]))
            step()
    return lrs


def _cycles_betas(ds: dict[str, Any], opt: torch.optim.Optimizer) -> list[tuple[float, float]] | None:
    """A list to collect betas in when OneCycle drives an Adam-family optimizer, else None."""
    onecycle = (ds.get("scheduler") or {}).get("type") == "OneCycle"
    return [] if onecycle and "betas" in opt.defaults else None


def deepspeed_reading(ds: dict[str, Any], *, dp: int, steps: int) -> Reading:
    try:
        with mock.patch.object(deepspeed.comm, "get_rank", lambda *a, **k: 0):
            c = DeepSpeedConfig(copy.deepcopy(ds), mpu=DataParallelMpu(dp))
        rows: dict[str, Any] = {
            "batch": (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps),
            "clip": c.gradient_clipping or None,
            "dtype": "fp16" if c.float16_config.enabled else "bf16" if c.bfloat16_config.enabled else "fp32",
        }
        f = c.float16_config
        if f.enabled:
            rows["fp16"] = (float(f.loss_scale), float(2**f.initial_scale_power), f.loss_scale_window, f.hysteresis,
                            f.consecutive_hysteresis, float(f.min_loss_scale))[:6 if f.loss_scale == 0 else 1]
        if "optimizer" in ds:
            rows["optim"], lr = _ds_optimizer(c.optimizer_name, c.optimizer_params,
                                              dynamic_scale=c.float16_config.loss_scale == 0)
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
            if c.optimizer_name and c.optimizer_name.lower() in ("adam", "adamw", "lamb"):  # with its betas
                opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr, betas=rows["optim"][3])
            if c.scheduler_name is not None:
                sched = getattr(lr_schedules, c.scheduler_name)(opt, **(c.scheduler_params or {}))
                betas = _cycles_betas(ds, opt)
                rows["lr"] = _trajectory(opt, sched.step, steps, betas)
                if betas is not None:
                    rows["betas"] = betas
            else:
                rows["lr"] = [lr] * steps
        return Reading(rows=rows)
    except (AssertionError, ValueError, TypeError, KeyError, AttributeError) as e:
        return Reading(refused=f"{type(e).__name__}: {e}")
    except Exception as e:  # pydantic's ValidationError, DeepSpeedConfigError
        return Reading(refused=f"{type(e).__name__}: {str(e).splitlines()[0]}")


def dptrain_reading(ds: dict[str, Any], *, dp: int, steps: int) -> Reading:
    try:
        m = translate_deepspeed(copy.deepcopy(ds))
        cfg = build_config(m.config)
        p = cfg.parallel
        pp = p.pp if isinstance(p.pp, int) and p.pp > 0 else 1
        res = resolve(cfg, world_size=dp * pp * max(1, p.tp), cuda_available=False)
    except ConfigError as e:
        return Reading(refused=f"ConfigError: {e}")
    o, pr = cfg.optim, cfg.precision
    g, mb, a = res.global_batch_size, res.micro_batch_size, res.grad_accum_steps
    if res.dims.pp > 1:  # back to DeepSpeed's terms: GAS pipeline micro-batches of its micro-batch
        n = settle_pipeline(p, micro_batch_size=mb, pp=res.dims.pp).pp_microbatches or res.dims.pp
        mb, a = mb // n, n
    rows: dict[str, Any] = {"batch": (g, mb, a), "clip": o.grad_clip, "dtype": pr.dtype}
    if pr.dtype == "fp16":
        rows["fp16"] = (pr.static_loss_scale, pr.init_scale, pr.growth_interval, pr.hysteresis,
                        pr.consecutive_hysteresis, float(pr.min_loss_scale))[:6 if pr.static_loss_scale == 0 else 1]
    if "optimizer" in ds:
        if o.name == "sgd":
            rows["optim"] = ("sgd", res.lr, o.weight_decay, o.momentum)
        elif o.name == "lamb":
            rows["optim"] = ("lamb", res.lr, *(tuple(v) if k == "betas" else v
                                               for k, v in ((k, getattr(o, k)) for k in LAMB_ROW[1:])))
        else:
            rows["optim"] = (o.name, res.lr, o.weight_decay, tuple(o.betas), o.eps)
        cls, kw = optimizer_spec(o, lr=res.lr)
        opt = cls([torch.nn.Parameter(torch.zeros(1))], **kw)
        sched = build_scheduler(opt, cfg=o, max_steps=cfg.train.max_steps)
        betas = _cycles_betas(ds, opt)
        rows["lr"] = _trajectory(opt, sched.step, steps, betas)
        if betas is not None:
            rows["betas"] = betas
    return Reading(rows=rows)


def lr_agree(a: list[float], b: list[float]) -> bool:
    if len(a) != len(b):
        return False
    return all(math.isclose(x, y, rel_tol=LR_REL_TOL, abs_tol=0.0) for x, y in zip(a, b, strict=True))


def compare(ds: dict[str, Any], *, dp: int, steps: int = 60) -> list[tuple[str, bool, str]]:
    """(row, agree, detail) for accept/refuse and, when both accept, every row DeepSpeed has."""
    d, mine = deepspeed_reading(ds, dp=dp, steps=steps), dptrain_reading(ds, dp=dp, steps=steps)
    out = [("accept", (d.refused is None) == (mine.refused is None), f"deepspeed: {d.refused or 'accepts'}; "
            f"dptrain: {mine.refused or 'accepts'}")]
    if d.refused is None and mine.refused is None:
        for k in d.rows:
            x, y = d.rows[k], mine.rows.get(k)
            if k == "optim" and "scheduler" in ds:  # under a scheduler the rates are the lr row's business
                x, y = x[:1] + x[2:], y[:1] + y[2:]
            ok = lr_agree(x, y) if k == "lr" else x == y
            out.append((k, ok, "" if ok else f"deepspeed {x!r} dptrain {y!r}"[:400]))
    return out


def random_config(rng: random.Random) -> tuple[dict[str, Any], int]:
    """A config within DeepSpeed's schema (batch keys, optimizer, scheduler, fp16/bf16, clipping, ZeRO stage) and a
    data-parallel size, drawn from `rng`."""
    dp = rng.choice([1, 2, 4, 8])
    ds: dict[str, Any] = {}
    micro, gas = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3, 4])
    batch = {"train_batch_size": micro * gas * dp * rng.choice([1, 1, 1, 2]),
             "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
    keys = rng.choice([["train_batch_size"], ["train_micro_batch_size_per_gpu"],
                       ["train_batch_size", "train_micro_batch_size_per_gpu"],
                       ["train_batch_size", "gradient_accumulation_steps"],
                       ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps"], list(batch)])
    ds.update({k: batch[k] for k in keys})
    if rng.random() < 0.7:
        ds["gradient_clipping"] = rng.choice([0.0, 0.5, 1.0, 2.0])
    kind = rng.choice(["Adam", "AdamW", "SGD", "Adam"])
    params: dict[str, Any] = {"lr": rng.choice([1e-4, 3e-4, 1e-3, 0.01])}
    if kind != "SGD":
        for k, choices in (("betas", [[0.9, 0.999], [0.8, 0.95]]), ("eps", [1e-8, 1e-6]),
                           ("weight_decay", [0.0, 0.01, 0.1]), ("adam_w_mode", [True, False]),
                           ("torch_adam", [True, False])):
            if rng.random() < 0.4:
                params[k] = rng.choice(choices)
    else:
        for k, choices in (("momentum", [0.0, 0.9]), ("weight_decay", [0.0, 1e-4])):
            if rng.random() < 0.5:
                params[k] = rng.choice(choices)
    ds["optimizer"] = {"type": kind, "params": params}
    sched = rng.choice(["none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"])
    w, total = rng.choice([1, 2, 5, 10, 30]), rng.choice([20, 40, 60])
    sp: dict[str, Any] = {}
    if sched in ("WarmupLR", "WarmupDecayLR"):
        sp = {"warmup_num_steps": w, "warmup_type": rng.choice(["log", "linear"])}
        if rng.random() < 0.7:
            sp["warmup_max_lr"] = rng.choice([1e-3, 0.01])
        if rng.random() < 0.5:
            sp["warmup_min_lr"] = rng.choice([0.0, 1e-5, 1e-4])
        if sched == "WarmupDecayLR":
            sp["total_num_steps"] = total
    elif sched == "WarmupCosineLR":
        sp = {"warmup_num_steps": w, "total_num_steps": total, "warmup_type": rng.choice(["log", "linear"]),
              "cos_min_ratio": rng.choice([1e-4, 0.1]), "warmup_min_ratio": rng.choice([0.0, 0.1])}
    elif sched == "OneCycle":
        sp = {"cycle_min_lr": rng.choice([0.0, 1e-4]), "cycle_max_lr": rng.choice([1e-3, 0.1]),
              "cycle_first_step_size": rng.choice([3, 10]), "decay_step_size": rng.choice([0, 5]),
              "decay_lr_rate": rng.choice([0.0, 0.1]), "cycle_momentum": rng.choice([True, False])}
        if rng.random() < 0.5:
            sp["cycle_second_step_size"] = rng.choice([2, 7])
        if rng.random() < 0.3:
            sp["cycle_first_stair_count"] = rng.choice([1, 2])
    elif sched == "LRRangeTest":
        sp = {"lr_range_test_min_lr": rng.choice([1e-5, 1e-3]), "lr_range_test_step_size": rng.choice([1, 4, 10]),
              "lr_range_test_step_rate": rng.choice([0.1, 1.0]), "lr_range_test_staircase": rng.choice([True, False])}
    if sched != "none":
        ds["scheduler"] = {"type": sched, "params": sp}
    prec = rng.choice(["fp32", "fp16", "bf16"])
    if prec == "fp16":
        fp: dict[str, Any] = {"enabled": True}
        for k, choices in (("loss_scale", [0, 0, 128.0]), ("initial_scale_power", [8, 16, 32]),
                           ("loss_scale_window", [2, 100, 1000]), ("hysteresis", [1, 2, 4]),
                           ("consecutive_hysteresis", [False, True]), ("min_loss_scale", [1, 2])):
            if rng.random() < 0.5:
                fp[k] = rng.choice(choices)
        ds["fp16"] = fp
    elif prec == "bf16":
        ds["bf16"] = {"enabled": True}
    if rng.random() < 0.5:
        ds["zero_optimization"] = {"stage": rng.choice([0, 1, 2, 3])}
    return ds, dp


KNOWN_DIFFERENCES: list[tuple[Callable[[dict[str, Any], str], bool], str]] = [
    (lambda ds, row: not any(k in ds for k in BATCH_KEYS), "no batch key at all: DeepSpeed refuses (train_batch_size "
     "or train_micro_batch_size_per_gpu needs to be provided); dptrain warns and takes its built-in global 32 / micro "
     "8, so that train.* overrides on the command line can supply the batch"),
    (lambda ds, row: "auto" in repr(ds), 'Hugging Face\'s "auto": the HF Trainer fills it before DeepSpeed reads the '
     "file (DeepSpeedConfig alone refuses it); dptrain keeps its own value and lists it in config show"),
    (lambda ds, row: "max_grad_norm" in repr(ds), "optimizer.params.max_grad_norm: DeepSpeed 0.19's engine refuses "
     "it at initialize (older DeepSpeed passed it to FusedAdam); dptrain loads the file, warns that it is not used "
     "and clips by gradient_clipping"),
    (lambda ds, row: "DeepSpeed_Adam" in repr(ds), "optimizer.type DeepSpeed_Adam: the old name of DeepSpeedCPUAdam, "
     "which DeepSpeed 0.19's engine no longer resolves; dptrain reads it as Adam (adamw_mode true)"),
    (lambda ds, row: str((ds.get("optimizer") or {}).get("type", "")).lower() == "onebitlamb",
     "OneBitLamb: DeepSpeed 0.19.8's engine no longer builds it (its 1-bit optimizers left with the CUDA-only "
     "compressed backends); dptrain runs 1-bit LAMB itself (optim.name=onebit_lamb, Li et al. 2021, DeepSpeed's "
     "arithmetic on 1-bit Adam's torch.distributed exchange: train/onebit_lamb.py)"),
    (lambda ds, row: str((ds.get("optimizer") or {}).get("type", "")).lower() == "onebitadam",
     "OneBitAdam: DeepSpeed 0.19.8's engine no longer builds it (its 1-bit optimizers left with the CUDA-only "
     "compressed backends); dptrain runs 1-bit Adam itself (optim.name=onebit_adam, Tang et al. 2021, on "
     "torch.distributed collectives: train/onebit_adam.py)"),
]
"""Remaining differences from DeepSpeed 0.19, each with its reason (predicate on the config and the row)."""


def known_difference(ds: dict[str, Any], row: str) -> str | None:
    return next((why for test, why in KNOWN_DIFFERENCES if test(ds, row)), None)
