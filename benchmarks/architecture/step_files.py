"""How many of dptrain's source files one training step touches, with the default config.

    python benchmarks/architecture/step_files.py [--nproc 1] [--list] [key=value ...]

Starts itself under torchrun (default: 1 process; the default config is the built-in LLaMA,
strategy ddp, fp32). On rank 0, after `Trainer.setup()` and a few warm-up steps, it runs
`trainer.end_step(trainer.train_step())` (exactly `dptrain run`'s per-step path, as the benchmarks
call it) twice under `sys.setprofile`: once for a step that does not log and once for a logging
step (`train.log_every_steps`). It counts the distinct dptrain source files (under the installed
`dptrain` package) whose Python functions are entered on the main thread during the step. Files
of torch, the standard library and other packages are not counted, nor background threads (the
hang watchdog; a checkpoint writer). `--list` prints the files.

Measured here (1 process, CPU): before issue 20's step work (commit a278187) 21 files for a step
that does not log, 28 for a logging step; after it 15 and 24.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--list", action="store_true", help="print the files each step touches")
    p.add_argument("overrides", nargs="*", help="config overrides (key=value); none: the default config")
    return p.parse_args(argv)


def files_of_step(step: Any, *, root: Path) -> set[str]:
    """The files under `root` whose Python functions are entered while `step()` runs (this thread)."""
    seen: set[str] = set()
    prefix = str(root) + os.sep

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(prefix):
                seen.add(os.path.relpath(name, root.parent))

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return seen


def worker(a: argparse.Namespace) -> None:
    import dptrain
    from dptrain.config.load import load_config
    from dptrain.distributed.process_group import process_group
    from dptrain.train.trainer import Trainer

    cfg = load_config(None, list(a.overrides))
    trainer = Trainer(cfg, out_dir=tempfile.mkdtemp(prefix="dptrain-step-files-"))
    root = Path(dptrain.__file__).resolve().parent
    every = cfg.train.log_every_steps

    def run_step(trainer: Trainer) -> None:  # as dptrain.tools.bench.harness.run_step, not counted
        if trainer.end_step(trainer.train_step()):
            raise RuntimeError("preempted")
    with process_group(trainer.env, backend=trainer.res.backend, device=trainer.device, timeout_s=300):
        trainer.setup()
        for _ in range(a.warmup):  # the first steps build caches, write config.yaml, ...
            run_step(trainer)
        while (trainer.state.step + 1) % every == 0:  # the next step must not log
            run_step(trainer)
        quiet = files_of_step(lambda: run_step(trainer), root=root)
        while (trainer.state.step + 1) % every != 0:  # up to the step before a logging one
            run_step(trainer)
        logging = files_of_step(lambda: run_step(trainer), root=root)
        trainer.close()
    if trainer.env.rank == 0:
        print(f"default step (strategy {cfg.parallel.strategy}, precision {cfg.precision.dtype}, "
              f"world size {trainer.env.world_size}): dptrain files touched")
        print(f"  a step that does not log: {len(quiet)}")
        print(f"  a logging step:           {len(logging)}")
        if a.list:
            print("\nnon-logging step:\n  " + "\n  ".join(sorted(quiet)))
            print("\nlogging step adds:\n  " + "\n  ".join(sorted(logging - quiet) or ["(nothing)"]))


def main(argv: list[str]) -> int:
    from dptrain.tools.bench.harness import under_torchrun

    a = _args(argv)
    return under_torchrun(lambda: worker(a), script=__file__, argv=argv, nproc=a.nproc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
