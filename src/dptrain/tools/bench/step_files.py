"""Which of dptrain's source files one training step runs code in, read from the real call path.

`step_files(overrides)` builds `Trainer(load_config(None, overrides))`, sets it up, trains a few warm-up
steps, then runs `trainer.end_step(trainer.train_step())` (exactly `dptrain run`'s per-step path, as
the benchmarks call it) twice under `sys.setprofile`: once for a step that does not log and once for a
logging step (`train.log_every_steps`). A file counts when a Python function defined in it is entered
on the calling thread during the step; files of torch, the standard library and other packages are not
counted, nor background threads (the hang watchdog, the status file, a checkpoint writer). Call it on
every rank inside a launched job (torchrun, or tests/support/mp.py's `run_ranks`): it opens the process
group itself. `benchmarks/architecture/step_files.py` prints the lists; tests/test_step_files.py bounds them.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import dptrain
from dptrain.config.load import load_config
from dptrain.distributed.process_group import process_group
from dptrain.train.trainer import Trainer


@dataclass(frozen=True)
class StepFiles:
    """The dptrain files (paths relative to the package's parent, e.g. `dptrain/train/trainer.py`) of a
    step that does not log (`quiet`) and of a logging step (`logging`)."""

    quiet: frozenset[str]
    logging: frozenset[str]
    quiet_calls: dict[str, int]
    """Python function entries during the quiet step: `dptrain` (in dptrain's files) and `all` (any Python code,
    torch's included): a per-step overhead figure that does not depend on the machine's load."""
    strategy: str
    precision: str
    world_size: int

    def describe(self, *, listing: bool = False) -> str:
        lines = [f"default step (strategy {self.strategy}, precision {self.precision}, world size {self.world_size}): "
                 "dptrain files touched",
                 f"  a step that does not log: {len(self.quiet)}",
                 f"  a logging step:           {len(self.logging)}",
                 f"  Python calls in a step that does not log: {self.quiet_calls['dptrain']} in dptrain's files, "
                 f"{self.quiet_calls['all']} in all"]
        if listing:
            lines += ["", "non-logging step:", *(f"  {f}" for f in sorted(self.quiet)),
                      "", "logging step adds:", *(f"  {f}" for f in sorted(self.logging - self.quiet) or ["(nothing)"])]
        return "\n".join(lines)


def files_of_step(step: Callable[[], Any], *, root: Path, calls: dict[str, int] | None = None) -> set[str]:
    """The files under `root` whose Python functions are entered while `step()` runs (this thread). `calls`, if
    given, counts the entries: `calls["dptrain"]` those under `root`, `calls["all"]` every Python function's."""
    seen: set[str] = set()
    prefix, own = str(root) + os.sep, os.path.abspath(__file__)  # this module's `run_step` is not the step's

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name == own:
                return
            if calls is not None:
                calls["all"] += 1
            if name.startswith(prefix):
                seen.add(os.path.relpath(name, root.parent))
                if calls is not None:
                    calls["dptrain"] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return seen


def step_files(overrides: list[str], *, warmup: int = 2, out_dir: str | None = None) -> StepFiles:
    """Count the files of a quiet and of a logging step of the run `overrides` describe (see the module
    docstring). Collective: every rank of the launched job calls it."""
    cfg = load_config(None, list(overrides))
    trainer = Trainer(cfg, out_dir=out_dir or tempfile.mkdtemp(prefix="dptrain-step-files-"))
    root = Path(dptrain.__file__).resolve().parent
    every = cfg.train.log_every_steps

    def run_step() -> None:  # as dptrain.tools.bench.harness.run_step
        if trainer.end_step(trainer.train_step()):
            raise RuntimeError("preempted")

    with process_group(trainer.env, backend=trainer.res.backend, device=trainer.device, timeout_s=300):
        trainer.setup()
        for _ in range(warmup):  # the first steps build caches, write config.yaml, ...
            run_step()
        while (trainer.state.step + 1) % every == 0:  # the next step must not log
            run_step()
        calls = {"dptrain": 0, "all": 0}
        quiet = files_of_step(run_step, root=root, calls=calls)
        while (trainer.state.step + 1) % every != 0:  # up to the step before a logging one
            run_step()
        logging = files_of_step(run_step, root=root)
        trainer.close()
    return StepFiles(quiet=frozenset(quiet), logging=frozenset(logging), quiet_calls=calls,
                     strategy=cfg.parallel.strategy, precision=cfg.precision.dtype, world_size=trainer.env.world_size)
