"""DeepSpeed's OneCycle and LRRangeTest (deepspeed/runtime/lr_schedules.py) as torch LR schedulers.

DeepSpeed steps its scheduler after each optimizer step, so optimizer step s (0-based) trains at the
schedule's iteration s - 1, the value its constructor sets for s = 0. These classes are torch
`LRScheduler`s whose `last_epoch` counts optimizer steps: at last_epoch e the rate is DeepSpeed's at
iteration e - 1, computed with DeepSpeed's arithmetic in DeepSpeed's order (bit-identical rates,
tests/test_deepspeed_conformance.py). Learning rates are absolute (DeepSpeed's parameters), not
multiples of optim.lr. OneCycle with cycle_momentum also cycles beta1 of Adam-family optimizers and
sets beta2 to 0.99, as DeepSpeed does; for optimizers without betas (SGD) momentum is not cycled.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from dptrain.config.deepspeed.scheduler import LR_RANGE_TEST_PARAMS, ONECYCLE_PARAMS


class OneCycle(LRScheduler):
    """DeepSpeed's OneCycle: a cycle up from cycle_min_lr to cycle_max_lr and back, then an optional decay."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: dict[str, Any], last_epoch: int = -1) -> None:
        p = {**ONECYCLE_PARAMS, **params}
        first = float(p["cycle_first_step_size"])
        second = float(p["cycle_second_step_size"]) if p["cycle_second_step_size"] is not None else first
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = p["cycle_first_stair_count"]
        second_stairs = p["cycle_second_stair_count"]
        self.second_stair_count = self.first_stair_count if second_stairs is None else second_stairs
        self.decay_step_size = p["decay_step_size"]
        self.min_lr, self.max_lr = p["cycle_min_lr"], p["cycle_max_lr"]
        self.decay_lr_rate = p["decay_lr_rate"]
        no_decay = math.isclose(self.decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        self.cycle_momentum = bool(p["cycle_momentum"]) and "betas" in optimizer.defaults
        self.min_mom, self.max_mom = p["cycle_min_mom"], p["cycle_max_mom"]
        self.decay_mom_rate = p["decay_mom_rate"]
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        super().__init__(optimizer, last_epoch)

    def _scale_factor(self, it: int) -> float:
        batch_iteration = it + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor = x / self.step_ratio
            stair_count = self.first_stair_count
        else:
            scale_factor = (x - 1) / (self.step_ratio - 1)
            stair_count = self.second_stair_count
        if stair_count > 0:
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                stair_position = cycle_iteration * stair_count / self.first_step_size
            else:
                stair_position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(stair_position) / stair_count
        return scale_factor

    def lr_at(self, it: int) -> float:
        """DeepSpeed's rate at its iteration `it` (-1: before the first step)."""
        if it < 0:
            return self.min_lr
        if it < self.total_size:
            return self.min_lr + (self.max_lr - self.min_lr) * self._scale_factor(it)
        if self.skip_lr_decay:
            return self.min_lr
        decay_interval = (it - self.total_size + 1) / self.decay_step_size
        return self.min_lr / (1 + self.decay_lr_rate * decay_interval)

    def betas_at(self, it: int) -> tuple[float, float]:
        """DeepSpeed's (beta1, beta2) at iteration `it` (beta2 is 0.99 throughout, as DeepSpeed sets it)."""
        if it < 0:
            return (self.min_mom, 0.99)
        if it < self.total_size:
            return (self.max_mom - (self.max_mom - self.min_mom) * self._scale_factor(it), 0.99)
        if self.skip_mom_decay:
            return (self.max_mom, 0.99)
        decay_interval = (it - self.total_size + 1) / self.decay_step_size
        return (self.max_mom * (1 + self.decay_mom_rate * decay_interval), 0.99)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        if self.cycle_momentum:
            for group in self.optimizer.param_groups:
                group["betas"] = self.betas_at(self.last_epoch - 1)
        return [self.lr_at(self.last_epoch - 1)] * len(self.optimizer.param_groups)


class LRRangeTest(LRScheduler):
    """DeepSpeed's LRRangeTest: min_lr x (1 + step_rate x interval), interval continuous or a staircase."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: dict[str, Any], last_epoch: int = -1) -> None:
        p = {**LR_RANGE_TEST_PARAMS, **params}
        self.min_lr = p["lr_range_test_min_lr"]
        self.step_size = p["lr_range_test_step_size"]
        self.step_rate = p["lr_range_test_step_rate"]
        self.staircase = bool(p["lr_range_test_staircase"])
        super().__init__(optimizer, last_epoch)

    def lr_at(self, it: int) -> float:
        """DeepSpeed's rate at its iteration `it` (-1: before the first step, min_lr)."""
        if self.staircase:
            interval: float = math.floor(float(it + 1) / self.step_size)
        else:
            interval = float(it + 1) / self.step_size
        return self.min_lr * (1 + self.step_rate * interval)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [self.lr_at(self.last_epoch - 1)] * len(self.optimizer.param_groups)


SCHEDULERS = {"onecycle": OneCycle, "lr_range_test": LRRangeTest}
"""optim.schedule values these classes implement."""
