"""CheckpointManager: when to save, what a checkpoint holds, and how a run resumes.

The trainer calls three things: `maybe_resume(trainer)` after building, `maybe_save(trainer)`
after every step (it also handles preemption), `save_final(trainer)` at the end. The trainer
object is read for `model`, `optimizer`, `scheduler`, `scaler`, `sampler`, `state`
(TrainState) and `log_window` (the per-rank loss accumulator and step count of the current
logging window, so that a resumed run logs exactly what an uninterrupted one does).

A checkpoint folder `step_NNNNNN/` holds:

- `model.pt` + `optim.pt` (full format) or `dcp/` (sharded format), see `storage.py`;
- `train.pt` (rank 0): LR scheduler and grad scaler state;
- `rank_RRRRR.pt` (every rank): that rank's RNG states and logging window;
- `manifest.json`: size and SHA-256 of every file above, and `meta` (JSON): step, samples
  seen, data position, world size, strategy, format, config hashes, torch/dptrain versions;
- `COMMITTED`, written last.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from dptrain import __version__
from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint import storage
from dptrain.checkpoint.attempts import ProgressFile, report_restart
from dptrain.checkpoint.manifest import checkpoint_root  # noqa: F401 - re-exported (torch-free home)
from dptrain.checkpoint.preempt import PreemptionFlag
from dptrain.checkpoint.resume import ResumeChoice, choose_checkpoint, truncate_metrics
from dptrain.checkpoint.rng import get_rng_state, set_rng_state
from dptrain.config import Config, to_dict
from dptrain.distributed import collectives
from dptrain.distributed.env import DistEnv


def config_hash(section: Any) -> str:
    """SHA-256 of a config (section) as canonical JSON."""
    return hashlib.sha256(json.dumps(to_dict(section), sort_keys=True).encode()).hexdigest()


class CheckpointManager:
    """Saves and restores a Trainer's complete state; see the module docstring."""

    def __init__(self, *, cfg: Config, run_dir: Path, env: DistEnv, resume: str = "auto", trust: bool = False) -> None:
        self.cfg = cfg.checkpoint
        self.root_cfg = cfg
        self.run_dir = run_dir
        self.root = checkpoint_root(cfg.checkpoint, run_dir)
        self.env = env
        # After an elastic restart the newest checkpoint is the one to continue from, whatever was asked.
        self.resume = "auto" if env.restart_count > 0 else resume
        self.trust = trust
        self.last_saved_step: int | None = None
        self.resumed_from: Path | None = None
        self.initial_val_loss: float | None = None
        self.preemption: PreemptionFlag | None = None
        self.progress: ProgressFile | None = None
        self._pending: tuple[Path, Future, dict[str, Any], float] | None = None  # save in flight
        self._executor: ThreadPoolExecutor | None = None
        self._async_group: Any = None

    def _say(self, message: str) -> None:
        if self.env.is_main:
            print(message, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ resume
    def maybe_resume(self, trainer: Any) -> bool:
        """Restore the newest usable checkpoint (per `resume`) into `trainer`; True if one was loaded."""
        self.preemption = PreemptionFlag(device=trainer.device)
        choice = ResumeChoice()
        if self.env.is_main:
            if self.env.restart_count > 0:
                report = report_restart(self.run_dir, attempt=self.env.restart_count)
                if report:
                    choice.messages.append(report)
            choice = self._choose(choice)
        choice = collectives.broadcast_object(choice)  # also: nobody rewrites its progress file before the report
        if self.env.launched and self.root_cfg.launch.max_restarts > 0:
            self.progress = ProgressFile(self.run_dir, rank=self.env.rank, attempt=self.env.restart_count)
        for line in choice.messages:
            self._say(line)
        if choice.error:
            raise mf.CheckpointError(choice.error)
        if choice.path is None:
            if self.env.is_main:  # starting over in this directory: its metrics start over too
                truncate_metrics(self.run_dir / "metrics.jsonl", step=-1)
            return False
        self._load(trainer, Path(choice.path), choice.meta)
        self.resumed_from = Path(choice.path)
        self.last_saved_step = trainer.state.step
        if self.env.is_main:
            self.initial_val_loss = truncate_metrics(self.run_dir / "metrics.jsonl", step=trainer.state.step)
        self._say(f"dptrain: resumed from {choice.path} at step {trainer.state.step}")
        return True

    def _choose(self, choice: ResumeChoice) -> ResumeChoice:
        found = choose_checkpoint(self.resume, root=self.root, trust=self.trust)
        found.messages[:0] = choice.messages
        return found

    def record_error(self, message: str) -> None:
        """Note the error this rank is dying with in its progress file (for the restart report)."""
        if self.progress is not None:
            self.progress.error(message)

    def _load(self, trainer: Any, path: Path, meta: dict[str, Any]) -> None:
        want = config_hash(self.root_cfg.model)
        if meta.get("model_config_hash") not in (None, want):
            raise mf.CheckpointError(
                f"{path}: written for another model config (model section hash {meta['model_config_hash'][:12]}, "
                f"this run {want[:12]}); resume with the run's own model settings"
            )
        storage.load_model_optim(path, fmt=meta["format"], model=trainer.model, optimizer=trainer.optimizer)
        train = storage.load_torch(path / "train.pt")
        trainer.scheduler.load_state_dict(train["scheduler"])
        if train["scaler"]:
            trainer.scaler.load_state_dict(train["scaler"])
        trainer.state.step = int(meta["step"])
        trainer.state.samples_seen = int(meta["samples_seen"])
        trainer.state.skipped_steps = int(meta.get("skipped_steps", 0))
        trainer.sampler.load_state_dict(meta["sampler"])
        own = path / f"rank_{self.env.rank:05d}.pt"
        if own.is_file() and meta["world_size"] == self.env.world_size:
            rank_state = storage.load_torch(own)
            set_rng_state(rank_state["rng"])
            trainer.log_window.load_state_dict(rank_state["log_window"])
        elif own.is_file():
            set_rng_state(storage.load_torch(own)["rng"])  # new world size: the window restarts
            trainer.log_window.reset()

    # ------------------------------------------------------------------ save
    def maybe_save(self, trainer: Any) -> bool:
        """After a step: commit a finished background save, save when due or when preempted.
        Returns True when the run must stop now (the checkpoint is committed on every rank by then)."""
        step = trainer.state.step
        if self.progress is not None:
            self.progress.step(step)
        busy = self._pending is not None and not self._pending[1].done()
        stop, any_busy = self.preemption.should_stop(busy=busy) if self.preemption else (False, busy)
        if self._pending is not None and not any_busy:
            self._finish_pending()  # every rank's files are on disk: hash, manifest, marker
        due = self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
        if (due or stop) and self.last_saved_step != step:
            self.save(trainer, background=self.cfg.async_save and not stop)
        if stop:
            self._finish_pending()
            self._say(f"dptrain: preempted (SIGTERM): saved step {step}; resume with the same command")
        return stop

    def save_final(self, trainer: Any) -> None:
        """The end-of-run checkpoint (skipped when this step was just saved); waits for any
        background save, so nothing is left half-written when the process exits."""
        if self.last_saved_step != trainer.state.step:
            self.save(trainer, background=False)
        self._finish_pending()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self.preemption:
            self.preemption.restore()

    def save(self, trainer: Any, *, background: bool = False) -> Path:
        """Write the checkpoint of the current step, then hash and commit it. Collective. With
        `background`, only the snapshot is taken now; the commit follows at the first step
        boundary after every rank has finished writing (see `maybe_save`)."""
        self._finish_pending()  # one save in flight at a time
        step, rank = trainer.state.step, self.env.rank
        path = self.root / mf.step_dir_name(step)
        t0 = time.perf_counter()
        if self.env.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if path.exists():  # overwriting: the marker goes first, then the old data
                mf.uncommit(path)
                shutil.rmtree(path)
            path.mkdir()
        collectives.barrier()
        if background:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dptrain-ckpt")
                self._async_group = torch.distributed.new_group(backend="gloo")  # the checkpoint's own collectives
            written = storage.async_save_model_optim(path, model=trainer.model, optimizer=trainer.optimizer, rank=rank,
                                                     process_group=self._async_group, executor=self._executor)
        else:
            storage.save_model_optim(path, model=trainer.model, optimizer=trainer.optimizer, rank=rank)
            written = Future()
            written.set_result(None)
        if rank == 0:
            scaler = trainer.scaler.state_dict() if trainer.scaler.is_enabled() else None
            storage.save_torch(path / "train.pt", {"scheduler": trainer.scheduler.state_dict(), "scaler": scaler})
        storage.save_torch(path / f"rank_{rank:05d}.pt", {"rng": get_rng_state(), "log_window": trainer.log_window.state_dict()})
        self._pending = (path, written, self._meta(trainer), t0)
        self.last_saved_step = step
        if not background:
            self._finish_pending()
        return path

    def _finish_pending(self) -> None:
        """Wait for this rank's files of the save in flight, then hash, write the manifest and
        commit. Collective: every rank calls it at the same step."""
        if self._pending is None:
            return
        path, written, meta, t0 = self._pending
        self._pending = None
        written.result()  # re-raises a failed background write: never committed then
        collectives.barrier()
        entries = self._hash_files(path, rank=self.env.rank, world=self.env.world_size)
        if self.env.is_main:
            digest = mf.write_manifest(path, files=entries, meta=meta)
            mf.commit(path, manifest_sha256=digest)
            for old in mf.prune(self.root, keep_last=self.cfg.keep_last):
                self._say(f"dptrain: removed old checkpoint {old}")
        collectives.barrier()  # nobody moves on (or exits) before the commit
        self._say(f"dptrain: checkpoint {path} committed ({time.perf_counter() - t0:.2f}s after the save began)")

    def _hash_files(self, path: Path, *, rank: int, world: int) -> dict[str, dict[str, Any]]:
        """Hash the folder's files, split over ranks (shared file system); the result is complete on
        rank 0. The shares travel as small temp files, not as an object collective: gloo's
        all_gather_object can leave a work holding Python tensors that deadlocks teardown."""
        names = mf.data_files(path)
        mine = {n: mf.file_entry(path / n) for n in names[rank::world]}
        if world == 1:
            return mine
        share = path / f".hashes.rank{rank}.tmp"
        share.write_text(json.dumps(mine))
        collectives.barrier()
        if rank != 0:
            return {}
        entries: dict[str, dict[str, Any]] = {}
        for r in range(world):
            part = path / f".hashes.rank{r}.tmp"
            entries.update(json.loads(part.read_text()))
            part.unlink()
        return entries

    def _meta(self, trainer: Any) -> dict[str, Any]:
        res = trainer.res
        return {
            "step": trainer.state.step,
            "samples_seen": trainer.state.samples_seen,
            "skipped_steps": trainer.state.skipped_steps,
            "sampler": trainer.sampler.state_dict(step=trainer.state.step),
            "world_size": self.env.world_size,
            "strategy": self.root_cfg.parallel.strategy,
            "format": storage.state_format(trainer.model),
            "global_batch_size": res.global_batch_size,
            "grad_accum_steps": res.grad_accum_steps,
            "config_hash": config_hash(self.root_cfg),
            "model_config_hash": config_hash(self.root_cfg.model),
            "torch_version": torch.__version__,
            "dptrain_version": __version__,
            "time": time.time(),
        }
