"""CheckpointManager: when to save, what a checkpoint holds, and how a run resumes.

The manager works on a `CheckpointState` (checkpoint/state.py): named Stateful objects for the
model parts, optimizers, LR schedule, grad scaler, data position, train state and per-rank
state. It never sees the Trainer. The caller uses four things: `maybe_resume(state)` after
building, `maybe_save(state, step=...)` at every step boundary (it also runs the preemption
agreement), `save_final(state)` at the end, and `close()`.

A checkpoint folder `step_NNNNNN/` holds:

- `model.pt` + `optim.pt` (full format) or `dcp/` (sharded format), see `storage.py`;
- `train.pt` (rank 0): LR schedule and grad scaler state;
- `rank_RRRRR.pt` (every rank): that rank's RNG states and its `per_rank` entries (the logging window);
- `manifest.json`: size and SHA-256 of every file above, and `meta` (JSON): format version, step,
  samples seen, data position, world size, strategy, format, config hashes, torch/dptrain versions;
- `COMMITTED`, written last.

`meta.format_version` says how the files are laid out; restore.py reads the versions this dptrain can.
"""

from __future__ import annotations

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
from dptrain.checkpoint.attempts import ProgressFile, previous_attempt, report_restart
from dptrain.checkpoint.full_disk import agree, caught, disk_full, run_dir_full
from dptrain.checkpoint.manifest import checkpoint_root  # noqa: F401 - re-exported (torch-free home)
from dptrain.checkpoint.preempt import PreemptionFlag
from dptrain.checkpoint.restore import FORMAT_VERSION, config_hash, load_checkpoint, model_config_hash
from dptrain.checkpoint.resume import ResumeChoice, Wording, choose_checkpoint, newest_committed, truncate_metrics
from dptrain.checkpoint.rundir import move_aside
from dptrain.checkpoint.snapshots import LiveState, MemoryChoice, MemorySnapshots, recover, snapshot_files
from dptrain.checkpoint.state import CheckpointState, RngState
from dptrain.config import Config
from dptrain.config.nodes import is_elastic
from dptrain.config.resolve import snapshot_every
from dptrain.distributed import collectives
from dptrain.distributed.env import DistEnv


