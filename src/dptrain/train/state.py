"""A run's progress and its per-rank logging window: small Stateful objects the checkpoint saves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dptrain.train.loss_scaler import DeepSpeedLossScaler, ShardedDeepSpeedLossScaler


@dataclass
class TrainState:
    """Progress of a run; the step is global (the same on every rank and at every world size).
    fp16 steps the scaler skipped are counted on the device (`count_fp16_skip`) and read only when
    the state is (`sync`, `state_dict`): at a log line or a save, never per step."""

    step: int = 0
    samples_seen: int = 0
    skipped_steps: int = 0
    _unread_skips: torch.Tensor | None = field(default=None, repr=False)
    _scale_prev: torch.Tensor | None = field(default=None, repr=False)  # fp16: the scale before the next step

    def watch_loss_scale(self, scaler: torch.amp.GradScaler, *, device: torch.device) -> None:
        """fp16 (an enabled scaler): count the steps it skips from now on (`count_fp16_skip`)."""
        self._scale_prev = torch.full((), scaler.get_scale(), device=device) if scaler.is_enabled() else None

    def count_fp16_skip(self, scaler: torch.amp.GradScaler) -> None:
        """At each step boundary: the scaler skipped this step's optimizer.step() iff it lowered the
        scale (fp16 overflow). Compared on the device: `get_scale()` would be a host-device sync every
        step. Nothing without `watch_loss_scale` (fp32, bf16)."""
        if self._scale_prev is None:
            return
        if isinstance(scaler, DeepSpeedLossScaler | ShardedDeepSpeedLossScaler):  # hysteresis: skips keep the scale
            self.count_skip(torch.tensor(scaler.overflowed))  # read on the host by its update() already
            return
        scale = scaler._scale  # the device tensor behind get_scale(); set by the first scale()
        if scale is None:
            return
        self.count_skip(scale < self._scale_prev)
        self._scale_prev = scale.clone()  # update() changes the scale in place

    def count_skip(self, skipped: torch.Tensor) -> None:
        """Add a 0/1 device tensor without reading it."""
        self._unread_skips = skipped.long() if self._unread_skips is None else self._unread_skips + skipped

    def sync(self) -> None:
        """Fold the device-side count into `skipped_steps` (a host-device sync)."""
        if self._unread_skips is not None:
            self.skipped_steps += int(self._unread_skips.item())
            self._unread_skips = None

    def state_dict(self) -> dict[str, int]:
        self.sync()
        return {"step": self.step, "samples_seen": self.samples_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step, self.samples_seen = int(sd["step"]), int(sd["samples_seen"])
        self.skipped_steps, self._unread_skips = int(sd.get("skipped_steps", 0)), None


class LogWindow:
    """This rank's losses since the last log line (checkpointed per rank, so a resumed run logs the same
    numbers as an uninterrupted one). The trainer appends each step's loss to `losses` itself (a list
    append, no call into this module per step); `loss_sum` and `steps` are read at a log step or a save."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []  # the window's step losses (on the loss's device), in step order
        self._carried_sum: torch.Tensor | None = None  # a window that began before a resume: its sum and steps then
        self._carried_steps = 0

    def add(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach())

    @property
    def steps(self) -> int:
        return self._carried_steps + len(self.losses)

    @property
    def loss_sum(self) -> torch.Tensor:
        """The window's loss sum, added in step order from zero (the same float as a running sum)."""
        device = self.losses[0].device if self.losses else torch.device("cpu")
        total = torch.zeros((), device=device) if self._carried_sum is None else self._carried_sum.to(device)
        for loss in self.losses:
            total += loss
        return total

    def first_nonfinite_step(self, last_step: int) -> int | None:
        """The global step of this rank's first non-finite loss in the window that ends at `last_step`; None when
        every loss was finite (or the window began before a resume: then `last_step` if the sum is not finite)."""
        if self._carried_steps == 0 and self.losses:
            bad = (~torch.isfinite(torch.stack(self.losses).float())).nonzero()
            return last_step - self.steps + 1 + int(bad[0]) if len(bad) else None
        return None if bool(torch.isfinite(self.loss_sum)) else last_step

    def reset(self) -> None:
        self.losses.clear()  # the same list: the trainer holds it
        self._carried_sum, self._carried_steps = None, 0

    def state_dict(self) -> dict[str, Any]:
        return {"loss_sum": self.loss_sum.detach().cpu().clone(), "steps": self.steps}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.losses.clear()
        self._carried_sum, self._carried_steps = sd["loss_sum"].detach().clone(), int(sd["steps"])
