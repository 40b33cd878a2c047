"""What `dptrain bench`'s worker and the scripts in benchmarks/ share: `run_step`, one step exactly as
`dptrain run` takes it, and `under_torchrun`, the `main` of a script that starts itself under
torchrun. Importing this module imports neither torch nor the trainer."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from dptrain.launch.torchrun import run_torchrun

if TYPE_CHECKING:
    import torch

    from dptrain.train.trainer import Trainer


def run_step(trainer: Trainer) -> torch.Tensor:
    """`trainer.end_step(trainer.train_step())`, the same step boundary as `dptrain run`; returns the
    step's loss (this rank's share). A preemption is an error here: a benchmark has no resume."""
    loss = trainer.train_step()
    if trainer.end_step(loss):
        raise RuntimeError("preempted during the benchmark")
    return loss


def under_torchrun(worker: Callable[[], object], *, script: str, argv: list[str], nproc: int) -> int:
    """Inside a torchrun worker (torchrun set RANK): run `worker()`, exit code 0. Otherwise start
    `nproc` copies of `script argv` on this host (standalone rendezvous, no restarts) and return
    torchrun's exit code (dptrain.launch.torchrun.run_torchrun)."""
    if "RANK" in os.environ:
        worker()
        return 0

    return run_torchrun(["--nproc-per-node", str(nproc), "--standalone", script, *argv], restarts=False)
