"""Learning-rate schedules: dptrain's own (unchanged) and DeepSpeed's WarmupLR / WarmupDecayLR /
WarmupCosineLR reproduced exactly, compared with their closed-form formulas at several steps.

DeepSpeed's engine calls `lr_scheduler.step()` after every optimizer step and the scheduler starts at
iteration -1, so optimizer step s (0-based) trains at scheduler iteration s - 1. The formulas below are
those of deepspeed/runtime/lr_schedules.py, written out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from dptrain.config.deepspeed import from_deepspeed
from dptrain.config.load import build_config
from dptrain.train.optim import build_scheduler, lr_lambda

pytestmark = pytest.mark.fast


def _trained_lrs(optim_cfg, *, max_steps: int, peak: float, steps: int) -> list[float]:
    """The lr each optimizer step trains at, read off a real optimizer driven by build_scheduler."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = build_scheduler(opt, cfg=optim_cfg, max_steps=max_steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def _ds(scheduler: dict, lr: float = 1e-3) -> tuple:
    d, _ = from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": lr}}, "scheduler": scheduler})
    cfg = build_config(d)
    return cfg.optim, cfg.train.max_steps


def test_dptrain_convention_unchanged() -> None:
    kw = {"warmup_steps": 4, "max_steps": 14, "schedule": "cosine", "min_lr_ratio": 0.1}
    assert [lr_lambda(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_lambda(4, **kw) == pytest.approx(1.0)
    assert lr_lambda(9, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_lambda(14, **kw) == pytest.approx(0.1)


def test_dptrain_log_warmup_and_start_ratio() -> None:
    kw = {"warmup_steps": 9, "max_steps": 20, "schedule": "constant", "min_lr_ratio": 0.0,
          "warmup_type": "log", "warmup_start_ratio": 0.5}
    for s in (0, 3, 8):
        assert lr_lambda(s, **kw) == pytest.approx(0.5 + 0.5 * math.log(s + 2) / math.log(10))
    assert lr_lambda(8, **kw) == pytest.approx(1.0) and lr_lambda(9, **kw) == 1.0


@pytest.mark.parametrize("wtype", ["log", "linear"])
def test_deepspeed_warmup_lr(wtype: str) -> None:
    o, max_steps = _ds({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3,
                                                        "warmup_num_steps": 10, "warmup_type": wtype}})
    lrs = _trained_lrs(o, max_steps=max_steps, peak=o.lr, steps=14)

    def ds_lr(it: int) -> float:  # WarmupLR.get_lr at iteration it
        if it < 0:
            return 1e-4
        if it < 10:
            gamma = math.log(it + 1) / math.log(10) if wtype == "log" else it / 10
            return 1e-4 + (1e-3 - 1e-4) * gamma
        return 1e-3

    for s in (0, 1, 2, 5, 9, 10, 11, 13):
        assert lrs[s] == pytest.approx(ds_lr(s - 1), rel=1e-12), s


def test_deepspeed_warmup_decay_lr_decays_to_warmup_min_lr() -> None:
    o, max_steps = _ds({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3,
                                                             "warmup_num_steps": 4, "total_num_steps": 12}})
    assert max_steps == 12 and o.warmup_type == "log"
    lrs = _trained_lrs(o, max_steps=max_steps, peak=o.lr, steps=14)

    def ds_lr(it: int) -> float:
        if it < 0:
            return 1e-4
        if it < 4:
            return 1e-4 + 9e-4 * math.log(it + 1) / math.log(4)
        return 1e-4 + 9e-4 * max(0.0, (12 - it) / max(1.0, 12 - 4))

    for s in (0, 1, 3, 4, 5, 8, 12, 13):
        assert lrs[s] == pytest.approx(ds_lr(s - 1), rel=1e-12), s
    assert lrs[13] == pytest.approx(1e-4)  # the floor is warmup_min_lr, not min_lr_ratio 0.1


def test_deepspeed_warmup_cosine_lr() -> None:
    o, max_steps = _ds({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "total_num_steps": 20,
                                                              "warmup_min_ratio": 0.2}}, lr=2e-3)
    assert o.min_lr_ratio == 1e-4  # DeepSpeed's cos_min_ratio default
    lrs = _trained_lrs(o, max_steps=max_steps, peak=o.lr, steps=21)

    def ds_ratio(it: int) -> float:  # WarmupCosineLR.get_lr_ratio
        if it < 0:
            return 0.0
        if it < 5:
            return 0.2 + 0.8 * math.log(it + 1) / math.log(5)
        r = (1 + math.cos(math.pi * (it - 5 + 1) / (20 - 5))) / 2
        return max(0.0, 1e-4 + (1 - 1e-4) * r)

    for s in (0, 1, 3, 5, 6, 10, 15, 20):
        assert lrs[s] == pytest.approx(2e-3 * ds_ratio(s - 1), rel=1e-12, abs=1e-15), s


def test_deepspeed_one_step_warmup_is_two() -> None:
    """DeepSpeed warms up over max(2, warmup_num_steps) iterations."""
    o, max_steps = _ds({"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 1,
                                                        "warmup_type": "linear"}})
    lrs = _trained_lrs(o, max_steps=max_steps, peak=o.lr, steps=4)
    assert lrs == pytest.approx([0.0, 0.0, 0.5e-3, 1e-3])


@pytest.mark.timeout(120)
def test_logged_lr_is_the_rate_each_step_trained_at(tmp_path) -> None:
    """metrics.jsonl's `lr` at step s (1-based) is the rate optimizer step s used (lr_lambda(s - 1)),
    not the next step's: checked on a linear warmup, where every step's rate differs."""
    import json

    from support.parity import overrides, train

    items = [*overrides(strategy="single", world_size=1, accum=1, steps=6), "optim.warmup_steps=4",
             "optim.schedule=cosine", "optim.min_lr_ratio=0.1", "optim.warmup_type=linear", "optim.lr=0.05"]
    _, records = train(items, 1, tmp_path)
    logged = {r["step"]: r["lr"] for r in records if "lr" in r}
    cfg = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(logged) == list(range(1, cfg["steps"] + 1))
    kw = {"warmup_steps": 4, "max_steps": 6, "schedule": "cosine", "min_lr_ratio": 0.1, "warmup_type": "linear"}
    want = {s: 0.05 * lr_lambda(s - 1, **kw) for s in logged}
    assert logged == pytest.approx(want, rel=1e-12)
    assert logged[1] == pytest.approx(0.05 * 0.25)  # the first step trains at a quarter of the peak
