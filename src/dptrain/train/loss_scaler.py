"""DeepSpeed's fp16 loss scaling with GradScaler's interface, for configs read from a DeepSpeed file.

torch's GradScaler and DeepSpeed's `DynamicLossScaler` (deepspeed/runtime/fp16/loss_scaler.py) differ:

- growth: DeepSpeed doubles the scale when (iteration - last overflow iteration - 1) is a positive multiple
  of `loss_scale_window`, i.e. first after window + 1 clean steps, then every window; GradScaler after
  every `growth_interval` consecutive clean steps;
- hysteresis: DeepSpeed absorbs `hysteresis - 1` overflows before it halves (refilled at each growth, or
  at every clean step with `consecutive_hysteresis`); GradScaler halves on every overflow;
- floor: DeepSpeed never goes below `min_loss_scale`; GradScaler has none;
- static: DeepSpeed's `loss_scale` > 0 keeps the scale fixed (overflowing steps are still skipped).

At the floor DeepSpeed's ZeRO optimizers (DynamicLossScaler's raise_error_at_min_scale) stop the run, and its
stage-0 FP16_Optimizer stays there; this scaler stays at the floor and skips the step, and dptrain's
non-finite policy (diagnostics.max_consecutive_skips) decides when to stop.

Everything else is GradScaler's (torch.amp or FSDP's ShardedGradScaler, which agrees on overflows over the
world): scale, unscale_, step (skipped on inf/nan), state_dict. `update` applies DeepSpeed's rule and reads
the overflow flag on the host (GradScaler.step has already read it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from dptrain.config import PrecisionConfig


class DeepSpeedRule:
    """DeepSpeed's DynamicLossScaler.update_scale on plain numbers (also its static LossScaler)."""

    def __init__(self, cfg: PrecisionConfig) -> None:
        self.dynamic = cfg.static_loss_scale == 0
        self.scale = cfg.init_scale if self.dynamic else cfg.static_loss_scale
        self.window = cfg.growth_interval
        self.min_scale = cfg.min_loss_scale
        self.delayed_shift = cfg.hysteresis
        self.cur_hysteresis = cfg.hysteresis
        self.consecutive_hysteresis = cfg.consecutive_hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> float:
        """The scale after a step that did (or did not) overflow."""
        if self.dynamic:
            if overflow:
                if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                    self.scale = max(self.scale / 2.0, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
                self.last_overflow_iter = self.cur_iter
            else:
                if self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                stable = self.cur_iter - self.last_overflow_iter - 1
                if stable > 0 and stable % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self.cur_hysteresis = self.delayed_shift
                    self.scale *= 2.0
        self.cur_iter += 1
        return self.scale

    def state_dict(self) -> dict[str, Any]:
        return {"cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis, "ds_scale": self.scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cur_iter = int(sd["cur_iter"])
        self.last_overflow_iter = int(sd["last_overflow_iter"])
        self.cur_hysteresis = int(sd["cur_hysteresis"])
        self.scale = float(sd["ds_scale"])


class _DeepSpeedUpdate:
    """The part both scalers share: DeepSpeed's update, its state in the state dict, the last step's overflow."""

    rule: DeepSpeedRule
    overflowed: bool

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if new_scale is not None:
            super().update(new_scale)  # type: ignore[misc]
            return
        states = self._per_optimizer_states.values()  # type: ignore[attr-defined]
        found = [f for s in states for f in s["found_inf_per_device"].values()]
        if not found:
            raise AssertionError("No inf checks were recorded prior to update.")
        self.overflowed = bool(sum(float(f.item()) for f in found))
        super().update(float(self.rule.update(self.overflowed)))  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "deepspeed": self.rule.state_dict()}  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        ds = state_dict.pop("deepspeed", None)
        if ds is not None:
            self.rule.load_state_dict(ds)
        super().load_state_dict(state_dict)  # type: ignore[misc]


class DeepSpeedLossScaler(_DeepSpeedUpdate, torch.amp.GradScaler):
    """GradScaler whose scale follows DeepSpeed's loss scaler (module docstring)."""

    def __init__(self, device: str, cfg: PrecisionConfig) -> None:
        self.rule = DeepSpeedRule(cfg)
        self.overflowed = False
        super().__init__(device, init_scale=self.rule.scale, growth_interval=cfg.growth_interval, enabled=True)


class ShardedDeepSpeedLossScaler(_DeepSpeedUpdate, ShardedGradScaler):
    """ShardedGradScaler (FSDP2, pipelines: overflows agreed over the world) with DeepSpeed's scale rule."""

    def __init__(self, device: str, cfg: PrecisionConfig) -> None:
        self.rule = DeepSpeedRule(cfg)
        self.overflowed = False
        super().__init__(device=device, init_scale=self.rule.scale, growth_interval=cfg.growth_interval, enabled=True)


def build_deepspeed_scaler(cfg: PrecisionConfig, device: torch.device, *, sharded: bool) -> torch.amp.GradScaler:
    return (ShardedDeepSpeedLossScaler if sharded else DeepSpeedLossScaler)(device.type, cfg)
