"""`Checkpointer`: `dptrain run`'s checkpoints for an own loop, in a few lines.

    ckpt = dptrain.Checkpointer("runs/mnist", model, optimizer, scheduler, loader)
    start = ckpt.resume()                      # 0 when nothing was saved; restores everything else
    ...
    ckpt.save(step)                            # or, every step: `if ckpt.step(step): break`

It builds the `CheckpointState` the Trainer builds (model, optimizer, LR schedule, grad scaler, data
position, step, every rank's RNG) and hands it to the same `CheckpointManager`: the same folders
(`OUT_DIR/checkpoints/step_NNNNNN/`), manifest with SHA-256 hashes, commit marker, pruning, choice of
the newest valid checkpoint, and format by the model: `full` for plain/DDP models, `dcp` shards for
FSDP2 (zero2/fsdp) and tensor parallelism. A checkpoint resumes at another world size as long as the
loader's global batch size and data set are the same. `dptrain ckpt ls|verify|export OUT_DIR` reads it.

SIGTERM / Ctrl-C are handled only when the loop calls `step(step)` at every optimizer step (opt-in):
from its first call a signal is agreed on by all ranks one step later, the step is saved, and `step`
returns True (stop; `exit_code` is 143, or 130 for Ctrl-C). Without `step()` the signals keep their
usual effect.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from dptrain.api.setup import parallel_model_of
from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint import storage
from dptrain.checkpoint.extra import EXTRA_FILE, decode, encode
from dptrain.checkpoint.manager import CheckpointManager
from dptrain.checkpoint.manifest import CheckpointError
from dptrain.checkpoint.preempt import EXIT_INTERRUPTED, EXIT_PREEMPTED
from dptrain.checkpoint.resume import API
from dptrain.checkpoint.rng import get_rng_state
from dptrain.checkpoint.rundir import move_aside
from dptrain.checkpoint.state import CheckpointState, ModelState, OptimizerState
from dptrain.config import CheckpointConfig, Config, ConfigError, ParallelConfig
from dptrain.data import EpochLoader
from dptrain.distributed.env import DistEnv
from dptrain.distributed.exit_marks import mark_exit
from dptrain.parallel import ParallelModel, is_sharded
from dptrain.train.state import TrainState

__all__ = ["Checkpointer", "rng_state"]


class _Optional:
    """A Stateful slot that may be empty (no scheduler, no loader): saved as {"absent": True}."""

    def __init__(self, what: str, obj: Any) -> None:
        self.what, self.obj = what, obj

    def state_dict(self) -> dict[str, Any]:
        return {"absent": True} if self.obj is None else self.obj.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.obj is None:
            return  # the checkpoint has one, this run does not use it
        if not sd or sd.get("absent"):
            raise CheckpointError(
                f"the checkpoint was saved without a {self.what}, so this run's {self.what} cannot be restored; "
                f"resume without it, or start afresh in a new out_dir"
            )
        self.obj.load_state_dict(sd)


class _Position:
    """The loader's position (its consumed global steps), the `data` slot of the CheckpointState."""

    def __init__(self, loader: EpochLoader | None) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return {} if self.loader is None else self.loader.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.loader is None:
            return
        if not sd:
            raise CheckpointError(
                "the checkpoint was saved without a loader: its data position is unknown; pass loader=None, or "
                "start afresh in a new out_dir"
            )
        try:
            self.loader.load_state_dict(sd)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _start_over(out_dir: Path, root: Path, *, resume: str, is_main: bool) -> None:
    """`resume="none"`: refused (nothing touched) when `root` holds committed checkpoints, which a save would
    overwrite and a later `resume="auto"` would continue from; `"overwrite"`: they (and the run's
    metrics.jsonl) are moved to OUT_DIR/previous/N/ on rank 0, and the run starts at step 0."""
    committed = [i.path for i in mf.list_checkpoints(root, check_hashes=False) if i.state != "uncommitted"]
    if not committed:
        return
    if resume == "none":
        raise ConfigError(
            f"Checkpointer(resume='none'): {root} holds checkpoints of an earlier run ({len(committed)}, newest "
            f"{committed[-1].name}); saving would overwrite them and a later resume='auto' would continue from them. "
            "Pass resume='auto' to continue that run, resume='overwrite' to start over (they are moved to "
            f"{out_dir / 'previous'}/N/, not deleted), or use a new out_dir"
        )
    if is_main:
        moved = move_aside(out_dir, mf.step_dirs(root), names=("metrics.jsonl",))
        print(f"dptrain: resume='overwrite': the earlier checkpoints ({', '.join(p.name for p in committed)}) were "
              f"moved to {moved}; starting at step 0", file=sys.stderr, flush=True)


def rng_state() -> dict[str, Any]:
    """This rank's RNG states now (Python, numpy, torch, CUDA), for `Checkpointer.save(step, rng=...)`:
    take it right before the loop draws a batch from the global RNG, and save it with the step before."""
    return get_rng_state()


