"""DeepSpeed's fp16 loss scaling (train/loss_scaler.py) against DeepSpeed's own DynamicLossScaler
(deepspeed.runtime.fp16.loss_scaler): the same overflow pattern through both, the scale compared after every
step. Patterns: DeepSpeed's test_dynamic_loss_scale.py (test_no_overflow, test_all_overflow with floors 1 and
2, test_some_overflow), hysteresis 3, consecutive hysteresis, and seeded random mixes. Our scaler runs as the
trainer runs it: real fp16 gradients through scale / unscale_ / step / update, overflows made by inf/nan
gradients; GradScaler for YAML configs keeps torch's rule."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed (the reference) is not installed: .ci/run installs it")

from deepspeed.runtime.fp16 import loss_scaler as ds_scaler  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedFP16Config  # noqa: E402

from dptrain.config import PrecisionConfig  # noqa: E402
from dptrain.config.deepspeed import translate_deepspeed  # noqa: E402
from dptrain.config.load import build_config  # noqa: E402
from dptrain.train.precision import build_grad_scaler  # noqa: E402

pytestmark = pytest.mark.fast

INF = float("inf")


def _ours(fp16: dict, pattern: list[float]) -> list[float]:
    """Scales after each step of `pattern` (gradient values: inf/nan overflow) through dptrain's scaler, built from
    a DeepSpeed file's fp16 block as a run builds it."""
    cfg = build_config(translate_deepspeed({"train_batch_size": 1, "fp16": {"enabled": True, **fp16}}).config)
    scaler = build_grad_scaler(cfg.precision, torch.device("cpu"), sharded=False)
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    out = []
    for g in pattern:
        loss = (w * 1.0).sum()
        scaler.scale(loss).backward()
        w.grad.fill_(g)  # the gradient the pattern asks for (inf/nan: an overflow)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append(scaler.get_scale())
    return out


def _theirs(fp16: dict, pattern: list[float]) -> list[float]:
    """DeepSpeed's DynamicLossScaler with the arguments its config hands it (DeepSpeedFP16Config), fed the
    same overflow flags. At the floor it keeps the scale (raise_error_at_min_scale=False: dptrain skips the step
    and lets diagnostics decide)."""
    cfg = DeepSpeedFP16Config(enabled=True, **fp16)
    if cfg.loss_scale:
        return [float(cfg.loss_scale)] * len(pattern)  # static LossScaler: the scale never moves
    s = ds_scaler.DynamicLossScaler(**cfg.dynamic_loss_scale_args(), raise_error_at_min_scale=False)
    out = []
    with mock.patch.object(ds_scaler.dist, "get_rank", lambda *a, **k: 0):  # it logs overflows on rank 0
        for g in pattern:
            s.update_scale(not (abs(g) < INF))
            out.append(float(s.cur_scale))
    return out


PATTERNS = [
    ("test_no_overflow", {"loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2}, [0.05] * 10),
    ("test_all_overflow", {"initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1},
     [INF, -INF] + [float("nan")] * 6),
    ("test_all_overflow floor 2", {"initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1,
                                   "min_loss_scale": 2}, [INF, -INF] + [float("nan")] * 6),
    ("test_some_overflow", {"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1},
     [INF, float("nan"), 0.01, -0.02, 0.03, INF]),
    ("hysteresis 3", {"initial_scale_power": 8, "hysteresis": 3}, [INF] * 4 + [0.1] * 3),
    ("consecutive hysteresis", {"initial_scale_power": 8, "hysteresis": 2, "consecutive_hysteresis": True},
     [INF, 0.1] * 4),
    ("static", {"loss_scale": 128}, [0.1, INF, 0.1]),
    ("defaults, window 1000", {}, [0.1] * 5 + [INF] * 3),
]


@pytest.mark.parametrize(("fp16", "pattern"), [p[1:] for p in PATTERNS], ids=[p[0] for p in PATTERNS])
def test_trajectory_equals_deepspeeds(fp16: dict, pattern: list[float]) -> None:
    assert _ours(fp16, pattern) == _theirs(fp16, pattern)


def test_random_mixes_equal_deepspeeds() -> None:
    rng = random.Random(22)
    for _ in range(20):
        fp16 = {"initial_scale_power": rng.choice([4, 8, 16]), "loss_scale_window": rng.choice([1, 2, 3, 5]),
                "hysteresis": rng.choice([1, 2, 3]), "consecutive_hysteresis": rng.choice([False, True]),
                "min_loss_scale": rng.choice([1, 2, 4])}
        pattern = [INF if rng.random() < 0.3 else 0.01 for _ in range(40)]
        assert _ours(fp16, pattern) == _theirs(fp16, pattern), fp16


def test_torch_gradscaler_differs_and_stays_for_yaml_configs() -> None:
    """The DeepSpeed rule is not GradScaler's: on test_no_overflow GradScaler doubles one step earlier (window,
    not window + 1), and a YAML config (loss_scaler torch) still gets GradScaler."""
    scaler = build_grad_scaler(PrecisionConfig(dtype="fp16", init_scale=2.0**8, growth_interval=2),
                               torch.device("cpu"), sharded=False)
    assert type(scaler) is torch.amp.GradScaler
    fp16 = {"loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2}
    assert _ours(fp16, [0.05] * 3) == [256.0, 256.0, 512.0]  # DeepSpeed: doubles after window + 1 = 3 clean steps


def test_skipped_steps_leave_weights_and_state_resumes() -> None:
    """An overflow skips the optimizer step also while hysteresis keeps the scale; the state dict carries the
    hysteresis and overflow bookkeeping, so a resumed scaler continues DeepSpeed's trajectory."""
    cfg = build_config(translate_deepspeed({"train_batch_size": 1, "fp16": {
        "enabled": True, "initial_scale_power": 8, "hysteresis": 3, "loss_scale_window": 2}}).config)
    scaler = build_grad_scaler(cfg.precision, torch.device("cpu"), sharded=False)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    w.grad.fill_(INF)
    scaler.step(opt)
    scaler.update()
    assert torch.equal(w.detach(), torch.ones(2)) and scaler.get_scale() == 256.0 and scaler.overflowed
    fresh = build_grad_scaler(cfg.precision, torch.device("cpu"), sharded=False)
    fresh.load_state_dict(scaler.state_dict())
    assert fresh.rule.state_dict() == scaler.rule.state_dict() and fresh.rule.cur_hysteresis == 2
