"""A checkpoint that does not fit: told in one line, and nothing already saved is lost.

A full file system (or a quota) shows up in a save as `OSError` errno ENOSPC/EDQUOT, as torch's zip writer's
`RuntimeError` ("[enforce fail at inline_container.cc:...] . unexpected pos ...", "PytorchStreamWriter failed
writing file ..."), or wrapped by DCP (`CheckpointException`, which carries every rank's failure as text). `disk_full`
tells them apart from other failures (torch's writer errors count only when the file system really is nearly full).
The checkpoint manager agrees on it across ranks at the points where it would have waited anyway (`agree`), removes
the half-written folder (it was never committed, so no resume would take it; removing it gives the space back) and
raises `CheckpointDiskFull` on every rank with `explain`'s line: the folder, the free space, the size a checkpoint
needs, what would help, and the last good checkpoint, which stays as it was.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint.manifest import CheckpointError
from dptrain.distributed import collectives

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
WRITER_MARKERS = ("inline_container", "PytorchStreamWriter failed", "unexpected pos")
"""torch's zip writer's words for a write that came up short (it hides the OSError)."""
TEXT_MARKERS = ("No space left on device", "Disk quota exceeded", "[Errno 28]", "[Errno 122]")
"""A full disk as the text of an exception that wraps it (DCP's CheckpointException)."""
NEARLY_FULL_BYTES = 64 * 2**20
"""Below this much free space, a short write of torch's zip writer is taken for a full file system."""


class CheckpointDiskFull(CheckpointError):
    """A checkpoint did not fit on its file system; the folder was removed, earlier checkpoints are intact."""


def disk_full(error: BaseException, where: Path) -> bool:
    """Whether `error` (or an exception it wraps) is a write that failed for want of space under `where`."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return True
        text = str(e)
        if any(m in text for m in TEXT_MARKERS):
            return True
        if isinstance(e, RuntimeError) and any(m in text for m in WRITER_MARKERS):
            return free_bytes(where) < NEARLY_FULL_BYTES
        e = e.__cause__ or e.__context__
    return False


def caught(write: Callable[[], object], where: Path) -> BaseException | None:
    """Run `write`; the error when it failed for a full disk under `where` (None when it succeeded); any other
    error is raised."""
    try:
        write()
    except (OSError, RuntimeError) as e:
        if not disk_full(e, where):
            raise
        return e
    return None


def _usage(where: Path) -> tuple[int, int]:
    """(free, total) bytes of the file system of `where` (its nearest existing parent); (-1, 0) when unknown."""
    for p in (where, *where.parents):
        if p.exists():
            try:
                usage = shutil.disk_usage(p)
            except OSError:
                return -1, 0
            return usage.free, usage.total
    return -1, 0


def free_bytes(where: Path) -> int:
    """Free bytes on the file system of `where` (its nearest existing parent); -1 when unknown."""
    return _usage(where)[0]


def agree(error: BaseException | None, *, path: Path, root: Path, is_main: bool) -> None:
    """Collective (it also serves as a barrier): when any rank's write of checkpoint `path` failed for a full disk,
    rank 0 removes the folder and every rank raises CheckpointDiskFull with `explain`'s line."""
    device = torch.device("cuda", torch.cuda.current_device()) if (
        dist.is_initialized() and dist.get_backend() == "nccl") else torch.device("cpu")
    if collectives.world_size() > 1:
        failed = collectives.all_reduce_max([1.0 if error is not None else 0.0], device=device)[0] > 0
    else:
        failed = error is not None
    if not failed:
        return
    partial = folder_bytes(path) + max(free_bytes(root), 0)  # what was written, and the room it did not fill
    if is_main:
        shutil.rmtree(path, ignore_errors=True)  # never committed: no resume takes it; removing it frees the space
    raise CheckpointDiskFull(explain(path, root=root, error=error, partial=partial)) from None


def explain(path: Path, *, root: Path, error: BaseException | None, partial: int) -> str:
    """The one line: the folder and its file system's free space, what a checkpoint needs, what would help, and the
    last good checkpoint. `partial`: the bytes written before the failure plus the space left then."""
    last = _newest_committed(root)
    need = folder_bytes(last) or partial  # the last checkpoint's size, else more than the room there was
    free, total = _usage(root)
    need_text = (f"a checkpoint of this run takes {size(need)}" if last is not None
                 else f"the checkpoint needs more than {size(partial)}")
    short = need - max(free, 0)
    advice = f"Free at least {size(short)} there" if short > 0 else "Free space there"
    kept = (f"the last good checkpoint, {last} (step {mf.step_of(last)}), is intact: run the same command to resume "
            "from it" if last is not None else "no earlier checkpoint of this run exists")
    return (f"checkpoint {path} does not fit: {_reason(error)}; {size(free) if free >= 0 else 'unknown space'} free "
            f"of {size(total)} on the file system of {root}, and {need_text}. {advice}, or point checkpoint.dir at a "
            f"file system with room. The half-written folder was removed; {kept}")


def run_dir_full(error: BaseException, run_dir: Path, root: Path) -> str:
    """The one line for a run's record (metrics, config.yaml, summary, final weights) that did not fit."""
    name = next((getattr(e, "filename", None) for e in _chain(error) if getattr(e, "filename", None)), None)
    last = _newest_committed(root)
    kept = (f"the last good checkpoint, {last} (step {mf.step_of(last)}), is intact: run the same command to resume "
            "from it once there is room" if last is not None else "no checkpoint of this run was committed")
    free, total = _usage(run_dir)
    return (f"could not write {name or 'a record of the run'}: {_reason(error)}; "
            f"{size(free) if free >= 0 else 'unknown space'} free of {size(total)} on the file system of {run_dir}. "
            f"Free space there, or use another --out (log.out_dir) on a file system with room; {kept}")


def _chain(error: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _reason(error: BaseException | None) -> str:
    if error is None:
        return "No space left on device (a write of another rank)"
    e: BaseException | None = error
    while e is not None:
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return e.strerror or "no space left on device"
        e = e.__cause__ or e.__context__
    return "no space left on device"


def _newest_committed(root: Path) -> Path | None:
    found = [i.path for i in mf.list_checkpoints(root, check_hashes=False) if i.valid] if root.is_dir() else []
    return found[-1] if found else None


def folder_bytes(path: Path | None) -> int:
    if path is None or not path.is_dir():
        return 0
    total = 0
    for p in path.rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:
            continue
    return total


def size(n: int) -> str:
    """Bytes for people: B, KiB, MiB, GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
