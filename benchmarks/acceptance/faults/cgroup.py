"""A rank the kernel's OOM killer ends: the culprit moves itself into a memory cgroup of its own, capped just above its
size, and keeps allocating until the kernel kills it (SIGKILL), as in a container at its memory limit. Needs a
writable memory cgroup (root, cgroup v1's memory hierarchy or v2 with the memory controller): `unavailable()` says
why not. `remove_leftovers()` removes the cgroups the runs made (empty once their process is dead)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PREFIX = "dptrain-fault-oom-"


def own_memory_cgroup() -> tuple[Path, str] | None:
    """(this process's memory cgroup folder, the name of its limit file), or None."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            rel = path.strip().lstrip("/")
            if "memory" in controllers.split(",") and (ROOT / "memory" / rel / "memory.limit_in_bytes").exists():
                return ROOT / "memory" / rel, "memory.limit_in_bytes"
            if controllers == "" and (ROOT / rel / "memory.max").exists():
                return ROOT / rel, "memory.max"
    return None


def unavailable() -> str | None:
    """Why this machine cannot run the fault (None: it can)."""
    found = own_memory_cgroup()
    if found is None:
        return "no memory cgroup of this process with a memory limit file (cgroup v1 memory or v2 memory.max)"
    probe = found[0] / f"{PREFIX}probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cannot create a memory cgroup under {found[0]}: {e.strerror}"
    return None


def confine(headroom: int) -> Path:
    """Move this process into a new memory cgroup capped at its resident size plus `headroom` bytes."""
    found = own_memory_cgroup()
    assert found is not None, unavailable()
    folder, limit = found
    child = folder / f"{PREFIX}{os.getpid()}"
    child.mkdir()
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    (child / limit).write_text(str(rss + headroom))
    (child / "cgroup.procs").write_text(str(os.getpid()))
    return child


def remove_leftovers() -> None:
    found = own_memory_cgroup()
    if found is not None:
        for child in found[0].glob(f"{PREFIX}*"):
            with contextlib.suppress(OSError):
                child.rmdir()
