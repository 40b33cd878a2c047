"""`Diagnostics`: the one object the trainer talks to.

The trainer calls it at a few fixed points: `preflight(model)` before the strategy wraps the
model, `start()` before the first step, `phase(name)` when the step enters data loading,
forward, backward or the optimizer, `skip_step(loss, grad_norm)` before `optimizer.step()`,
`on_step_end(step)` after it, and `close()`. A steady step calls none of them: the trainer writes
the heartbeat into `pulse` itself (diagnostics/watchdog.py's `Pulse`: attribute stores, which the
watchdog thread reads) unless `phase_hook()` asks for the calls (the straggler split's timed steps),
calls `skip_step` only when a non-finite policy is on, and `on_step_end` only at the steps
`next_check` names. `diagnostics.profile_steps` is a `StepProfiler`
(profiler.py) started here and advanced in `on_step_end`. Each check is a small object of its own module;
the hub only routes calls and writes findings to `RUN_DIR/diagnostics.jsonl` (rank 0) and the
console.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from dptrain.config import DiagnosticsConfig, hang_timeout
from dptrain.config.speed_checks import parse_profile_steps
from dptrain.data.loader import LOADER_STACKS_ENV
from dptrain.diagnostics.collective_record import install_abort_record, record_failure
from dptrain.diagnostics.drift import ReplicaDriftError, check_replicas
from dptrain.diagnostics.nonfinite import NonFiniteGuard, describe_origin, first_nonfinite_steps
from dptrain.diagnostics.preflight import run_preflight
from dptrain.diagnostics.profiler import StepProfiler
from dptrain.diagnostics.rss import MemoryMonitor, describe_leak, gpu0_pids, stray_gpu0_contexts
from dptrain.diagnostics.straggler import SAMPLE_STEPS, StepTimer, describe, find_stragglers, gather_rows
from dptrain.diagnostics.watchdog import Pulse, Watchdog, job_store
from dptrain.distributed.env import DistEnv
from dptrain.distributed.mesh import ParallelMesh
from dptrain.metrics import strict_json
from dptrain.parallel import is_sharded, unwrap


def apply_collective_checks(cfg: DiagnosticsConfig) -> None:
    """Before the process group exists: have torch check every collective's op and shapes across
    ranks (its ProcessGroupWrapper, enabled by TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    if cfg.check_collectives:
        import torch.distributed as dist

        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()  # torch reads the variable when it is imported; re-read it now


SYNC_COLLECTIVE = "gradient reduction in backward"
"""The collective a backward that reduces gradients waits in, as heartbeats name it."""
NEVER = sys.maxsize
"""`next_check`'s answer when no periodic check is on."""


def _default_store() -> Any:
    return job_store()


class Diagnostics:
    """Watchdog, pre-flight, non-finite policy, straggler, drift and memory checks of one rank."""

    def __init__(self, cfg: DiagnosticsConfig, *, env: DistEnv, run_dir: Path, pg_timeout_s: float,
                 say: Any = None) -> None:
        self.cfg, self.env, self.run_dir = cfg, env, Path(run_dir)
        self.hang_timeout_s = hang_timeout(cfg, pg_timeout_s=pg_timeout_s)
        if self.hang_timeout_s > 0:  # DataLoader workers forked from now on answer the watchdog with their stacks
            (self.run_dir / "stacks").mkdir(parents=True, exist_ok=True)
            os.environ[LOADER_STACKS_ENV] = str(self.run_dir / "stacks")
        self.device = torch.device("cpu")
        self.pulse = Pulse()  # the step being trained (1-based) and its phase: heartbeats, reports, the status file
        self.listeners: list[Any] = []  # listener(kind, record) for every finding (the Prometheus counters)
        self._say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self.watchdog: Watchdog | None = None
        self.nonfinite: NonFiniteGuard | None = None
        self.timer: StepTimer | None = None
        self.replica: nn.Module | None = None  # the module whose replicas the drift check compares
        self.replica_group: Any = None  # ...over this group (None: every rank)
        self.memory: MemoryMonitor | None = None
        self.profiler: StepProfiler | None = None
        self.nonfinite_loss: dict[str, int] = {}  # first_step, log_steps (see logged_loss)
        self._sink: TextIO | None = None
        self._sink_lock = threading.Lock()

    # ------------------------------------------------------------------ start / stop
    def preflight(self, model: nn.Module, *, config: dict[str, Any]) -> None:
        """All ranks agree on world size, config and model; else every rank raises the same error."""
        if self.cfg.preflight:
            self.phase("preflight", collective="all_gather_object (pre-flight)")
            run_preflight(world_size=self.env.world_size, config=config, model=model)

    def start(self, model: nn.Module, *, step: int, device: torch.device, loss_scaling: bool = False,
              mesh: ParallelMesh | None = None) -> None:
        """Arm the checks for the strategy-wrapped `model`; `step` is the number of steps already done
        (0, or a resumed step); `loss_scaling`: fp16's scaler handles infinite gradients itself.
        `mesh`: the run's device mesh; the drift check compares its replica group and the straggler
        probe waits on its data-parallel group (without one: every rank, and no drift check when sharded)."""
        self.step, self.device = step + 1, device
        cfg, env = self.cfg, self.env
        if cfg.nonfinite != "off":
            self.nonfinite = NonFiniteGuard(policy=cfg.nonfinite, max_consecutive=cfg.max_consecutive_skips,
                                            rank=env.rank, world_size=env.world_size, device=device,
                                            check_grad_norm=not loss_scaling, report=self.report)
        pipelined = mesh is not None and mesh.dims.pp > 1
        if cfg.straggler_every_steps and pipelined and env.is_main:
            self._say("dptrain: the straggler split is off under pipeline parallelism: stages wait for each other by "
                      "design (the pipeline bubble) and hold different layers, so per-rank compute and wait times "
                      "measure the schedule, not a slow rank")
        if cfg.straggler_every_steps and env.world_size > 1 and not pipelined:
            self.timer = StepTimer(device=device, group=mesh.dp_group if mesh is not None else None)
        if mesh is not None:
            self.replica_group = mesh.replica_group  # None: no replicas (fsdp over one shard group)
            if cfg.drift_every_steps and self.replica_group is not None:
                self.replica = unwrap(model)
        elif cfg.drift_every_steps and env.world_size > 1 and not is_sharded(model):
            self.replica = unwrap(model)  # zero2/fsdp: one copy of each shard, nothing to compare
        if cfg.rss_every_steps:
            self.memory = MemoryMonitor(device=device, window=cfg.rss_window, leak_mb=cfg.rss_leak_mb)
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._sink = open(self.run_dir / "diagnostics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        if (window := parse_profile_steps(cfg.profile_steps)) is not None:
            self.profiler = StepProfiler(window, run_dir=self.run_dir, rank=env.rank, device=device, start_step=step,
                                         say=self._say, is_main=env.is_main)
        if env.world_size > 1:  # a rank gloo aborts (a collective of another size arrived) says what it called
            install_abort_record()
        if self.hang_timeout_s > 0:
            self.watchdog = Watchdog(timeout_s=self.hang_timeout_s, store=_default_store(), rank=self.env.rank,
                                     world_size=self.env.world_size, run_dir=self.run_dir,
                                     on_death=self._watchdog_died, desync_after_s=cfg.desync_after_s,
                                     pulse=self.pulse)
            self.watchdog.start()

    def failed(self, error: BaseException) -> None:
        """The run failed with `error` (nothing torn down yet): leave this rank's unfinished collectives for the
        launcher's verdict (diagnostics/collective_record.py)."""
        if self.env.world_size > 1:
            record_failure(error)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        with self._sink_lock:
            if self._sink is not None:
                self._sink.close()
                self._sink = None

    # ------------------------------------------------------------------ the step
    @property
    def step(self) -> int:
        """The step being trained (1-based), for heartbeats and reports."""
        return self.pulse.step

    @step.setter
    def step(self, step: int) -> None:
        if step != self.pulse.step:
            self.pulse.step, self.pulse.seq = step, 0

    @property
    def phase_name(self) -> str:
        """The phase the training thread is in (read by the status file's thread)."""
        return self.pulse.phase

    def phase(self, name: str, *, sync: bool = False, collective: str | None = None) -> None:
        """The training thread enters `name` (data, forward, backward, optimizer, eval, save, ...);
        `sync`: this backward reduces gradients across ranks (the straggler probe goes just before it)."""
        pulse = self.pulse
        pulse.phase = name
        pulse.seq += 1
        timed = self.timer is not None and self._timed(pulse.step)
        if sync:
            collective = SYNC_COLLECTIVE + (" (after the straggler probe)" if timed else "")
        if collective is not None:
            pulse.collective = collective
        if self.timer is not None and timed:
            if sync:
                self.timer.probe()
            self.timer.mark(name)

    def phase_hook(self) -> Callable[..., None] | None:
        """`phase` when the step about to be trained needs its phases as calls (the straggler split times
        them), else None: the trainer then writes `pulse` itself. Asked after `start` and `on_step_end`."""
        return self.phase if self.timer is not None and self._timed(self.pulse.step) else None

    def next_check(self, step: int) -> int:
        """The first step after `step` at whose end `on_step_end` has work (a periodic check, the straggler
        timer's window, the profiler): the trainer calls it only then. `NEVER` when nothing is on."""
        cfg = self.cfg
        if self.profiler is not None:
            return step + 1
        periods = [every for every, on in ((cfg.straggler_every_steps, self.timer is not None),
                                           (cfg.drift_every_steps, self.replica is not None),
                                           (cfg.rss_every_steps, self.memory is not None),
                                           (cfg.collective_check_every_steps,
                                            self.watchdog is not None and self.watchdog.desync is not None))
                   if on and every]
        if not periods:
            return NEVER
        due = step + 1
        while not (any(due % every == 0 for every in periods)
                   or (self.timer is not None and (self._timed(due) or self._timed(due + 1)))):
            due += 1
        return due

    def _timed(self, step: int) -> bool:
        """Straggler timing (and its probe) covers the last SAMPLE_STEPS steps of every window."""
        k = self.cfg.straggler_every_steps
        return (k - step % k) % k < SAMPLE_STEPS

    def skip_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """nonfinite=skip|error: True when every rank must skip this update (see nonfinite.py)."""
        if self.nonfinite is None:
            return False
        self.phase("optimizer", collective="all_reduce (non-finite flags)")
        return self.nonfinite.skip_step(self.step, loss, grad_norm)

    def summary(self) -> dict[str, Any]:
        """Counters for summary.json."""
        out: dict[str, Any] = {"nonfinite_skipped_steps": self.nonfinite.skipped} if self.nonfinite is not None else {}
        if self.nonfinite_loss:
            out["nonfinite_loss"] = dict(self.nonfinite_loss)
        if self.profiler is not None and self.profiler.summary is not None:
            out["profile"] = {k: v for k, v in self.profiler.summary.items() if k != "communication_ops"}
        return out

    def logged_loss(self, loss: float, *, step: int, window_steps: int,
                    first_bad: Callable[[], int | None] | None = None, device: torch.device | None = None,
                    group: Any = None) -> None:
        """A log step's loss (mean of its window over the data-parallel ranks). One that is not finite
        is said loudly whatever `nonfinite` is: on the console (stderr without the progress line), as a
        `nonfinite_loss` record in diagnostics.jsonl, and counted in the summary. With `first_bad` (this rank's
        first non-finite step of the window, asked only now) and the `group` the mean was taken over, the line names
        the ranks whose data went non-finite first: one more all-reduce, on every rank of the group alike (they all
        hold the same non-finite mean), and only then."""
        if math.isfinite(loss):
            return
        policy = self.cfg.nonfinite
        first = self.nonfinite_loss.setdefault("first_step", step)
        self.nonfinite_loss["log_steps"] = self.nonfinite_loss.get("log_steps", 0) + 1
        since = "" if first == step else f" (first at step {first})"
        origin = (first_nonfinite_steps(first_bad(), device=device or torch.device("cpu"), group=group)
                  if first_bad is not None else {})
        act = ("training goes on: set diagnostics.nonfinite=skip to skip such steps or =error to stop"
               if policy == "off" else f"diagnostics.nonfinite={policy}")
        self.report("nonfinite_loss", {"step": step, "loss": str(loss), "window_steps": window_steps, "policy": policy,
                                       "ranks": sorted(origin), "first_step": {str(r): s for r, s in origin.items()}},
                    f"dptrain: WARNING: the loss is {loss} at step {step}{since}, mean of the last {window_steps} "
                    f"step(s) over the data-parallel ranks{describe_origin(origin)}; {act}")

    def on_step_end(self, step: int) -> None:
        """After optimizer step `step` (1-based): the periodic checks that gather across ranks."""
        if self.timer is not None:
            if self._timed(step):
                self.timer.step_done()
                if step % self.cfg.straggler_every_steps == 0:
                    self._check_stragglers(step)  # the window's last step; resets the timer
            elif self._timed(step + 1):
                self.timer.resume()  # a timed stretch begins; the untimed steps before it do not count
        if self.replica is not None and step % self.cfg.drift_every_steps == 0:
            self._check_drift(step)
        if self.memory is not None and step % self.cfg.rss_every_steps == 0:
            self._check_memory(step)
        if self.profiler is not None:
            self.profiler.step_done(step)
        every = self.cfg.collective_check_every_steps
        if every and step % every == 0 and self.watchdog is not None and self.watchdog.desync is not None:
            self.watchdog.desync.request_check(step)  # the watchdog thread publishes and compares the rings
        self.step = step + 1  # (the trainer has written it already)

    def _check_memory(self, step: int) -> None:
        assert self.memory is not None
        self.phase("diagnostics", collective="all_gather_object (memory)")
        first = len(self.memory.samples) == 0
        env = self.env
        row = {"rank": env.rank, "host": socket.gethostname(), "pid": os.getpid(), "local_rank": env.local_rank,
               **self.memory.sample(step), "leaks": self.memory.leaks()}
        if first and self.device.type == "cuda" and env.local_rank == 0:
            row["gpu0_pids"] = gpu0_pids()  # once: nvidia-smi takes a fraction of a second
        rows = gather_rows(row)
        self.report("memory", {"step": step, "ranks": rows})
        for r in rows:
            for leak in r["leaks"]:
                self.report("memory_leak", {"rank": r["rank"], "host": r["host"], **leak},
                            describe_leak(r["rank"], r["host"], leak))
        for s in stray_gpu0_contexts(rows) if first else []:
            self.report("gpu0_context", s, f"memory: rank {s['rank']} (pid {s['pid']} on {s['host']}) holds a CUDA "
                        "context on GPU 0, which is not its device: it costs GPU 0 memory; call "
                        "torch.cuda.set_device(local_rank) before any CUDA work (dptrain's bind_device does)")

    def _check_drift(self, step: int) -> None:
        assert self.replica is not None
        self.phase("diagnostics", collective="all_gather (replica checksums)")
        t0 = time.perf_counter()
        try:
            check_replicas(self.replica, step=step, group=self.replica_group)
        except ReplicaDriftError as e:
            self.report("drift", {"step": step, "ok": False, "error": str(e)}, str(e))
            raise
        self.report("drift", {"step": step, "ok": True, "seconds": time.perf_counter() - t0})

    def _check_stragglers(self, step: int) -> None:
        assert self.timer is not None
        self.phase("diagnostics", collective="all_gather_object (straggler split)")
        first = step - self.timer.steps + 1
        rows = gather_rows(self.timer.row(self.env.rank))
        self.report("step_split", {"steps": [first, step], "ranks": rows})
        for s in find_stragglers(rows, margin=self.cfg.straggler_margin):
            self.report("straggler", {"steps": [first, step], **s}, describe(s, first=first, last=step))
        self.timer.reset()

    # ------------------------------------------------------------------ reporting
    def report(self, kind: str, record: dict[str, Any], message: str | None = None) -> None:
        """A finding: one line in diagnostics.jsonl and, with a message, one on the console (rank 0)."""
        with self._sink_lock:  # the watchdog thread reports too (watchdog_died)
            if self._sink is not None:
                self._sink.write(strict_json.dumps({"kind": kind, **record}) + "\n")
        for listener in self.listeners:
            listener(kind, record)
        if message and self.env.is_main:
            self._say(message)

    def _watchdog_died(self, error: BaseException) -> None:
        """Called from the watchdog thread when its loop failed: this rank has no hang detection any
        more. Said on this rank's console (every rank, not only rank 0) and recorded in
        diagnostics.jsonl (by rank 0's sink, or appended by this rank to its run dir's file)."""
        env = self.env
        record = {"kind": "watchdog_died", "rank": env.rank, "host": socket.gethostname(), "pid": os.getpid(),
                  "step": self.step, "error": f"{type(error).__name__}: {error}",
                  "traceback": "".join(traceback.format_exception(error)).rstrip()}
        self._say(f"dptrain: warning: rank {env.rank}: the hang watchdog died ({record['error']}); the run goes on "
                  f"WITHOUT hang detection on this rank: a hang now lasts until the process-group timeout "
                  f"(parallel.timeout_s) and names no rank. Recorded in {self.run_dir / 'diagnostics.jsonl'}")
        with self._sink_lock:
            if self._sink is not None:
                self._sink.write(strict_json.dumps(record) + "\n")
                return
        with contextlib.suppress(OSError):  # a rank on another host may not share the run directory
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / "diagnostics.jsonl", "a") as f:
                f.write(strict_json.dumps(record) + "\n")  # one append of one line: safe beside rank 0's writes
