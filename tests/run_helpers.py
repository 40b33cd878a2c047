"""For tests that start the real `dptrain` command in a subprocess: the toy recipe as `dptrain run`
overrides, and the environment that imports this checkout's dptrain (and, if asked, tests/' helpers)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TOY_RUN = [
    "model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
    "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every_steps=1", "train.eval_every_steps=0",
    "log.progress=false",
]
"""The tests' MLP on its regression data: 8 samples a step in micro-batches of 2, a log record every
step, no evaluation, no progress line."""


def subprocess_env(*, tests: bool = True) -> dict[str, str]:
    """os.environ with PYTHONPATH led by this checkout's src/ and, with `tests`, tests/ (the loss
    functions and factories the tests define, e.g. `slow_loss:slow_loss`)."""
    paths = [str(ROOT / "src"), *([str(ROOT / "tests")] if tests else []), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