class CheckpointManager:
    """Saves and restores a run's complete state (a CheckpointState); see the module docstring."""

    def __init__(
        self, *, cfg: Config, run_dir: Path, env: DistEnv, resume: str = "auto", trust: bool = False,
        announce_fresh_start: bool = False, words: Wording = Wording(),
    ) -> None:
        self.words = words  # how refusals name the caller's argument (`dptrain run`'s --resume by default)
        self.cfg = cfg.checkpoint
        self.announce_fresh_start = announce_fresh_start  # one line when `auto` finds nothing (the API says so)
        self.root_cfg = cfg
        self.run_dir = run_dir
        self.root = checkpoint_root(cfg.checkpoint, run_dir)
        self.env = env
        # After an elastic restart the newest checkpoint is the one to continue from, whatever was asked.
        self.resume = "auto" if env.restart_count > 0 else resume
        self.trust = trust
        self.last_saved_step: int | None = None
        self.resumed_from: Path | None = None
        self.resumed_message = ""  # what a second Ctrl-C says was saved last, once resumed
        self.interrupted = False  # the run stopped for a Ctrl-C (SIGINT) rather than a SIGTERM
        self.initial_val_loss: float | None = None
        self.preemption: PreemptionFlag | None = None
        self.progress: ProgressFile | None = None
        self._pending: tuple[Path, Future, dict[str, Any], float] | None = None  # save in flight
        self._executor: ThreadPoolExecutor | None = None
        self._async_group: Any = None
        self.memory = MemorySnapshots(
            every_steps=snapshot_every(cfg, max_restarts=env.max_restarts),
            root=cfg.checkpoint.snapshot_dir, run_dir=run_dir, env=env,
            auto=cfg.checkpoint.snapshot_every_steps is None,
        )
        self.resumed_from_memory: MemoryChoice | None = None
        self._snapshot_at = 0  # the next boundary at which to ask the snapshots whether one is due
        self._live = LiveState()  # the snapshots' state dicts, cheap once checked
        self._memory_t0 = 0.0
        self._config_hashes: dict[str, str] = {}

    def _say(self, message: str) -> None:
        if self.env.is_main:
            print(message, file=sys.stderr, flush=True)

    def _flag(self) -> PreemptionFlag:
        if self.preemption is None:  # made at the same point on every rank: it creates a process group
            self.preemption = PreemptionFlag()
            if self.resumed_message:
                self.preemption.last_saved = self.resumed_message
        return self.preemption

    # ------------------------------------------------------------------ resume
    def maybe_resume(self, state: CheckpointState, *, preemption: bool = True) -> bool:
        """Restore the newest usable checkpoint (per `resume`) into `state`; True if one was loaded.
        With `preemption`, also installs the SIGTERM handler and its agreement (else the first
        `maybe_save` does). Collective: call on every rank."""
        if preemption:
            self._flag()
        choice = ResumeChoice()
        elastic = self.env.launched and is_elastic(self.root_cfg.launch)
        # every rank's (host, restart count): a node that joined has a restart count of its own
        members = collectives.all_gather_object((self.env.hostname, self.env.restart_count)) if elastic else None
        attempt = max(c for _, c in members) if members else self.env.restart_count
        generation = 0
        from_memory = self.memory.enabled and attempt > 0 and self.resume == "auto"
        if self.env.is_main:  # a restart that may resume from memory hashes no disk checkpoint unless it needs one
            choice = newest_committed(self.root) if from_memory else self._choose(choice)
        memory: MemoryChoice | None = None
        if self.memory.enabled:
            choice = collectives.broadcast_object(choice)
            memory, choice = self._recover_memory(choice, attempt=attempt)
        if self.env.is_main:
            if attempt > 0 or elastic:
                resumed = memory.step if memory else int(choice.meta.get("step", 0)) if choice.path else 0
                report = report_restart(
                    self.run_dir,
                    attempt=attempt,
                    hosts=[h for h, _ in members] if members else None,
                    resumed_step=resumed,
                )
                if report:
                    choice.messages.insert(0, report)
            prev = previous_attempt(self.run_dir) if elastic else None
            generation = prev["generation"] + 1 if prev else 0
        choice, generation = collectives.broadcast_object(
            (choice, generation)
        )  # nobody rewrites its file before the report
        if self.env.launched and (self.root_cfg.launch.max_restarts > 0 or elastic):
            self.progress = ProgressFile(
                self.run_dir,
                rank=self.env.rank,
                attempt=attempt,
                generation=generation,
                host=self.env.hostname,
                world_size=self.env.world_size,
            )
        for line in choice.messages:
            self._say(line)
        if choice.error:
            raise mf.CheckpointError(choice.error)
        if memory is not None:
            step = self._load(state, memory.path, memory.meta)
            self.resumed_from = memory.path
            self.resumed_from_memory = memory
            if choice.path:  # the disk's newest is older: the end-of-run save must not be skipped
                self.last_saved_step = int(choice.meta["step"])
            if self.env.is_main:
                self.initial_val_loss = truncate_metrics(self.run_dir / "metrics.jsonl", step=step)
            self._say(f"{memory.message} (found, gathered and loaded in {time.perf_counter() - self._memory_t0:.2f}s)")
            return True
        if choice.path is None:
            metrics = self.run_dir / "metrics.jsonl"
            if self.env.is_main and metrics.is_file() and metrics.stat().st_size > 0:
                # starting over in this directory: its metrics start over, the old ones are kept aside

                moved = move_aside(self.run_dir, [], names=("metrics.jsonl",))
                self._say(
                    f"dptrain: no checkpoint to continue from: starting at step 0; the earlier metrics.jsonl "
                    f"was moved to {moved}"
                )
            elif self.announce_fresh_start and self.resume == "auto" and not choice.messages:
                self._say(f"dptrain: no checkpoint in {self.root}: starting at step 0")
            return False
        step = self._load(state, Path(choice.path), choice.meta)
        self.resumed_from = Path(choice.path)
        self.last_saved_step = step
        self.resumed_message = f"the last committed checkpoint is {choice.path} (step {step})"
        if self.preemption is not None:
            self.preemption.last_saved = self.resumed_message
        if self.env.is_main:
            self.initial_val_loss = truncate_metrics(self.run_dir / "metrics.jsonl", step=step)
        self._say(f"dptrain: resumed from {choice.path} at step {step}")
        return True

    def _recover_memory(self, choice: ResumeChoice, *, attempt: int) -> tuple[MemoryChoice | None, ResumeChoice]:
        """After a restart (the same resume rule as `auto`), the newest in-memory snapshot at least as new as the
        disk's `choice`, assembled on every node (None: resume from disk), and the disk's choice, verified when it
        is needed. An unverified `choice` (`newest_committed`) is verified only when no snapshot reaches it: an
        older valid disk checkpoint (the newest one corrupt) then lets an older snapshot qualify. Collective."""
        restarted = attempt > 0 and self.resume == "auto" and not choice.error
        self.memory.start(fresh=not restarted)
        if not restarted:
            return None, choice
        self._memory_t0 = time.perf_counter()
        memory, messages = recover(self.memory, min_step=choice.step, keep_if_none=not choice.verified)
        if memory is None and not choice.verified:
            if self.env.is_main:
                choice = self._choose(ResumeChoice())
            choice = collectives.broadcast_object(choice)
            memory, messages = recover(self.memory, min_step=choice.step)
        choice.messages.extend(messages)
        return memory, choice

    def _choose(self, choice: ResumeChoice) -> ResumeChoice:
        found = choose_checkpoint(self.resume, root=self.root, trust=self.trust, words=self.words)
        found.messages[:0] = choice.messages
        return found

    def record_error(self, message: str) -> None:
        """Note the error this rank is dying with in its progress file (for the restart report)."""
        if self.progress is not None:
            self.progress.error(message)

    def disk_full_line(self, error: BaseException) -> str | None:
        """The one line for `error` when it is a run record that did not fit on a full disk (None otherwise)."""
        return run_dir_full(error, self.run_dir, self.root) if disk_full(error, self.run_dir) else None

    def record_progress(self, step: int) -> None:
        """Note `step` as this rank's last finished step in its progress file (for the restart report).
        Called at log steps (the trainer) and saves (`maybe_save`), not every step: the report's
        "last finished step" and "steps lost" are those of the last log line or checkpoint."""
        if self.progress is not None:
            self.progress.step(step)

    def _load(self, state: CheckpointState, path: Path, meta: dict[str, Any]) -> int:
        """Load `path` into `state`; the step it holds (restore.py)."""
        return load_checkpoint(state, path, meta, model=self.root_cfg.model, rank=self.env.rank,
                               world_size=self.env.world_size, fresh=self.words.fresh)

    # ------------------------------------------------------------------ save
    def maybe_save(self, state: CheckpointState, *, step: int, rng: dict[str, Any] | None = None) -> bool:
        """At the boundary of step `step`: the preemption agreement, committing a finished background
        save, saving when due or when preempted. Collective. Returns True when the run must stop now
        (the checkpoint is committed on every rank by then)."""
        flag = self._flag()
        stop, any_busy = flag.collect()  # started at the previous boundary (see preempt.py)
        if self._pending is not None and not any_busy:
            self._finish_pending()  # every rank's files are on disk: hash, manifest, marker
        due = self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
        if due or stop:
            self.record_progress(step)
        if (due or stop) and self.last_saved_step != step:
            self.save(state, background=self.cfg.async_save and not stop, rng=rng)
        if stop:
            if self.progress is not None:
                self.progress.stopped()
            self.interrupted = flag.interrupted_agreed
            self.close()
            why = "interrupted (Ctrl-C)" if self.interrupted else "preempted (SIGTERM)"
            self._say(f"dptrain: {why}: saved step {step}; resume with the same command")
            return True
        if step >= self._snapshot_at:  # (a steady step does not call into the snapshots)
            if self.memory.due(step):
                files, shards, version = self._snapshot_files(state)
                meta = {**self._meta(state), "format_version": version}
                self.memory.snapshot(step=step, files=files, meta=meta, shards=shards)
            self._snapshot_at = self.memory.next_due(step)
        flag.start(busy=self._pending is not None and not self._pending[1].done())
        return False

    def _snapshot_files(self, state: CheckpointState) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
        """This rank's share of a checkpoint as live state, its shards and their format version (snapshots/)."""
        return snapshot_files(state, self._live, rank=self.env.rank, version=FORMAT_VERSION,
                              pipeline=self.root_cfg.parallel.pp > 1)

    def save_final(self, state: CheckpointState) -> None:
        """The end-of-run checkpoint (skipped when this step was just saved); waits for any
        background save, so nothing is left half-written when the process exits."""
        if self.preemption is not None:
            self.preemption.close()  # the last boundary's agreement: finish it before anything else
        step = int(state.train.state_dict()["step"])
        if self.last_saved_step != step:
            self.save(state, background=False)
        self.close()

    def close(self, *, wait: bool = True) -> None:
        """Finish (`wait`, collective) or abandon (a failing run) background work; restore SIGTERM."""
        if wait:
            self._finish_pending()
            self.memory.finish(remove=True)  # the run ended with its state on disk: memory is not needed
        if self._executor is not None:
            self._executor.shutdown(wait=wait)
            self._executor = None
        if self.preemption is not None:
            self.preemption.close(wait=wait)

    def save(self, state: CheckpointState, *, background: bool = False, rng: dict[str, Any] | None = None) -> Path:
        """Write the checkpoint of the current step, then hash and commit it. Collective. With
        `background`, only the snapshot is taken now; the commit follows at the first step
        boundary after every rank has finished writing (see `maybe_save`). `rng`: this rank's RNG
        states to save (`RngState().state_dict()` taken earlier) instead of the current ones."""
        self._finish_pending()  # one save in flight at a time
        meta = self._meta(state)
        step, rank = meta["step"], self.env.rank
        path = self.root / mf.step_dir_name(step)
        t0 = time.perf_counter()
        error = None
        if self.env.is_main:
            error = caught(lambda: self._fresh_folder(path), self.root)
        self._agree(path, error)  # every rank waits for the folder (a barrier); a full disk stops here
        written: Future = Future()

        def write() -> None:
            nonlocal written
            if background:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dptrain-ckpt")
                    self._async_group = torch.distributed.new_group(backend="gloo")  # the checkpoint's own collectives
                written = storage.async_save_model_optim(
                    path, state=state, rank=rank, process_group=self._async_group, executor=self._executor
                )
            else:
                storage.save_model_optim(path, state=state, rank=rank)
                written.set_result(None)
            if rank == 0:
                scaler = state.scaler.state_dict() if state.scaler is not None else None
                storage.save_torch(path / "train.pt",
                                   {"scheduler": state.schedule.state_dict(), "scaler": scaler or None})
                for name, obj in state.extra_files.items():
                    storage.save_torch(path / name, obj)
            own = {"rng": rng or RngState().state_dict(), **{n: obj.state_dict() for n, obj in state.per_rank.items()}}
            storage.save_torch(path / f"rank_{rank:05d}.pt", own)

        self._agree(path, caught(write, self.root))  # a full disk on any rank: the folder goes, every rank stops
        self._pending = (path, written, meta, t0)
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
        # a failed background write re-raises here: never committed then; agreeing is the barrier
        self._agree(path, caught(written.result, self.root))
        entries = self._hash_files(path, rank=self.env.rank, world=self.env.world_size)
        error = None
        if self.env.is_main:
            error = caught(lambda: mf.commit(path, manifest_sha256=mf.write_manifest(path, files=entries, meta=meta)),
                           self.root)
            if error is None:
                for old in mf.prune(self.root, keep_last=self.cfg.keep_last):
                    self._say(f"dptrain: removed old checkpoint {old}")
        self._agree(path, error)  # nobody moves on (or exits) before the commit
        if self.preemption is not None:
            self.preemption.last_saved = f"the last committed checkpoint is {path} (step {meta['step']})"
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
        self._agree(path, caught(lambda: share.write_text(json.dumps(mine)), self.root))  # a barrier
        if rank != 0:
            return {}
        entries: dict[str, dict[str, Any]] = {}
        for r in range(world):
            part = path / f".hashes.rank{r}.tmp"
            entries.update(json.loads(part.read_text()))
            part.unlink()
        return entries

    def _fresh_folder(self, path: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if path.exists():  # overwriting: the marker goes first, then the old data
            mf.uncommit(path)
            shutil.rmtree(path)
        path.mkdir()

    def _agree(self, path: Path, error: BaseException | None) -> None:
        """A barrier that also agrees whether any rank's write of `path` failed for a full disk (then the folder is
        removed and CheckpointDiskFull raised on every rank: checkpoint/full_disk.py)."""
        agree(error, path=path, root=self.root, is_main=self.env.is_main)

    def _hashes(self) -> dict[str, str]:
        """The config's hashes, taken at the first checkpoint or snapshot (the config is fixed once training runs;
        hashing it costs a millisecond, which a snapshot at every step would pay)."""
        if not self._config_hashes:
            self._config_hashes = {"config_hash": config_hash(self.root_cfg),
                                   "model_config_hash": model_config_hash(self.root_cfg.model)}
        return self._config_hashes

    def _meta(self, state: CheckpointState) -> dict[str, Any]:
        train = state.train.state_dict()
        return {
            "format_version": FORMAT_VERSION,
            "step": int(train["step"]),
            "samples_seen": int(train["samples_seen"]),
            "skipped_steps": int(train.get("skipped_steps", 0)),
            "sampler": state.data.state_dict(),
            "world_size": self.env.world_size,
            "strategy": self.root_cfg.parallel.strategy,
            "format": storage.format_of(state),
            **state.meta,
            **self._hashes(),
            "torch_version": torch.__version__,
            "dptrain_version": __version__,
            "time": time.time(),
        }
