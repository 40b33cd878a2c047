"""How `dptrain bench`'s worker and the scripts in benchmarks/ start and time runs (docs/guides/benchmarks.md).

- `run_step`: one step exactly as `dptrain run` takes it;
- `under_torchrun`: the `main` of a script that starts itself under torchrun (N ranks on this host);
- `torchrun_output`: a script under torchrun as a child process, its output captured (one job per variant);
- `dptrain_run`: the real CLI, `python -m dptrain run ...` into a directory, and its metrics.jsonl/summary.json;
- `alternate` and `Ratios`: variants alternated round by round, and the median and range of paired ratios.

The tests' fork harness (tests/support/mp.py, `run_ranks`) stays with the tests; scripts that fork ranks put
tests/ on sys.path. Importing this module imports neither torch nor the trainer.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dptrain.launch.torchrun import run_torchrun

if TYPE_CHECKING:
    import torch

    from dptrain.train.trainer import Trainer

T = TypeVar("T")


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

    # "--": the script's own flags are never read as torchrun's (argparse took `--nproc 4` for an ambiguous
    # abbreviation of --nproc-per-node); torchrun drops it
    return run_torchrun(["--nproc-per-node", str(nproc), "--standalone", script, "--", *argv], restarts=False)


def child_env(**extra: str) -> dict[str, str]:
    """os.environ with PYTHONPATH led by the directory this `dptrain` was imported from (a checkout's src/),
    so a child process runs the same code as the script; plus `extra` variables (OMP_NUM_THREADS="1")."""
    here = str(Path(__file__).resolve().parents[3])
    paths = [here, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != here)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **extra}


def torchrun_output(script: str, argv: Sequence[str], *, nproc: int, timeout: float | None = None,
                    env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N script argv` as a child process,
    stdout and stderr captured as text: a fresh job per call (what one process keeps, such as the
    allocator's memory or a flight recorder's size, cannot leak into the next variant)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           script, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(env or child_env()))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (metrics.jsonl, diagnostics.jsonl), blank lines skipped."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Run:
    """A finished `dptrain run`: its run directory, exit code, output (stdout then stderr) and wall seconds."""

    out: Path
    returncode: int
    output: str
    seconds: float

    def records(self) -> list[dict[str, Any]]:
        """Every record of the run's metrics.jsonl."""
        return read_jsonl(self.out / "metrics.jsonl")

    def steps(self) -> list[dict[str, Any]]:
        """The per-step records (those with a loss)."""
        return [r for r in self.records() if "loss" in r]

    def step_times(self, *, after: int = 0) -> list[float]:
        """`step_time_s` of the records past step `after` (steps up to `after` are warm-up)."""
        return [r["step_time_s"] for r in self.records() if "step_time_s" in r and r["step"] > after]

    def summary(self) -> dict[str, Any]:
        """The run's summary.json."""
        return dict(json.loads((self.out / "summary.json").read_text()))


def dptrain_run(items: Sequence[str], *, out: Path, nproc: int | None = None, check: bool = True,
                timeout: float | None = None, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Run:
    """`python -m dptrain run ITEMS [--nproc-per-node N] --out OUT` as a child process (the real CLI: launcher,
    logging, checkpoints as configured); ITEMS are a config file, key=value overrides and options. With
    `check`, a non-zero exit raises RuntimeError with the output's tail; a timeout is exit code 124."""
    cmd = [sys.executable, "-m", "dptrain", "run", *items, *(["--nproc-per-node", str(nproc)] if nproc else []),
           "--out", str(out)]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(env or child_env()),
                           cwd=cwd)
        code, output = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        partial = [s.decode(errors="replace") if isinstance(s, bytes) else s for s in (e.stdout, e.stderr) if s]
        code, output = 124, f"timed out after {timeout:.0f} s\n" + "".join(partial)
    run = Run(Path(out), code, output, time.perf_counter() - t0)
    if check and code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}:\n{output[-3000:]}")
    return run


def alternate(variants: Mapping[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """Each of `rounds` rounds calls every variant once, in order, so that a slow phase of a shared
    machine lands on all of them alike; each variant's results, one per round."""
    results: dict[str, list[T]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            results[name].append(fn())
    return results


@dataclass(frozen=True)
class Ratios:
    """The ratios of paired measurements (round i of one variant over round i of another): their
    median and range. `str` is `1.046 (1.022-1.077)`."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, numerator: Sequence[float], denominator: Sequence[float]) -> Ratios:
        if len(numerator) != len(denominator) or not numerator:
            raise ValueError(f"paired ratios need two equally long, non-empty series, got {len(numerator)} "
                             f"and {len(denominator)} values")
        r = [a / b for a, b in zip(numerator, denominator, strict=True)]
        return cls(statistics.median(r), min(r), max(r))

    def __str__(self) -> str:
        return f"{self.median:.3f} ({self.low:.3f}-{self.high:.3f})"
