"""Was a rank that died of SIGKILL killed by the kernel's OOM killer? The evidence, for the launcher's last line.

A rank the OOM killer ends dies of SIGKILL like one a user killed: torchrun's report says `exitcode -9`. The kernel
counts every OOM kill in the memory cgroup where it happened (`oom_kill` in cgroup v2's `memory.events`, in cgroup
v1's `memory.oom_control`), and its log says which process (`Killed process PID`), when the log is readable (dmesg
often is not, in a container). `oom_counts()` reads the counters of the launcher's own memory cgroup and every cgroup
below it (the workers' unless a container runtime moved them); `oom_kill_line` compares them with the counts at
launch and names the rank. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")
MAX_DEPTH = 4


def _own_memory_cgroups(proc_cgroup: Path = Path("/proc/self/cgroup")) -> list[Path]:
    """The folders of this process's memory cgroup: v1's memory hierarchy, v2's unified one (either may be absent)."""
    out = []
    with contextlib.suppress(OSError):
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            rel = path.strip().lstrip("/")
            if "memory" in controllers.split(","):
                out.append(CGROUP_ROOT / "memory" / rel)
            elif controllers == "":  # v2: the unified hierarchy (at the root, or under unified/ on a hybrid host)
                out += [CGROUP_ROOT / rel, CGROUP_ROOT / "unified" / rel]
    return [p for p in out if (p / "memory.events").is_file() or (p / "memory.oom_control").is_file()]


def _oom_kills(folder: Path) -> int | None:
    for name in ("memory.events", "memory.oom_control"):
        with contextlib.suppress(OSError, ValueError):
            text = (folder / name).read_text()
            found = re.search(r"^oom_kill (\d+)$", text, re.M)
            if found:
                return int(found.group(1))
    return None


def oom_counts() -> dict[str, int]:
    """{memory cgroup folder: OOM kills counted} for this process's memory cgroup and those below it."""
    out: dict[str, int] = {}
    for top in _own_memory_cgroups():
        base = len(top.parts)
        for folder, subdirs, _ in os.walk(top):
            if len(Path(folder).parts) - base >= MAX_DEPTH:
                subdirs[:] = []
            count = _oom_kills(Path(folder))
            if count is not None:
                out[folder] = count
    return out


def uptime_s() -> float:
    """Seconds since boot: the kernel log's clock."""
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def _kernel_log_pids(since_s: float = 0.0) -> set[int]:
    """The pids the kernel log says the OOM killer killed since `since_s` (seconds since boot: an older kill of a pid
    that was reused is no evidence); empty when the log cannot be read."""
    try:
        text = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=3).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {int(pid) for t, pid in re.findall(r"^\[\s*([\d.]+)\][^\n]*Killed process (\d+)", text, re.M)
            if float(t) >= since_s}


def oom_kill_line(failures: dict[int, Any], before: dict[str, int], *, since_s: float = 0.0) -> str | None:
    """One line naming the rank the OOM killer ended, with the evidence, or None: no rank died of SIGKILL, or no OOM
    kill was counted since `before` (oom_counts() at launch) and the kernel log names none of them since `since_s`
    (uptime_s() at launch)."""
    killed = {rank: f for rank, f in failures.items() if f.exitcode == -signal.SIGKILL}
    if not killed:
        return None
    grown = {path: n - before.get(path, 0) for path, n in oom_counts().items() if n > before.get(path, 0)}
    logged = _kernel_log_pids(since_s)
    named = [r for r, f in killed.items() if f.pid in logged]
    if not named and not (grown and len(killed) == 1):
        return None
    ranks = named or list(killed)
    who = ", ".join(f"rank {r} (pid {killed[r].pid})" for r in sorted(ranks))
    evidence = [f"memory cgroup {path} counted {n} OOM kill{'s' if n > 1 else ''} during the run"
                for path, n in sorted(grown.items())]
    if named:
        evidence.append("the kernel log says it killed pid " + ", ".join(str(killed[r].pid) for r in sorted(named)))
    return (f"{who} {'was' if len(ranks) == 1 else 'were'} killed by the kernel's OOM killer (SIGKILL): "
            f"{'; '.join(evidence)}. Give the job more memory, or use less per rank (a smaller micro-batch, "
            "fewer DataLoader workers)")
