"""What a run's log records and its summary say: the throughput clock (training time between log
lines, evaluation excluded), samples and tokens per second, bits per byte, the meters' fields
(metrics/meters.py), the fp16 scaler's counters. Built by the trainer after its `_build`; the
records are handed to dptrain/train/outputs.py. Nothing here issues a collective; the fp16 counters are
read off the device only at a log step and at the end, like the loss.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dptrain import __version__

if TYPE_CHECKING:
    from dptrain.config import Resolved
    from dptrain.diagnostics import Diagnostics
    from dptrain.metrics.meters import RunMeters
    from dptrain.train.state import TrainState


class Records:
    """Log records and summary.json's fields of one run on one rank."""

    def __init__(
        self, *, res: Resolved, strategy: str, precision: str, state: TrainState, scaler: torch.amp.GradScaler,
        device: torch.device, meters: RunMeters, tokens_per_sample: int | None, bytes_per_token: int,
    ) -> None:
        self.res = res
        self.strategy = strategy
        self.precision = precision
        self.state = state
        self.scaler = scaler
        self.meters = meters
        self.tokens_per_sample = tokens_per_sample
        self.bytes_per_token = bytes_per_token
        self.train_time = 0.0  # seconds of training counted by the log windows so far
        self.window_start = time.perf_counter()
        # samples trained: counted by the trainer per step (a token-budget batch holds a varying number of rows)
        self.samples_at_start = self.logged_samples = state.samples_seen

    def restart_window(self) -> None:
        """The next log window starts now (after a log line, or after an evaluation: not training time)."""
        self.window_start = time.perf_counter()

    def log_record(self, *, loss: float, window_steps: int, lr: float, grad_norm: torch.Tensor) -> dict[str, Any]:
        """A log step's record; `loss` is already reduced over the ranks. Adds the window's time to
        the training time (the window is restarted by the caller, after it logged)."""
        state = self.state
        elapsed = time.perf_counter() - self.window_start
        self.train_time += elapsed
        record = self.throughput(window_steps, elapsed, samples=state.samples_seen - self.logged_samples)
        self.logged_samples = state.samples_seen
        record.update(self.meters.record(record))  # comm means over the window, per-rank rates, MFU
        record.update(step=state.step, loss=loss, lr=lr, grad_norm=float(grad_norm), samples_seen=state.samples_seen)
        if self.scaler.is_enabled():
            state.sync()
            record.update(loss_scale=self.scaler.get_scale(), skipped_steps=state.skipped_steps)
        return record

    def summary(
        self, *, last_loss: float | None, initial_val: float | None, final_val: float | None,
        times: dict[str, float], steps_here: int, diag: Diagnostics, resumed_from: Path | None,
    ) -> dict[str, Any]:
        """summary.json; throughput counts the steps trained in this process (a resumed run's own)."""
        res, state = self.res, self.state
        throughput = self.throughput(steps_here, times["train_s"], samples=state.samples_seen - self.samples_at_start)
        summary: dict[str, Any] = {
            "steps": state.step,
            "final_loss": last_loss,
            "initial_val_loss": initial_val,
            "final_val_loss": final_val,
            "world_size": res.world_size,
            "strategy": self.strategy,
            "precision": self.precision,
            "global_batch_size": res.global_batch_size,
            "samples_seen": state.samples_seen,
            **times,
            **throughput,
            **self.meters.summary(throughput),  # communication, per-rank rates, MFU
            "dptrain_version": __version__,
            "torch_version": torch.__version__,
            **diag.summary(),
        }
        if resumed_from is not None:
            summary["resumed_from"] = str(resumed_from)
        if final_val is not None and (bpb := self.bits_per_byte(final_val)) is not None:
            summary["final_val_bpb"] = bpb
        if self.scaler.is_enabled():
            state.sync()
            summary["skipped_steps"] = state.skipped_steps
        return summary

    def bits_per_byte(self, loss: float) -> float | None:
        """Bits per byte for byte-level token data (TokenChunks), else None."""
        if not self.tokens_per_sample or self.bytes_per_token != 1:
            return None
        return loss / math.log(2)

    def throughput(self, steps: int, seconds: float, *, samples: int | None = None) -> dict[str, float]:
        """Rates over `steps` steps of `seconds`; `samples` trained in them (default: whole global batches)."""
        trained = steps * self.res.global_batch_size if samples is None else samples
        samples_per_s = trained / max(seconds, 1e-9)
        out = {"samples_per_s": samples_per_s, "step_time_s": seconds / max(steps, 1)}
        if self.tokens_per_sample:
            out["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        return out
