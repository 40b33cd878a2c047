"""The training loop. `Trainer(cfg).fit()` is what `dptrain run` executes on every rank.

The optimisation step (`train_step`) is deliberately short and explicit: the step's micro-batches,
their forward and backward (`ParallelModel.forward_backward`, parallel/model.py: micro-steps that skip
the gradient reduction until the last one, each loss normalised so the step's gradient is the
global batch's, by the number of micro-steps or by the global batch's valid-token count for
token-level losses: see dptrain/train/loss.py; a pipeline runs its schedule there instead), unscale,
clip, step, update, zero_grad. The trainer never asks which layout it trains. Everything that happens after it is ONE
function, `end_step`: counters, fp16 skip
accounting, logging, diagnostics, evaluation, the preemption agreement and saving. `fit`'s loop and
every benchmark call `end_step(train_step())`, so a benchmark times exactly what `dptrain run` does
per step. Apart from the logging interval (and evaluation, drift/memory/straggler checks and saves
at their own intervals), a step makes no host-device sync: the loss window and the fp16 skip count
stay on the device, and the preemption flag is agreed without blocking (checkpoint/preempt.py).

A steady step (one that does not log, evaluate, save or run a periodic check) calls into no service
module: the heartbeat is written inline (`beat`: the watchdog thread reads `diag.pulse`), the loss is
appended to the log window's list, the meters get the window's steps at the log step, and the
diagnostics' and snapshots' periodic work is asked for only at the steps it names (`_check_at`;
the checkpoint manager holds the snapshots' next step). The preemption agreement, a collective,
runs at every boundary as before. tests/test_step_files.py holds the step to 10 files.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain.checkpoint.base_identity import base_record
from dptrain.checkpoint.manager import CheckpointManager
from dptrain.checkpoint.rundir import write_atomically
from dptrain.checkpoint.state import CheckpointState, DataPosition, ModelState, OptimizerState
from dptrain.config import Config, Resolved, default_out_dir, resolve, to_dict
from dptrain.config.layout import strategy_mode
from dptrain.config.load import dump_yaml
from dptrain.config.pipeline import settle_pipeline
from dptrain.diagnostics import Diagnostics, apply_collective_checks
from dptrain.diagnostics.hub import SYNC_COLLECTIVE
from dptrain.diagnostics.watchdog import Pulse
from dptrain.distributed import collectives
from dptrain.distributed.env import DistEnv
from dptrain.distributed.mesh import ParallelMesh
from dptrain.distributed.process_group import bind_device, process_group
from dptrain.metrics.meters import RunMeters
from dptrain.metrics.records import Records
from dptrain.parallel import ParallelModel, parallelize_model, unwrap
from dptrain.parallel.comm_hooks import build_comm_hook
from dptrain.parallel.materialize import make_materializer
from dptrain.parallel.nvme_offload import NvmeOptimizerState
from dptrain.train.backend import apply_backend_flags, apply_malloc_threshold, compile_backend
from dptrain.train.build import (
    align_labels,
    build_loss_fn,
    build_model_meta,
    build_train_data,
    chunk_the_loss,
    import_object,
)
from dptrain.train.evaluation import evaluate, summarize
from dptrain.train.loss import CountItems, items_per_rank, takes_num_items
from dptrain.train.optim import make_optimizer, make_scheduler, scheduler_period
from dptrain.train.outputs import RunOutputs
from dptrain.train.precision import autocast_factory, build_grad_scaler
from dptrain.train.state import LogWindow, TrainState

__all__ = ["LogWindow", "TrainState", "Trainer"]


class Trainer:
    """Config in, run directory out."""

    def __init__(
        self,
        cfg: Config,
        *,
        out_dir: str | Path | None = None,
        env: DistEnv | None = None,
        resume: str = "auto",
        trust_checkpoint: bool = False,
    ) -> None:
        self.cfg = cfg
        self.env = env or DistEnv.from_env()
        self.res: Resolved = resolve(cfg, world_size=self.env.world_size)
        # a DeepSpeed pipeline's rows per pipeline micro-batch -> their count at this batch (config/pipeline.py)
        parallel = settle_pipeline(cfg.parallel, micro_batch_size=self.res.micro_batch_size, pp=self.res.dims.pp)
        self.cfg = cfg = dataclasses.replace(cfg, parallel=parallel) if parallel is not cfg.parallel else cfg
        self.run_dir = Path(out_dir or default_out_dir(cfg))
        self.device = bind_device(self.env, self.res.device)  # before anything that allocates
        apply_backend_flags(cfg.train, self.device)  # CUDA: TF32, cudnn.benchmark (speed.py)
        apply_malloc_threshold(cfg.train)  # glibc: freed host tensors go back to the system (train/backend.py)
        self.state = TrainState()
        self.log_window = LogWindow()
        self.out = RunOutputs(env=self.env, run_dir=self.run_dir)  # console, metrics.jsonl, monitor, summary, final/
        self.ckpt = CheckpointManager(cfg=cfg, run_dir=self.run_dir, env=self.env, resume=resume,
                                      trust=trust_checkpoint)
        # Watchdog, pre-flight, non-finite policy, stragglers, drift, memory: idle until start().
        self.diag = Diagnostics(
            cfg.diagnostics, env=self.env, run_dir=self.run_dir, pg_timeout_s=cfg.parallel.timeout_s, say=self.out.say
        )

    # ---------------------------------------------------------------- building
    def setup(self) -> None:
        """Open the outputs, build model, optimizer and data, resume if a checkpoint says so, arm the
        diagnostics. Call it inside the process group (`fit` does); afterwards
        `end_step(train_step())` is one step of `dptrain run` (benchmarks call exactly that)."""
        cfg = self.cfg
        self.out.open(log=cfg.log, max_steps=cfg.train.max_steps, res=self.res, strategy=cfg.parallel.strategy,
                      precision=cfg.precision.dtype, device=self.device, diag=self.diag)
        self._build()
        self.checkpoint_state = self._checkpoint_state()
        self.ckpt.maybe_resume(self.checkpoint_state)  # model, optimizer, schedule, scaler, RNG, data position
        self.batches: Iterator[Any] = iter(self.loader)  # starts at the (resumed) global step
        self.diag.start(
            self.model, step=self.state.step, device=self.device, loss_scaling=self.scaler.is_enabled(), mesh=self.mesh
        )
        # The step's service bookkeeping, held here so that a steady step calls into no service module:
        self.pulse = self.diag.pulse  # the heartbeat the watchdog thread reads (written by `beat`)
        self._check_at = self.diag.next_check(self.state.step)  # the next step with a periodic diagnostic
        # the hub's `phase` while the straggler split times, else `beat`
        self._phase = self.diag.phase_hook() or functools.partial(beat, self.pulse)
        self.step_losses = self.log_window.losses  # the log window's list: one append per step
        self._metered_to = self.state.step  # the meters have the steps up to this one (handed over at log steps)
        self._sync_steps = self.res.grad_accum_steps if self.cfg.parallel.sync_each_micro_step else 1
        self.last_loss: float | None = None
        self._config_written = False  # RUN_DIR/config.yaml: written after the first step (end_step)
        # What log records and the summary say, the throughput clock, the fp16 skip count: metrics/records.py
        self.records = Records(res=self.res, strategy=cfg.parallel.strategy, precision=cfg.precision.dtype,
                               state=self.state, scaler=self.scaler, device=self.device, meters=self.meters,
                               tokens_per_sample=self.tokens_per_sample,
                               bytes_per_token=getattr(self.val_ds, "bytes_per_token", 1))
        self.state.watch_loss_scale(self.scaler, device=self.device)  # fp16: skipped steps, counted on the device
        self._counts_skips = self.scaler.is_enabled()

    def _checkpoint_state(self) -> CheckpointState:
        """What a checkpoint saves, as named Stateful objects (the manager never sees the Trainer)."""
        full = self.parallel.full_checkpoint  # pipeline stages and FSDP2 shards: DCP
        adapters = self.base_model is not None  # LoRA: the trainable state and the frozen base's identity only
        return CheckpointState(
            model_parts=[ModelState(m, full=full, trainable_only=adapters) for m in self.parallel.model_parts],
            optimizers=[OptimizerState(self.model, self.optimizer, full=full)],
            schedule=self.scheduler,
            scaler=self.scaler if self.scaler.is_enabled() else None,
            data=DataPosition(self.sampler, self.state),
            train=self.state,
            full=full,
            per_rank={
                "log_window": self.log_window,  # error feedback differs per rank:
                **({"comm_hook": self.comm_hook} if self.comm_hook is not None else {}),
            },
            meta={"global_batch_size": self.res.global_batch_size, "grad_accum_steps": self.res.grad_accum_steps,
                  **({"base_model": self.base_model} if adapters else {})},
        )

    def _build(self) -> None:
        cfg, res = self.cfg, self.res
        # On the meta device (no storage); each rank allocates and fills only its part after sharding,
        # bit-identical to the eager seeded build. A model that cannot be built so is built eagerly.
        model, eager_reason = build_model_meta(cfg.model, seed=cfg.train.seed)
        if eager_reason and self.env.is_main:
            self.out.say(f"dptrain: {eager_reason}")
        # A PEFT model (model.lora, or a factory's get_peft_model): the frozen base's folder and hash, else None
        self.base_model = base_record(model, factory=cfg.model.factory, kwargs=cfg.model.kwargs, seed=cfg.train.seed)
        # The labels this model expects (a transformers causal LM shifts its own): the fine-tuning data's
        # `shift` follows the model, one against it is refused; config.yaml then says what trained.
        self.cfg = cfg = dataclasses.replace(cfg, data=align_labels(cfg.data, model))
        # A causal LM's loss in chunks of tokens, never the whole logits (train.loss_chunk_tokens; where it applies)
        chunking = chunk_the_loss(model, train=cfg.train, tp=res.dims.tp, pp=res.dims.pp)
        if chunking and self.env.is_main:
            self.out.say(f"dptrain: {chunking}")
        # Before any wrapper's own collectives: all ranks agree on world size, config and model.
        self.diag.preflight(model, config=to_dict(cfg))
        # One mesh per run: every group and data-parallel rank below comes from it.
        self.mesh = ParallelMesh.build(res.dims, device_type=self.device.type)
        shards_on = torch.device("cpu") if cfg.parallel.cpu_offload else self.device
        materialize = None if eager_reason else make_materializer(
            device=shards_on, seed=cfg.train.seed, say=self.out.say if self.env.is_main else None
        )
        # parallel.grad_compression: a DDP communication hook (None: none, or FSDP2's reduce dtype)
        self.comm_hook = build_comm_hook(
            cfg.parallel, process_group=self.mesh.dp_group, backend=res.backend, optim=cfg.optim
        )
        # Communication (the DDP hook, metered), throughput per rank, MFU: metrics/meters.py
        # log.comm_times: the metered DDP hook, else DDP's built-in all-reduce and the bytes from the gradients
        self.meters = RunMeters(mode=strategy_mode(cfg.parallel), mesh=self.mesh, device=self.device,
                                precision=cfg.precision.dtype, flops_per_token=cfg.train.flops_per_token,
                                peak_tflops=cfg.log.peak_tflops, comm_times=cfg.log.comm_times)
        self.parallel: ParallelModel = parallelize_model(
            model, cfg=cfg.parallel, mesh=self.mesh, device=self.device, materialize=materialize,
            compile_backend=compile_backend(cfg.train), comm_hook=self.meters.ddp_comm_hook(self.comm_hook))
        self.model: nn.Module = self.parallel.module  # what to call
        # dptrain's SGD/Adam/AdamW/1-bit Adam + warmup/decay, or optim.factory / scheduler_factory (train/optim.py)
        exchange = self.comm_hook.state if self.comm_hook is not None and self.comm_hook.name == "onebit_adam" else None
        self.optimizer = make_optimizer(self.parallel, cfg=cfg.optim, lr=res.lr, exchange=exchange)  # zero1: sharded
        nvme = cfg.parallel.nvme_offload_dir  # the optimizer state in files on a drive (DeepSpeed's NVMe offload)
        self.nvme = None if nvme is None else NvmeOptimizerState(self.optimizer, nvme, rank=self.env.rank)
        self.scheduler = make_scheduler(self.optimizer, cfg=cfg.optim, max_steps=cfg.train.max_steps)
        # sharded (found-inf agreed over the world) also under PP: an overflow in one stage skips every stage's step
        # onebit_adam: after its warm-up every rank sees only its own gradients, so an overflow must be agreed too
        onebit = cfg.optim.name in ("onebit_adam", "onebit_lamb")
        self.scaler = build_grad_scaler(
            cfg.precision, self.device, sharded=self.parallel.sharded or self.parallel.pipelined or onebit
        )
        self.autocast = autocast_factory(cfg.precision, self.device)  # around each forward (fp32: nothing)
        self.loss_fn = build_loss_fn(cfg.train.loss)
        # Token or sample rule (dptrain/train/loss.py). Token rule: the step's valid-target count over the
        # global batch, counted once per step before any backward (one all-reduce over dp, on the device).
        self.token_loss = takes_num_items(self.loss_fn, self.model)
        self.count_items: CountItems | None = (
            functools.partial(
                items_per_rank,
                device=self.device,
                dp_world_size=self.mesh.grad_size,  # dp, or dp x cp: each cp rank counts its own chunks
                group=self.mesh.grad_group,
            )
            if self.token_loss
            else None
        )
        self.eval_fn = import_object(cfg.train.eval_fn) if cfg.train.eval_fn else None
        self.eval_summary = import_object(cfg.train.eval_summary) if cfg.train.eval_summary else None
        # datasets, the world-size-invariant batch order from the resumed step, the DataLoader (train/build.py)
        data = build_train_data(cfg, res, dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size, device=self.device,
                                start_step=self.state.step)
        self.train_ds, self.val_ds, self.collate, self.sampler, self.loader = (
            data.train_ds, data.val_ds, data.collate, data.sampler, data.loader)
        self.scheduler_period = scheduler_period(interval=cfg.optim.scheduler_interval,
                                                 steps_per_epoch=self.sampler.steps_per_epoch)
        self.tokens_per_sample = getattr(self.train_ds, "seq_len", None)
        self.meters.attach(model, cfg=cfg.parallel, seq_len=self.tokens_per_sample)  # bytes, FLOPs, peak

    # ---------------------------------------------------------------- the step
    def train_step(self) -> torch.Tensor:
        """One optimizer step over `grad_accum_steps` micro-batches. Returns this rank's share of the
        global batch's loss: its mean over the data-parallel ranks is the global batch's loss."""
        diag, phase = self.diag, self._phase  # heartbeats (and the straggler split's timing): see `beat`
        phase("data")
        micro_batches = [next(self.batches) for _ in range(self.res.grad_accum_steps)]
        # Forward and backward of every micro-batch, gradients reduced in the last backward only; the
        # losses normalised by the token or sample rule; fp16: scaled backward (parallel/model.py).
        step_loss = self.parallel.forward_backward(
            micro_batches,
            loss_fn=self.loss_fn,
            count_items=self.count_items,
            scaler=self.scaler,
            context=self.autocast,
            phase=phase,
        )
        phase("optimizer")
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        self.grad_norm = self.parallel.clip_grad_norm_(self.cfg.optim.grad_clip)  # global norm, every dimension
        # nonfinite=skip|error: all ranks skip the same step (diagnostics/nonfinite.py); off: nothing to ask
        if diag.nonfinite is None or not diag.skip_step(step_loss, self.grad_norm):
            self.scaler.step(self.optimizer)  # skipped by fp16 overflow, counted in `skipped_steps`
        self.scaler.update()
        self.step_lr = float(self.scheduler.get_last_lr()[0])  # the rate this step trained at (a Python float: no sync)
        if (self.state.step + 1) % self.scheduler_period == 0:  # every step, or at the epoch ends
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return step_loss

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> float | None:
        """Mean validation loss over the same fixed samples every time, split over data-parallel ranks; with
        train.eval_fn its metrics land in `self.eval_metrics` (train/evaluation.py)."""
        result = evaluate(
            self.parallel,
            self.val_ds,
            loss_fn=self.loss_fn,
            collate=self.collate,
            context=self.autocast,
            eval_batches=self.cfg.train.eval_batches,
            micro_batch_size=self.res.micro_batch_size,
            dp_world_size=self.res.dp_world_size,
            mesh=self.mesh,
            device=self.device,
            phase=self.diag.phase,
            eval_fn=self.eval_fn,
            eval_samples=self.cfg.train.eval_samples,
        )
        self.eval_metrics = result.metrics if result is not None else {}
        if self.eval_summary is not None and self.eval_metrics:  # F1 and the like, from the exact means
            self.eval_metrics = {**self.eval_metrics, **summarize(self.eval_summary, self.eval_metrics)}
        return result.loss if result is not None else None

    # ---------------------------------------------------------------- the run
    def fit(self) -> dict[str, Any]:
        """Train `train.max_steps` steps; write metrics, final weights and the summary; return the summary."""
        apply_collective_checks(self.cfg.diagnostics)  # must precede the process group
        with process_group(
            self.env, backend=self.res.backend, device=self.device, timeout_s=self.cfg.parallel.timeout_s
        ):
            finished = False
            try:
                self.setup()
                summary = self._loop()
                if not summary.get("preempted"):
                    self.diag.phase("save")
                    self.out.save_final(self.parallel)
                    self.ckpt.save_final(self.checkpoint_state)
                finished = True
            except BaseException as e:
                self.diag.failed(e)  # first: torchrun's stop may follow a peer's death within milliseconds
                raise
            finally:
                self.close(wait=finished)
            self.out.finish(summary, progress=self.cfg.log.progress)  # rank 0: summary.json, the table
            collectives.barrier()
            # Drop the DDP wrapper and the mesh while their process groups still exist: a reducer or
            # a process group freed after destroy_process_group can deadlock gloo's teardown (here,
            # or in a process forked from this one); collect what they leave in reference cycles now.
            self.model = self.parallel.release()
            self.mesh.release()
            gc.collect()
            self.checkpoint_state = self._checkpoint_state()  # its model parts held the wrapper too
        return summary

    def close(self, *, wait: bool = True) -> None:
        """Stop the diagnostics and the checkpoint manager's background work (collective with
        `wait`; a failing run abandons it instead). `fit` calls it; so do the benchmarks."""
        self.ckpt.close(wait=wait)
        self.diag.close()
        self.out.close(finished=wait)

    def _eval_and_log(self) -> float | None:
        val = self.evaluate()
        if val is not None:
            self.out.log_eval(step=self.state.step, val=val, bpb=self.records.bits_per_byte(val),
                              metrics=self.eval_metrics)
        return val

    def _loop(self) -> dict[str, Any]:
        state = self.state
        # A resumed run evaluated at its start already (the record is kept in metrics.jsonl).
        initial_val = self._eval_and_log() if state.step == 0 else self.ckpt.initial_val_loss
        t0, first_step = time.perf_counter(), state.step
        self.records.window_start = t0
        preempted = False
        while state.step < self.cfg.train.max_steps:
            if self.end_step(self.train_step()):  # True after a SIGTERM: the step is saved, stop now
                preempted = True
                break
        final_val = None if preempted else self._eval_and_log()
        self._hand_over_meters()  # the steps after the last log line
        times = {"wall_s": time.perf_counter() - t0, "train_s": self.records.train_time}
        summary = self.records.summary(
            last_loss=self.last_loss,
            initial_val=initial_val,
            final_val=final_val,
            times=times,
            steps_here=state.step - first_step,
            diag=self.diag,
            resumed_from=self.ckpt.resumed_from,
        )
        if preempted:
            summary["preempted"] = True
            summary["interrupted"] = self.ckpt.interrupted  # Ctrl-C (exit 130) rather than SIGTERM (143)
        return summary

    def step_rows(self, step: int) -> int:
        """Samples in global `step`: the global batch, or the rows of a token-budget batch (data/token_batches.py)."""
        rows = getattr(self.sampler, "rows_of_step", None)
        return int(rows(step)) if rows is not None else self.res.global_batch_size

    # ---------------------------------------------------------------- the step boundary
    def end_step(self, loss: torch.Tensor) -> bool:
        """Everything after `train_step` (whose local mean loss is `loss`), once per step, the same in
        `dptrain run` and in the benchmarks: counters, fp16 skip accounting, logging, diagnostics,
        evaluation when due, the preemption agreement and saving. True: preempted, the step is
        saved on every rank, stop now. No host-device sync except at a log step (and the periodic
        checks, evaluation and saves at their own intervals)."""
        cfg, state = self.cfg, self.state
        if not self._config_written:  # the first step trained: only now does the directory hold the run's config
            self._config_written = True
            if self.env.is_main:
                write_atomically(self.run_dir / "config.yaml", dump_yaml(self.cfg))
        self.step_losses.append(loss.detach())  # the log window's (train/state.py), summed at the log step
        state.step += 1
        self.pulse.step, self.pulse.seq = state.step + 1, 0  # heartbeats from here on belong to the next step
        state.samples_seen += self.step_rows(state.step - 1)
        if self._counts_skips:
            state.count_fp16_skip(self.scaler)  # fp16: on the device, no sync
        if state.step >= self._check_at:  # drift, memory, straggler split, profiler, collective check
            self.diag.on_step_end(state.step)
            self._check_at = self.diag.next_check(state.step)
            self._phase = self.diag.phase_hook() or functools.partial(beat, self.pulse)
        if state.step % cfg.train.log_every_steps == 0 or state.step == cfg.train.max_steps:
            self.ckpt.record_progress(state.step)  # the restart report's last finished step (before the all-reduce)
            self._log_step()
        every = cfg.train.eval_every_steps
        if every and state.step % every == 0 and state.step < cfg.train.max_steps:
            self._eval_and_log()
            self.records.restart_window()  # evaluation time is not training throughput
        self._phase("checkpoint", collective="all_reduce (preemption flags, started one step earlier)")
        return self.ckpt.maybe_save(self.checkpoint_state, step=state.step)

    def _hand_over_meters(self) -> None:
        """Give the meters the steps trained since the last hand-over (log steps and the end: not per step)."""
        steps, self._metered_to = self.state.step - self._metered_to, self.state.step
        self.meters.steps_done(steps, micro_steps=self.res.grad_accum_steps, sync_steps=self._sync_steps)

    def _log_step(self) -> None:
        """A log line: the one host-device sync of the interval (loss mean over ranks)."""
        window, state = self.log_window, self.state
        self._hand_over_meters()
        local = self.parallel.reduce_loss(window.loss_sum / window.steps).item()  # a pipeline's: its last stage's
        self.last_loss = last_loss = collectives.all_reduce_mean(
            [local], device=self.device, group=self.mesh.grad_group  # dp (x cp): each rank's share
        )[0]
        window_steps = window.steps
        self.out.log(
            self.records.log_record(
                loss=last_loss, window_steps=window_steps, lr=self.step_lr, grad_norm=self.grad_norm
            )
        )
        self.diag.logged_loss(last_loss, step=state.step, window_steps=window_steps,  # loud if not finite
                              first_bad=lambda: window.first_nonfinite_step(state.step), device=self.device,
                              group=self.mesh.grad_group)
        window.reset()
        self.records.restart_window()

    @property
    def module(self) -> nn.Module:
        """The user's plain module (for inspection after fit)."""
        return unwrap(self.model)


def beat(pulse: Pulse, name: str, *, sync: bool = False, collective: str | None = None) -> None:
    """The heartbeat of a step the diagnostics do not time: `diag.phase`'s writes to the pulse (the watchdog thread
    reads it: diagnostics/watchdog.py), without a call into the diagnostics. A function of the pulse, not a method
    of the Trainer: a Trainer holding its own bound method would live in a reference cycle, and the process groups
    it holds would then be freed by a later garbage collection, where gloo's teardown can wait for ever."""
    pulse.phase = name
    pulse.seq += 1
    if sync:
        pulse.collective = SYNC_COLLECTIVE
    elif collective is not None:
        pulse.collective = collective