def _check_rng(rng: Any) -> None:
    if rng is not None and not (isinstance(rng, dict) and {"python", "numpy", "torch"} <= rng.keys()):
        raise ConfigError(
            f"Checkpointer.save(rng=...): pass what dptrain.rng_state() returned (got a {type(rng).__name__})"
        )


class Checkpointer:
    """Save and resume an own loop's whole state; see the module doc.

    `model`: the `ParallelModel` of `parallelize` (or its `.module`; a model dptrain did
    not prepare works too, its format chosen by whether it is sharded). `optimizer`, `scheduler` (any
    object with state_dict/load_state_dict), `loader` (from `prepare_dataloader`: its position is
    saved), `scaler` (a GradScaler or `dptrain.mixed_precision(...)`; only an enabled one is saved).
    `every_steps`: `step()` saves every N steps (0: only on a signal). `keep_last`: committed
    checkpoints kept (None: all). `save_timeout_s`: how long `save` waits for every rank to call it before it
    refuses (a save called on one rank only would otherwise hang until the process group's timeout).
    Construct it on every rank (collective: it makes a small gloo group).
    `resume`: "auto" (the newest valid; says so when there is none),
    "none" (start at step 0; refused when OUT_DIR already holds checkpoints), "overwrite" (start at step 0,
    the earlier checkpoints moved to OUT_DIR/previous/N/), or a step folder."""

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        model: Any,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        loader: Any = None,
        *,
        scaler: Any = None,
        every_steps: int = 0,
        keep_last: int | None = 3,
        resume: str = "auto",
        async_save: bool = False,
        save_timeout_s: float = 10.0,
    ) -> None:
        if loader is not None and not isinstance(loader, EpochLoader):
            raise ConfigError(
                f"Checkpointer(loader=...) needs a loader from dptrain.prepare_dataloader (got a "
                f"{type(loader).__name__}): only its position can be saved and resumed, at any world size. "
                "Pass loader=None to save no data position"
            )
        for name, value in (("every_steps", every_steps), ("keep_last", keep_last)):
            if value is not None and (not isinstance(value, int) or value < (0 if name == "every_steps" else 1)):
                raise ConfigError(f"Checkpointer({name}={value!r}): must be an integer >= "
                                  f"{0 if name == 'every_steps' else 1}" + (" or None" if name == "keep_last" else ""))
        if not isinstance(resume, str | os.PathLike):
            raise ConfigError(f"Checkpointer(resume={resume!r}): pass 'auto', 'none', 'overwrite' or a step folder")
        resume = os.fspath(resume)
        pmodel, strategy = parallel_model_of(model)
        if isinstance(model, ParallelModel):
            pmodel = model
        module = pmodel.module if pmodel is not None else model
        full = pmodel.full_checkpoint if pmodel is not None else not is_sharded(model)
        parts = pmodel.model_parts if pmodel is not None else [model]
        self.out_dir = Path(out_dir)
        self.loader: EpochLoader | None = loader
        self.train = TrainState()
        scaler = getattr(scaler, "scaler", scaler)  # a MixedPrecision holds its GradScaler
        meta: dict[str, Any] = {"api": "Checkpointer"}
        if loader is not None:
            meta.update(global_batch_size=loader.global_batch_size, grad_accum_steps=loader.grad_accum_steps)
        self.state = CheckpointState(
            model_parts=[ModelState(m, full=full) for m in parts],
            optimizers=[OptimizerState(module, optimizer, full=full)],
            schedule=_Optional("scheduler", scheduler),
            scaler=scaler if scaler is not None and scaler.is_enabled() else None,
            data=_Position(loader),
            train=self.train,
            full=full,
            meta=meta,
        )
        cfg = Config(
            checkpoint=CheckpointConfig(every_steps=every_steps, keep_last=keep_last, async_save=async_save),
            parallel=ParallelConfig(strategy=strategy or ("fsdp" if not full else "ddp")),
        )
        env = DistEnv.from_env()
        root = mf.checkpoint_root(cfg.checkpoint, self.out_dir)
        if resume in ("none", "overwrite"):
            _start_over(self.out_dir, root, resume=resume, is_main=env.is_main)
        self.manager = CheckpointManager(
            cfg=cfg, run_dir=self.out_dir, env=env, resume="none" if resume == "overwrite" else resume,
            announce_fresh_start=True, words=API,
        )
        if not isinstance(save_timeout_s, int | float) or not 0 < save_timeout_s < float("inf"):
            raise ConfigError(f"Checkpointer(save_timeout_s={save_timeout_s!r}): must be a number of seconds > 0")
        self.save_timeout_s = float(save_timeout_s)
        # `save` first checks that every rank called it, on a gloo group of its own (made here: this is collective)
        self._arrival = dist.new_group(backend="gloo") if env.world_size > 1 and dist.is_initialized() else None
        self.exit_code = 0
        """143 (SIGTERM) or 130 (Ctrl-C) once `step` returned True; 0 before."""
        self.extra: dict[str, Any] = {}
        """Your own state: what the last `save(extra=...)` was given, or what `resume()` restored (rank 0's
        when it was saved); every save stores it. JSON values and tensors (see checkpoint/extra.py)."""

    @property
    def root(self) -> Path:
        """Where the step folders go: OUT_DIR/checkpoints."""
        return self.manager.root

    @property
    def resumed_from(self) -> Path | None:
        """The step folder `resume` loaded, if any."""
        return self.manager.resumed_from

    def resume(self) -> int:
        """Load the newest valid checkpoint (per `resume=`) into the model, optimizer, scheduler, scaler,
        loader and every rank's RNG; return its step (0 when there is none: nothing changes). Collective."""
        self.manager.maybe_resume(self.state, preemption=False)
        path = self.manager.resumed_from
        if path is not None and self.manager.resumed_from_memory is None:
            saved = mf.read_manifest(path, require_commit=False)["meta"].get("extra", {})
            tensors = storage.load_torch(path / EXTRA_FILE) if (path / EXTRA_FILE).is_file() else {}
            self.extra = decode(saved, tensors)
        return self.train.step

    def _at(self, step: int) -> None:
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"Checkpointer: step must be an integer >= 0, got {step!r}")
        if self.loader is not None and not self.loader.at_step_boundary:
            raise ConfigError(
                f"Checkpointer: the loader is in the middle of an optimizer step ({self.loader.micro_batches_consumed}"
                f" micro-batches consumed, {self.loader.grad_accum_steps} per step): save after the step's last "
                "micro-batch, where no gradient is half accumulated"
            )
        self.train.step = step
        self.train.samples_seen = self.loader.step * self.loader.global_batch_size if self.loader is not None else 0

    def _set_extra(self, extra: dict[str, Any] | None) -> None:
        if extra is not None:
            self.extra = extra
        saved, tensors = encode(self.extra)
        self.state.meta["extra"] = saved
        self.state.extra_files = {EXTRA_FILE: tensors} if tensors else {}

    def save(self, step: int, *, extra: dict[str, Any] | None = None, rng: dict[str, Any] | None = None) -> Path:
        """Save now as step `step` (hashed and committed before it returns); the step folder. Collective.

        `extra`: your own state (`{"best_val_loss": 1.9, "model_args": {...}}`): JSON values and tensors, rank
        0's saved, `ckpt.extra` after a resume; None keeps `ckpt.extra` (the last given or resumed).
        `rng`: this rank's RNG states to save instead of the current ones, taken with `dptrain.rng_state()`
        just before the loop drew the batch of the step after `step` (a loop that draws its next batch from
        the global RNG before it saves, as nanoGPT's does, then resumes with that same batch)."""
        self._at(step)
        self._set_extra(extra)
        _check_rng(rng)
        self._all_here(step)
        return self.manager.save(self.state, rng=rng)

    def _all_here(self, step: int) -> None:
        """Every rank called `save`, or CheckpointError within `save_timeout_s` on the ranks that did (rather
        than a hang until the process group's timeout): torch's monitored barrier, on the Checkpointer's group."""
        if self._arrival is None:
            return
        try:
            dist.monitored_barrier(self._arrival, timeout=timedelta(seconds=self.save_timeout_s), wait_all_ranks=True)
        except RuntimeError as e:
            rank = dist.get_rank()
            raise CheckpointError(
                f"Checkpointer.save({step}) on rank {rank}: not every rank called save within "
                f"{self.save_timeout_s:g} s "
                f"({e}). save is collective: call save on every rank. To save only when, e.g., validation improved, "
                "decide on rank 0 and pass the decision to every rank: `is_best = dptrain.broadcast(val_loss < "
                "best_val_loss)`, then `if is_best: ckpt.save(step, extra={'best_val_loss': val_loss})` on every "
                "rank. (A rank that is only late, e.g. still evaluating alone, needs a larger save_timeout_s.) "
                "Nothing was written"
            ) from None

    def step(self, step: int, *, rng: dict[str, Any] | None = None) -> bool:
        """Call after every optimizer step `step` (1, 2, ...), on every rank. Saves every `every_steps` steps;
        from the first call on, a SIGTERM or Ctrl-C on any rank is agreed on one step later: that step is
        saved and True is returned (stop; `exit_code` says 143 or 130). `rng`: as in `save`. Collective."""
        self._at(step)
        self._set_extra(None)
        _check_rng(rng)
        stop = self.manager.maybe_save(self.state, step=step, rng=rng)
        if stop:
            self.exit_code = EXIT_INTERRUPTED if self.manager.interrupted else EXIT_PREEMPTED
            reason = "interrupt (Ctrl-C)" if self.manager.interrupted else "preemption signal (SIGTERM)"
            # `dptrain launch` reports the status as dptrain's (the step is saved), not as the script's own
            mark_exit(self.exit_code, reason, detail=f"step {step} saved under {self.manager.root}")
        return stop

    def close(self) -> None:
        """Finish a background save, stop the signal agreement and restore the signal handlers. Collective."""
        self.manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.manager.close(wait=et is None)

