"""`dptrain.monitor(out_dir)`: `dptrain run`'s hang watchdog and metrics.jsonl for an own loop (opt-in).

    with dptrain.monitor("runs/mnist", loader=loader, optimizer=optimizer) as mon:
        for step, batch in ...:
            ...
            mon.step(step, loss)              # heartbeat; every log_every_steps: mean loss over ranks -> metrics.jsonl
        mon.log(step, val_loss=..., accuracy=...)

The watchdog is the Trainer's (diagnostics/watchdog.py, through the diagnostics hub): every rank's
thread publishes where its loop is; when a rank makes no progress for `hang_timeout_s`, every rank
writes its stacks to OUT_DIR/stacks/, the first one writes OUT_DIR/hang_report.txt naming the rank(s)
that are not where the others are (e.g. not inside the collective the others wait in), and all exit
with status 3. Progress is a `step()` (or a `phase()`) call: mark long stretches without steps
(evaluation, saving) with `mon.phase("eval")` so a slow but healthy stretch is not taken for a hang,
or raise `hang_timeout_s`.

metrics.jsonl holds the same records as `dptrain run`'s (strict JSON, one object per line, rank 0
writes): `step`, `loss` (the mean over the log window and over the ranks), `step_time_s`,
`samples_per_s` and `samples_seen` when the loader is given, `lr` when the optimizer is, and any
extra values passed. It is opened at the first record, so a `Checkpointer.resume()` in the same
out_dir first cuts it back to the resumed step.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dptrain.api.setup import process_group_timeout
from dptrain.config import ConfigError, DiagnosticsConfig
from dptrain.config.resolve import validate_diagnostics
from dptrain.data import EpochLoader
from dptrain.diagnostics import Diagnostics
from dptrain.distributed import collectives
from dptrain.distributed.env import DistEnv
from dptrain.metrics.sinks import JsonlSink


def _number(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) else v


class LoopMonitor:
    """The watchdog and metrics.jsonl of one own loop on one rank; see the module doc."""

    def __init__(
        self, out_dir: str | os.PathLike[str], *, hang_timeout_s: float | None = None, log_every_steps: int = 10,
        loader: EpochLoader | None = None, optimizer: torch.optim.Optimizer | None = None,
        model: nn.Module | None = None, drift_every_steps: int = 0, desync_after_s: float = 5.0,
        collective_check_every_steps: int = 0,
    ) -> None:
        if not dist.is_initialized():
            raise ConfigError("dptrain.monitor needs the process group: call dptrain.init_distributed() first")
        if not isinstance(log_every_steps, int) or log_every_steps < 1:
            raise ConfigError(f"monitor(log_every_steps={log_every_steps!r}): must be an integer >= 1")
        if drift_every_steps and model is None:
            raise ConfigError("monitor(drift_every_steps=...) compares the model's replicas: pass model=")
        pg_timeout = process_group_timeout()
        cfg = DiagnosticsConfig(hang_timeout_s=hang_timeout_s, preflight=False, straggler_every_steps=0,
                                drift_every_steps=drift_every_steps, rss_every_steps=0,
                                desync_after_s=desync_after_s,
                                collective_check_every_steps=collective_check_every_steps)
        try:
            validate_diagnostics(cfg, pg_timeout_s=pg_timeout)
        except ConfigError as e:
            raise ConfigError(f"dptrain.monitor: {e} (parallel.timeout_s is init_distributed's timeout_s)") from None
        self.out_dir = Path(out_dir)
        self.env = DistEnv.from_env()
        self.log_every_steps, self.loader, self.optimizer = log_every_steps, loader, optimizer
        self.diag = Diagnostics(cfg, env=self.env, run_dir=self.out_dir, pg_timeout_s=pg_timeout)
        self.hang_timeout_s = self.diag.hang_timeout_s
        self.diag.start(model if model is not None else nn.Module(), step=0, device=torch.device("cpu"))
        self._jsonl: JsonlSink | None = None
        self._loss_sum: torch.Tensor | float = 0.0
        self._steps = 0
        self._window_start = time.perf_counter()
        self.last_loss: float | None = None

    # ------------------------------------------------------------------ the loop
    def phase(self, name: str) -> None:
        """The loop enters `name` (e.g. "eval", "save"): progress for the watchdog, and where the hang report
        says this rank was."""
        self.diag.phase(name)

    def step(self, step: int, loss: torch.Tensor | float | None = None, **values: Any) -> float | None:
        """After optimizer step `step`, on every rank: a heartbeat; every `log_every_steps` steps the window's
        mean loss over the ranks (one all-reduce; every rank must pass a loss at the same steps) goes to
        metrics.jsonl with `values`. Returns that mean at a log step, else None."""
        self.diag.on_step_end(step)
        if loss is not None:
            self._loss_sum = self._loss_sum + (loss.detach() if isinstance(loss, torch.Tensor) else float(loss))
            self._steps += 1
        logged = None
        if step % self.log_every_steps == 0:
            logged = self._log_window(step, values)
        self.diag.phase("train", collective="")  # the log's all-reduce is over: name no collective
        return logged

    def _log_window(self, step: int, values: dict[str, Any]) -> float | None:
        elapsed, window = time.perf_counter() - self._window_start, self._steps
        record: dict[str, Any] = {}
        if window:
            self.diag.phase("log", collective="all_reduce (monitor: mean loss over the ranks)")
            local = float(_number(self._loss_sum)) / window
            device = self._loss_sum.device if isinstance(self._loss_sum, torch.Tensor) else torch.device("cpu")
            if dist.get_backend() == "nccl" and device.type != "cuda":
                device = torch.device("cuda", torch.cuda.current_device())
            self.last_loss = collectives.all_reduce_mean([local], device=device)[0]
            record["loss"] = self.last_loss
            self.diag.logged_loss(self.last_loss, step=step, window_steps=window, device=device,
                                  first_bad=lambda: None if math.isfinite(local) else step)
            record.update(step_time_s=elapsed / window)
            if self.loader is not None:
                record.update(samples_per_s=window * self.loader.global_batch_size / max(elapsed, 1e-9),
                              samples_seen=self.loader.step * self.loader.global_batch_size)
        if self.optimizer is not None:
            record["lr"] = float(self.optimizer.param_groups[0]["lr"])
        record.update({k: _number(v) for k, v in values.items()})
        if record:
            self._write({"step": step, **record})
        self._loss_sum, self._steps, self._window_start = 0.0, 0, time.perf_counter()
        return self.last_loss if window else None

    def log(self, step: int, **values: Any) -> None:
        """A record of already-reduced values (val_loss, accuracy, ...) at `step`; rank 0 writes it."""
        self.diag.phase("log")
        self._write({"step": step, **{k: _number(v) for k, v in values.items()}})

    def _write(self, record: dict[str, Any]) -> None:
        if not self.env.is_main:
            return
        if self._jsonl is None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = JsonlSink(self.out_dir / "metrics.jsonl")
        self._jsonl.write(record)

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Stop the watchdog, close metrics.jsonl."""
        self.diag.close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> LoopMonitor:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def monitor(
    out_dir: str | os.PathLike[str], *, hang_timeout_s: float | None = None, log_every_steps: int = 10,
    loader: EpochLoader | None = None, optimizer: torch.optim.Optimizer | None = None, model: nn.Module | None = None,
    drift_every_steps: int = 0, desync_after_s: float = 5.0, collective_check_every_steps: int = 0,
) -> LoopMonitor:
    """Arm the hang watchdog and open metrics.jsonl for an own loop (after `init_distributed`, on every rank).
    `hang_timeout_s`: seconds without progress before the report (default min(300, half the process-group
    timeout); 0: no watchdog). `drift_every_steps`: compare `model`'s replicas every N steps (0: off).
    `desync_after_s`, `collective_check_every_steps`: as diagnostics.* of `dptrain run` (a collective that waited
    this long while the ranks' collectives disagree ends the job at once; compare them every N steps)."""
    return LoopMonitor(out_dir, hang_timeout_s=hang_timeout_s, log_every_steps=log_every_steps, loader=loader,
                       optimizer=optimizer, model=model, drift_every_steps=drift_every_steps,
                       desync_after_s=desync_after_s, collective_check_every_steps=collective_check_every_steps)
