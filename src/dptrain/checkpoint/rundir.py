"""What the launcher decides about a run directory before anything starts: a run directory is
never silently reset or rewritten.

| the directory holds                         | `--resume auto` (default)            | `--resume none`                         |
|---------------------------------------------|--------------------------------------|-----------------------------------------|
| nothing                                     | a new run                            | a new run                               |
| a committed checkpoint, step < max_steps    | continue from it                     | refused (checkpoints are data)          |
| committed checkpoints, none verifies        | refused, exit 2, each folder named   | all moved to `previous/N/`, new run     |
| a committed checkpoint, step >= max_steps   | "finished", nothing changes, exit 0  | refused                                 |
| records (metrics, summary, ...), no checkpoint | refused, exit 2                   | records moved to `previous/N/`, new run |

`--resume PATH` that holds no valid checkpoint is refused (exit 2) naming every folder and why.
Only committed checkpoints count here: the newest one whose files match its manifest (hashes checked
here, newest first, stopping at the first that verifies; the workers check it again as they load it).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from dptrain.checkpoint import manifest as mf
from dptrain.config import Config, ConfigError

RECORDS = ("metrics.jsonl", "summary.json", "diagnostics.jsonl", "attempts.jsonl", "final", "config.yaml",
           "tensorboard", "console.log", "status")
"""What a run writes into its directory besides checkpoints: kept aside, never deleted."""

TRAINING_RECORDS = ("metrics.jsonl", "summary.json", "final")
"""Records that mean steps were trained (a config or a diagnostics file alone does not)."""

PENDING_CONFIG = "config.pending.yaml"
"""The config the launcher hands to its workers; `config.yaml` is written only once they started."""


@dataclass(frozen=True)
class Finished:
    """The run in the directory already reached `train.max_steps`: nothing to do."""

    step: int
    checkpoint: Path

    def message(self, *, run_dir: Path, max_steps: int) -> str:
        return (f"dptrain: {run_dir} is a finished run: its checkpoint {self.checkpoint.name} is at step {self.step} "
                f"and train.max_steps={max_steps}; nothing was changed. Raise train.max_steps to train on, or use a "
                "new --out for a new run")


def existing_records(run_dir: Path) -> list[str]:
    """The records of an earlier run in `run_dir` (non-empty files and folders), by name."""
    out = []
    for name in RECORDS:
        p = run_dir / name
        if p.is_dir() and any(p.iterdir()) or p.is_file() and p.stat().st_size > 0:
            out.append(name)
    return out


def _describe(records: list[str], run_dir: Path) -> str:
    metrics = run_dir / "metrics.jsonl"
    if "metrics.jsonl" in records:
        with open(metrics, "rb") as f:
            n = sum(1 for _ in f)
        return ", ".join(f"metrics.jsonl ({n} records)" if r == "metrics.jsonl" else r for r in records)
    return ", ".join(records)


def check_run_dir(cfg: Config, *, run_dir: Path, resume: str) -> Finished | None:
    """Apply the table above for `--resume auto|none` (a PATH is checked by `prepare_resume`).
    Returns Finished when there is nothing to do; raises ConfigError (exit 2) for a refusal; moves an
    earlier run's records aside for `--resume none`."""
    root = mf.checkpoint_root(cfg.checkpoint, run_dir)
    infos = mf.list_checkpoints(root, check_hashes=False)
    committed = [i for i in infos if i.valid]
    records = [r for r in existing_records(run_dir) if r in TRAINING_RECORDS]
    # The workers resume from the newest committed folder whose files match its manifest. Make sure one
    # does before anything starts: with none, continuing would start at step 0 and overwrite the evidence.
    usable = next((i for i in reversed(committed) if mf.inspect_dir(i.path).valid), None) if committed else None
    if resume == "none":
        if usable is not None:
            raise ConfigError(
                f"--resume none, but {root} holds committed checkpoints of an earlier run (newest: "
                f"{committed[-1].path.name}); a later --resume auto or an elastic restart would pick them up. "
                "Use a new --out, or move that directory away"
            )
        if records or infos:
            moved = move_aside(run_dir, [i.path for i in infos])
            print(f"dptrain: --resume none: the earlier run's records ({_describe(records, moved) if records else 'none'}"
                  f"{', and ' + str(len(infos)) + ' unusable checkpoint folder(s)' if infos else ''}) were moved to "
                  f"{moved}; starting a new run in {run_dir}", file=sys.stderr)
        return None
    if resume != "auto":
        return None
    if usable is not None:
        if usable.step >= cfg.train.max_steps:
            return Finished(step=usable.step, checkpoint=usable.path)
        return None
    if committed:
        why = "".join(f"\n  {i.path}: {i.state}: {i.reason}" for i in reversed(mf.list_checkpoints(root)))
        raise ConfigError(
            f"{run_dir}: no checkpoint to continue from, every checkpoint folder is unusable:{why}\n"
            "Continuing would start at step 0 and overwrite them. Pass --resume none to move them (and the run's "
            "records) to previous/ and start over, or --resume STEP_FOLDER --trust-checkpoint to load one anyway"
        )
    if records:
        skipped = "".join(f"\n  {i.path}: {i.state}: {i.reason}" for i in infos)
        raise ConfigError(
            f"{run_dir} holds records of an earlier run ({_describe(records, run_dir)}) but no checkpoint to continue "
            f"from{' (every checkpoint folder is unusable:' + skipped + chr(10) + ')' if infos else ''}. Pass "
            "--resume none to start over in it (the old records are moved to previous/, not deleted), or use a new --out"
        )
    return None


def move_aside(run_dir: Path, checkpoint_dirs: list[Path], *, names: tuple[str, ...] = RECORDS) -> Path:
    """Move the records `names` in `run_dir` and the given (unusable) checkpoint folders into
    `run_dir/previous/N/` (N: the next free number); returns that folder."""
    base = run_dir / "previous"
    n = 1
    while (base / str(n)).exists():
        n += 1
    dest = base / str(n)
    (dest / "checkpoints").mkdir(parents=True)
    for name in names:
        if (run_dir / name).exists():
            shutil.move(str(run_dir / name), str(dest / name))
    for d in checkpoint_dirs:
        shutil.move(str(d), str(dest / "checkpoints" / d.name))
    if not any((dest / "checkpoints").iterdir()):
        (dest / "checkpoints").rmdir()
    return dest


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so that it is whole or absent, never empty or torn (a full disk). The
    temporary name is this process's own: the launchers of several nodes sharing a run directory
    (one filesystem) may write the same file at once, and each replace is then whole."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
