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
    except OSError as e:  # a full disk: named by the file meant, not the temporary one
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


ORPHANS_WAIT_S = 60.0
"""How long a launcher waits for the workers of a killed launcher to save their last step and exit."""
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

    def acquire(self, *, wait_for_orphans_s: float = ORPHANS_WAIT_S) -> None:
        """Take the directory exclusively, or raise RunDirBusy naming who has it. When its launcher is dead (killed:
        its workers still save their last step before they exit), wait up to `wait_for_orphans_s` for them, saying
        so in one line, then take it."""
        import fcntl

        self.fd = self._open()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        orphans = self.orphaned_by()
        if orphans is not None and self._wait_for(orphans, timeout=wait_for_orphans_s):
            return
        os.close(self.fd)
        self.fd = None
        if orphans is not None:
            raise RunDirBusy(
                f"{self.run_dir} is still held by {orphans.describe(self.run_dir)} {wait_for_orphans_s:.0f}s later; "
                f"retry once they have exited, or stop them ({orphans.kill_hint()})"
            )
        raise RunDirBusy(
            f"{self.run_dir} is in use by another dptrain job ({self.owner()}); wait for it to finish, stop "
            "it, or use another --out"
        )

    def _wait_for(self, orphans: Orphans, *, timeout: float) -> bool:
        """Wait for the workers of a dead launcher to release the directory; True once it is this launcher's."""
        import fcntl
        import time

        t0 = time.monotonic()
        print(f"dptrain: {self.run_dir}: {orphans.describe(self.run_dir)}; waiting for them to exit "
              f"(up to {timeout:.0f}s)", file=sys.stderr, flush=True)
        while time.monotonic() - t0 < timeout:
            time.sleep(0.1)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[arg-type]
            except BlockingIOError:
                continue
            print(f"dptrain: they exited after {time.monotonic() - t0:.1f}s; continuing", file=sys.stderr, flush=True)
            return True
        return False

    def orphaned_by(self) -> Orphans | None:
        """The holders of the directory when its owner, a launcher on this host, is dead (its workers are saving
        before they exit); None when the owner lives, is on another host, or is unknown."""
        import json

        try:
            o = json.loads((self.run_dir / "status" / OWNER_FILE).read_text())
            pid, host = int(o["pid"]), str(o["host"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if host != socket.gethostname() or _alive(pid, o.get("create_time")):
            return None
        return Orphans(launcher=pid, workers=lock_holders(self.path), step=_last_step(self.run_dir))

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
        import psutil

        owner = {
            "pid": os.getpid(),
            "create_time": psutil.Process().create_time(),  # with the pid: this process, not a later one reusing it
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


@dataclass(frozen=True)
class Orphans:
    """The workers of a launcher that was killed, still holding its run directory (they save, then exit)."""

    launcher: int
    workers: list[int]
    step: int | None

    def describe(self, run_dir: Path) -> str:
        plural = "s" if len(self.workers) > 1 else ""
        pids = f" (pid{plural} {', '.join(map(str, self.workers))})" if self.workers else ""
        at = f" (step {self.step} was under way)" if self.step else ""
        return f"the workers{pids} of a launcher that was killed (pid {self.launcher}) are saving their last step{at}"

    def kill_hint(self) -> str:
        return f"kill {' '.join(map(str, self.workers))}" if self.workers else "their pids are in status/rank*.json"


def _alive(pid: int, create_time: float | None) -> bool:
    """Whether process `pid` runs (not a zombie) and is the one that wrote the owner file (its start time, when
    recorded, matches: a pid reused by a later process is not the owner)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(proc.create_time() - float(create_time)) < 1.0
    except (psutil.Error, ValueError, TypeError):
        return False


def lock_holders(path: Path) -> list[int]:
    """The pids holding a flock on `path` (from /proc/locks; empty where it is not readable)."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = {int(f[4]) for f in (ln.split() for ln in lines) if len(f) > 5 and f[1] == "FLOCK" and f[5] == inode
            and f[4].isdigit()}
    return sorted(pids)


def _last_step(run_dir: Path) -> int | None:
    """The step the workers were training, as their status files (metrics/status.py, rewritten every second) or
    the step after the last record of metrics.jsonl say, whichever is later."""
    import json

    steps = []
    for f in (run_dir / "status").glob("rank*.json"):
        try:
            steps.append(int(json.loads(f.read_text())["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    try:
        with open(run_dir / "metrics.jsonl", "rb") as records:
            records.seek(max(0, records.seek(0, os.SEEK_END) - 4096))
            tail = records.read().decode(errors="replace").splitlines()
        steps += [int(json.loads(line)["step"]) + 1 for line in tail[-2:] if line.endswith("}") and '"step"' in line]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return max(steps) if steps else None
