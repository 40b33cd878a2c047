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
"""  # noqa: E501 (a Markdown table: one row a line)

from __future__ import annotations

import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from dptrain.checkpoint import manifest as mf
from dptrain.config import Config, ConfigError

RECORDS = (
    "metrics.jsonl",
    "summary.json",
    "diagnostics.jsonl",
    "attempts.jsonl",
    "final",
    "config.yaml",
    "tensorboard",
    "console.log",
    "status",
)
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
        return (
            f"dptrain: {run_dir} is a finished run: its checkpoint {self.checkpoint.name} is at step {self.step} "
            f"and train.max_steps={max_steps}; nothing was changed. Raise train.max_steps to train on, or use a "
            "new --out for a new run"
        )


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
            print(
                f"dptrain: --resume none: the earlier run's records ({_describe(records, moved) if records else 'none'}"
                f"{', and ' + str(len(infos)) + ' unusable checkpoint folder(s)' if infos else ''}) were moved to "
                f"{moved}; starting a new run in {run_dir}",
                file=sys.stderr,
            )
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
            "--resume none to start over in it (the old records are moved to previous/, not deleted), "
            "or use a new --out"
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


OWNER_FILE = "owner.json"
"""In the run directory's `status/`: which launcher owns the run (pid, host, start time, command)."""


class RunDirBusy(ConfigError):
    """Another dptrain job owns the run directory."""


class RunDirLock:
    """One owner per run directory, released by the kernel when its holders die (flock).

    The launcher takes it exclusively before it reads the directory (`acquire`), so a second job
    started in a live run is refused, naming the holder's pid and host; once it starts the workers it
    keeps a shared hold (`share`) and every worker takes a shared hold of its own (`hold_shared`). A
    launcher killed with SIGKILL thus leaves the directory locked until its last worker has exited
    (they are told to stop by the parent-death signal, launch/worker.py), and a lock left by a dead
    job is simply free. Single-node runs lock the directory itself (no file is added); the launchers
    of a multi-node job share one directory, so each locks `.lock.<host>` in it instead.
    """

    def __init__(self, run_dir: Path, *, per_host: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / f".lock.{socket.gethostname()}" if per_host else self.run_dir
        self.fd: int | None = None
        self.created: list[Path] = []  # directories the lock made: removed again if left empty

    def _open(self) -> int:
        if not self.run_dir.exists():
            self.created = [d for d in (self.run_dir, *self.run_dir.parents) if not d.exists()]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.path == self.run_dir:
            return os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def acquire(self) -> None:
        """Take the directory exclusively, or raise RunDirBusy naming who has it."""
        import fcntl

        self.fd = self._open()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            raise RunDirBusy(
                f"{self.run_dir} is in use by another dptrain job ({self.owner()}); wait for it to finish, stop "
                "it, or use another --out"
            ) from None

    def owner(self) -> str:
        """Who holds the directory, as its owner file says."""
        import json

        try:
            o = json.loads((self.run_dir / "status" / OWNER_FILE).read_text())
            return f"launcher pid {o['pid']} on host {o['host']}, started {o['started']}"
        except (OSError, ValueError, KeyError):
            return "its launcher has not written status/owner.json yet"

    def share(self, command: list[str]) -> None:
        """Write the owner file, then keep a shared hold while the workers (which take their own) run."""
        import fcntl
        import json
        import time

        assert self.fd is not None, "acquire() first"
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": command,
        }
        (self.run_dir / "status").mkdir(exist_ok=True)
        write_atomically(self.run_dir / "status" / OWNER_FILE, json.dumps(owner) + "\n")
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a conversion: EX -> SH
        except BlockingIOError:
            raise RunDirBusy(f"{self.run_dir} was taken by another dptrain job as this one started") from None

    def hold_shared(self) -> None:
        """A worker's own shared hold, kept until the process exits."""
        import fcntl

        self.fd = self._open()
        fcntl.flock(self.fd, fcntl.LOCK_SH)

    def release(self) -> None:
        """Let go; a directory the lock created and nothing was written into is removed (a refused
        start leaves nothing behind)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        for d in self.created:
            try:
                d.rmdir()  # only if empty
            except OSError:
                break
        self.created = []
