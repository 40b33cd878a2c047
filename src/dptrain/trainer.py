"""The training loop. `Trainer(cfg).fit()` is what `dptrain run` executes on every rank.

The optimisation step (`train_step`) is deliberately short and explicit: micro-steps that skip
the gradient reduction until the last one, loss divided by the number of micro-steps, scaled
backward, unscale, clip, step, update, zero_grad. Everything else (building, logging,
evaluation, saving) sits around it.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain import __version__
from dptrain.build import build_datasets, build_loss_fn, build_model, import_object, to_device
from dptrain.checkpoint.manager import CheckpointManager
from dptrain.config import Config, Resolved, default_out_dir, resolve, to_dict
from dptrain.config.load import dump_yaml
from dptrain.data import GlobalBatchSampler, build_dataloader
from dptrain.diagnostics import Diagnostics, apply_collective_checks
from dptrain.distributed import collectives
from dptrain.distributed.env import DistEnv
from dptrain.distributed.process_group import bind_device, process_group
from dptrain.metrics import strict_json
from dptrain.metrics.sinks import ConsoleSink, JsonlSink, print_summary
from dptrain.optim import build_optimizer, build_scheduler
from dptrain.parallel import (
    apply_strategy,
    clip_grad_norm_,
    full_state_dict,
    is_sharded,
    sync_gradients,
    unwrap,
)
from dptrain.precision import autocast, build_grad_scaler


@dataclass
class TrainState:
    """Progress of a run; the step is global (the same on every rank and at every world size)."""

    step: int = 0
    samples_seen: int = 0
    skipped_steps: int = 0


class LogWindow:
    """This rank's loss sum and step count since the last log line (checkpointed per rank, so a
    resumed run logs the same numbers as an uninterrupted one)."""

    def __init__(self) -> None:
        self.loss_sum = torch.zeros(())
        self.steps = 0

    def add(self, loss: torch.Tensor) -> None:
        if self.loss_sum.device != loss.device:
            self.loss_sum = self.loss_sum.to(loss.device)
        self.loss_sum += loss
        self.steps += 1

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.loss_sum.device)
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"loss_sum": self.loss_sum.detach().cpu().clone(), "steps": self.steps}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loss_sum = sd["loss_sum"].to(self.loss_sum.device)
        self.steps = int(sd["steps"])


class Trainer:
    """Config in, run directory out."""

    def __init__(
        self, cfg: Config, *, out_dir: str | Path | None = None, env: DistEnv | None = None,
        resume: str = "auto", trust_checkpoint: bool = False,
    ) -> None:
        self.cfg = cfg
        self.env = env or DistEnv.from_env()
        self.res: Resolved = resolve(cfg, world_size=self.env.world_size)
        self.run_dir = Path(out_dir or default_out_dir(cfg))
        self.state = TrainState()
        self.log_window = LogWindow()
        self.ckpt = CheckpointManager(cfg=cfg, run_dir=self.run_dir, env=self.env, resume=resume, trust=trust_checkpoint)
        # Watchdog, pre-flight, non-finite policy, stragglers, drift, memory: idle until start().
        self.diag = Diagnostics(cfg.diagnostics, env=self.env, run_dir=self.run_dir,
                                pg_timeout_s=cfg.parallel.timeout_s, say=self._say)

    # ---------------------------------------------------------------- building
    def setup(self) -> None:
        """Build model, optimizer and data, then resume if a checkpoint says so. Call it inside the
        process group (`fit` does); afterwards `train_step()` can be called directly (benchmarks)."""
        self._build()
        self.ckpt.maybe_resume(self)  # model, optimizer, schedule, scaler, RNG, data position
        self.batches: Iterator[Any] = iter(self.loader)  # starts at the (resumed) global step

    def _build(self) -> None:
        cfg, res = self.cfg, self.res
        model = build_model(cfg.model, seed=cfg.train.seed)
        # Before any wrapper's own collectives: all ranks agree on world size, config and model.
        self.diag.preflight(model, config=to_dict(cfg))
        self.model: nn.Module = apply_strategy(model, cfg=cfg.parallel, device=self.device)
        self.optimizer = build_optimizer(
            self.model, cfg=cfg.optim, lr=res.lr, shard_state=cfg.parallel.strategy == "zero1"
        )
        self.scheduler = build_scheduler(self.optimizer, cfg=cfg.optim, max_steps=cfg.train.max_steps)
        self.scaler = build_grad_scaler(cfg.precision, self.device, sharded=is_sharded(self.model))
        self.loss_fn = build_loss_fn(cfg.train.loss)
        self.collate = import_object(cfg.data.collate) if cfg.data.collate else None
        self.train_ds, self.val_ds = build_datasets(cfg.data)
        self.sampler = GlobalBatchSampler(
            dataset_len=len(self.train_ds),
            global_batch_size=res.global_batch_size,
            micro_batch_size=res.micro_batch_size,
            grad_accum_steps=res.grad_accum_steps,
            dp_rank=self.env.rank,
            dp_world_size=res.dp_world_size,
            seed=cfg.train.seed,
            shuffle=cfg.data.shuffle,
            start_step=self.state.step,
        )
        self.loader = build_dataloader(
            self.train_ds, sampler=self.sampler, num_workers=cfg.data.num_workers,
            pin_memory=cfg.data.pin_memory and self.device.type == "cuda", collate_fn=self.collate,
            seed=cfg.train.seed,
        )
        self.tokens_per_sample = getattr(self.train_ds, "seq_len", None)

    # ---------------------------------------------------------------- the step
    def train_step(self) -> torch.Tensor:
        """One optimizer step over `grad_accum_steps` micro-batches; returns the (local) mean loss."""
        accum = self.res.grad_accum_steps
        step_loss = torch.zeros((), device=self.device)
        diag = self.diag  # heartbeats and step-time split; see diagnostics/hub.py
        for micro in range(accum):
            diag.phase("data")
            batch = to_device(next(self.batches), self.device)
            # Reduce gradients only after the last micro-step (unless asked to every time).
            sync = micro == accum - 1 or self.cfg.parallel.sync_each_micro_step
            with sync_gradients(self.model, sync):
                diag.phase("forward")
                with autocast(self.cfg.precision, self.device):
                    loss = self.loss_fn(self.model, batch) / accum  # mean over the whole global batch
                diag.phase("backward", sync=sync)  # sync: DDP/FSDP reduce gradients in this backward
                self.scaler.scale(loss).backward()
            step_loss += loss.detach()
        diag.phase("optimizer")
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        self.grad_norm = clip_grad_norm_(self.model, self.cfg.optim.grad_clip)
        if not diag.skip_step(step_loss, self.grad_norm):  # nonfinite=skip: all ranks skip the same step
            self.scaler.step(self.optimizer)  # skipped by fp16 overflow, counted in `skipped_steps`
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return step_loss

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over the same fixed samples every time, split evenly over ranks."""
        if self.val_ds is None:
            return None
        mb, world = self.res.micro_batch_size, self.res.dp_world_size
        n_batches = min(self.cfg.train.eval_batches, len(self.val_ds) // (mb * world))
        if n_batches == 0:
            return None
        self.model.eval()
        per_rank = n_batches * mb
        first = self.env.rank * per_rank
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for b in range(n_batches):
            self.diag.phase("eval")
            idx = range(first + b * mb, first + (b + 1) * mb)
            batch = (self.collate or torch.utils.data.default_collate)([self.val_ds[i] for i in idx])
            with autocast(self.cfg.precision, self.device):
                total += self.loss_fn(self.model, to_device(batch, self.device)).double()
        self.model.train()
        return collectives.all_reduce_mean([total.item() / n_batches], device=self.device)[0]

    # ---------------------------------------------------------------- the run
    def fit(self) -> dict[str, Any]:
        """Train `train.max_steps` steps; write metrics, final weights and the summary; return the summary."""
        self.device = bind_device(self.env, self.res.device)
        apply_collective_checks(self.cfg.diagnostics)  # must precede the process group
        with process_group(self.env, backend=self.res.backend, device=self.device, timeout_s=self.cfg.parallel.timeout_s):
            self._open_outputs()
            try:
                self.setup()
                self.diag.start(self.model, step=self.state.step, device=self.device, loss_scaling=self.scaler.is_enabled())
                summary = self._loop()
                if not summary.get("preempted"):
                    self.diag.phase("save")
                    self._save_final()
                    self.ckpt.save_final(self)
            finally:
                self.diag.close()
            if self.env.is_main:
                (self.run_dir / "summary.json").write_text(strict_json.dumps(summary, indent=2) + "\n")
                self.console.close()
                if self.cfg.log.progress:
                    print_summary(summary, run_dir=self.run_dir)
            collectives.barrier()
            # Drop the DDP wrapper while its process group still exists: a reducer freed after
            # destroy_process_group can deadlock gloo's teardown against a finishing barrier.
            self.model = unwrap(self.model)
        return summary

    def _open_outputs(self) -> None:
        self.jsonl: JsonlSink | None = None
        self.console = ConsoleSink(max_steps=self.cfg.train.max_steps, enabled=self.env.is_main and self.cfg.log.progress)
        if not self.env.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.run_dir / "config.yaml"
        if not cfg_path.exists():
            cfg_path.write_text(dump_yaml(self.cfg))
        self.jsonl = JsonlSink(self.run_dir / "metrics.jsonl")
        res = self.res
        self.console.message(
            f"dptrain {__version__}: strategy={self.cfg.parallel.strategy} world_size={res.world_size} "
            f"device={self.device.type} backend={res.backend} precision={self.cfg.precision.dtype}\n"
            f"batch: global {res.global_batch_size} = micro {res.micro_batch_size} x accum "
            f"{res.grad_accum_steps} x dp {res.dp_world_size}; {res.lr_rule}\n"
            f"run dir: {self.run_dir}"
        )
        if self.env.launched:
            self.console.message(
                f"rendezvous store: {self.env.master_addr}:{self.env.master_port} (torch.distributed's TCPStore is "
                "unauthenticated and listens on all interfaces: keep it on a trusted network)"
            )

    def _say(self, text: str) -> None:
        """A diagnostics finding: on the console, or on stderr when the progress display is off."""
        console = getattr(self, "console", None)
        if console is not None and console.enabled:
            console.message(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def _log(self, record: dict[str, Any]) -> None:
        if self.jsonl is not None:
            self.jsonl.write(record)
        self.console.write(record)

    def _eval_and_log(self) -> float | None:
        val = self.evaluate()
        if val is not None:
            bpb = self._bits_per_byte(val)
            self._log({"step": self.state.step, "val_loss": val, **({"val_bpb": bpb} if bpb else {})})
            self.console.message(f"step {self.state.step}: val loss {val:.4f}" + (f"  ({bpb:.3f} bits/byte)" if bpb else ""))
        return val

    def _loop(self) -> dict[str, Any]:
        cfg, res, state = self.cfg, self.res, self.state
        # A resumed run evaluated at its start already (the record is kept in metrics.jsonl).
        initial_val = self._eval_and_log() if state.step == 0 else self.ckpt.initial_val_loss
        window = self.log_window
        window_start, t0, first_step = time.perf_counter(), time.perf_counter(), state.step
        train_time = 0.0
        last_loss = None
        preempted = False
        while state.step < cfg.train.max_steps:
            scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
            window.add(self.train_step())
            state.step += 1
            self.diag.on_step_end(state.step)
            state.samples_seen += res.global_batch_size
            if scale_before is not None and self.scaler.get_scale() < scale_before:
                state.skipped_steps += 1  # fp16 overflow: the scaler skipped optimizer.step() and lowered the scale
            if state.step % cfg.train.log_every_steps == 0 or state.step == cfg.train.max_steps:
                # The only host-device sync of the loop, once per log interval.
                last_loss = collectives.all_reduce_mean([window.loss_sum.item() / window.steps], device=self.device)[0]
                elapsed = time.perf_counter() - window_start
                train_time += elapsed
                record = self._throughput(window.steps, elapsed)
                record.update(step=state.step, loss=last_loss, lr=self.scheduler.get_last_lr()[0],
                              grad_norm=float(self.grad_norm), samples_seen=state.samples_seen)
                if self.scaler.is_enabled():
                    record.update(loss_scale=self.scaler.get_scale(), skipped_steps=state.skipped_steps)
                self._log(record)
                window.reset()
                if not math.isfinite(last_loss):
                    self.console.message(f"warning: loss is {last_loss} at step {state.step}")
                window_start = time.perf_counter()
            if cfg.train.eval_every_steps and state.step % cfg.train.eval_every_steps == 0 and state.step < cfg.train.max_steps:
                self._eval_and_log()
                window_start = time.perf_counter()  # evaluation time is not training throughput
            self.diag.phase("checkpoint")
            if self.ckpt.maybe_save(self):  # saves when due; True after a SIGTERM (saved, stop now)
                preempted = True
                break
        final_val = None if preempted else self._eval_and_log()
        times = {"wall_s": time.perf_counter() - t0, "train_s": train_time}
        summary = self._summary(last_loss=last_loss, initial_val=initial_val, final_val=final_val, times=times,
                                steps_here=state.step - first_step)
        if preempted:
            summary["preempted"] = True
        return summary

    def _summary(
        self, *, last_loss: float | None, initial_val: float | None, final_val: float | None,
        times: dict[str, float], steps_here: int,
    ) -> dict[str, Any]:
        """summary.json; throughput counts the steps trained in this process (a resumed run's own)."""
        cfg, res, state = self.cfg, self.res, self.state
        summary: dict[str, Any] = {
            "steps": state.step,
            "final_loss": last_loss,
            "initial_val_loss": initial_val,
            "final_val_loss": final_val,
            "world_size": res.world_size,
            "strategy": cfg.parallel.strategy,
            "precision": cfg.precision.dtype,
            "global_batch_size": res.global_batch_size,
            "samples_seen": state.samples_seen,
            **times,
            **self._throughput(steps_here, times["train_s"]),
            "dptrain_version": __version__,
            "torch_version": torch.__version__,
            **self.diag.summary(),
        }
        if self.ckpt.resumed_from is not None:
            summary["resumed_from"] = str(self.ckpt.resumed_from)
        if final_val is not None and (bpb := self._bits_per_byte(final_val)) is not None:
            summary["final_val_bpb"] = bpb
        if self.scaler.is_enabled():
            summary["skipped_steps"] = state.skipped_steps
        return summary

    def _bits_per_byte(self, loss: float) -> float | None:
        """Bits per byte for byte-level token data (TokenChunks), else None."""
        if not self.tokens_per_sample or getattr(self.val_ds, "bytes_per_token", 1) != 1:
            return None
        return loss / math.log(2)

    def _throughput(self, steps: int, seconds: float) -> dict[str, float]:
        samples = steps * self.res.global_batch_size / max(seconds, 1e-9)
        out = {"samples_per_s": samples, "step_time_s": seconds / max(steps, 1)}
        if self.tokens_per_sample:
            out["tokens_per_s"] = samples * self.tokens_per_sample
        return out

    def _save_final(self) -> None:
        """Consolidated weights under the plain module's names, whatever the strategy."""
        from safetensors.torch import save_file

        state = full_state_dict(self.model)  # collective under FSDP: every rank calls it
        if self.env.is_main:
            out = self.run_dir / "final"
            out.mkdir(parents=True, exist_ok=True)
            # clone: safetensors refuses tensors that share storage (tied embeddings)
            save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(out / "model.safetensors"))

    @property
    def module(self) -> nn.Module:
        """The user's plain module (for inspection after fit)."""
        return unwrap(self.model)
