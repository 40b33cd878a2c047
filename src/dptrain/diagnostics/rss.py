"""Memory: per-rank host RSS and CUDA allocated/reserved/peak, leaks as a fitted slope, and
stray CUDA contexts on GPU 0.

A leak is a steady rise: over the last `window` samples, a least-squares line through
(step, RSS) must rise by more than `leak_mb` and explain the samples well (R^2 >= 0.9), so a
one-off jump (a cache warming up) or noise is not reported. CUDA's allocated memory is fitted
the same way when a GPU is used.

A process of this job other than the one bound to GPU 0 holding a context there (a
`torch.cuda` call before `set_device`, a tensor created on the default device) costs every
such rank hundreds of MiB on GPU 0; `stray_gpu0_contexts` finds them with nvidia-smi, and
does nothing on a machine without it.
"""

from __future__ import annotations

import collections
import shutil
import subprocess
from typing import Any

import psutil
import torch

MIB = 2**20
MIN_R2 = 0.9


def sample(device: torch.device) -> dict[str, float]:
    """This process's memory now, in MiB."""
    out = {"rss_mb": psutil.Process().memory_info().rss / MIB}
    if device.type == "cuda":
        out.update(cuda_allocated_mb=torch.cuda.memory_allocated(device) / MIB,
                   cuda_reserved_mb=torch.cuda.memory_reserved(device) / MIB,
                   cuda_peak_mb=torch.cuda.max_memory_allocated(device) / MIB)
    return out


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, R^2) of the least-squares line through the points."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0:
        return 0.0, 0.0
    slope = sxy / sxx
    r2 = (sxy * sxy) / (sxx * syy) if syy > 0 else 0.0
    return slope, r2


class MemoryMonitor:
    """Samples of one rank, and the leak test over the last `window` of them."""

    def __init__(self, *, device: torch.device, window: int, leak_mb: float) -> None:
        self.device, self.window, self.leak_mb = device, window, leak_mb
        self.samples: collections.deque[tuple[int, dict[str, float]]] = collections.deque(maxlen=window)
        self._quiet_until = 0  # after a report, wait for a fresh window before repeating it

    def sample(self, step: int) -> dict[str, float]:
        s = sample(self.device)
        self.samples.append((step, s))
        return s

    def leaks(self) -> list[dict[str, Any]]:
        """Each memory kind (host RSS, CUDA allocated) that grows steadily over the window."""
        if len(self.samples) < self.window or self.samples[-1][0] < self._quiet_until:
            return []
        found = []
        steps = [float(st) for st, _ in self.samples]
        for key in ("rss_mb", "cuda_allocated_mb"):
            if key not in self.samples[-1][1]:
                continue
            slope, r2 = fit_line(steps, [s[key] for _, s in self.samples])
            growth = slope * (steps[-1] - steps[0])
            if growth > self.leak_mb and r2 >= MIN_R2:
                found.append({"memory": key.removesuffix("_mb"), "mb_per_step": slope, "r2": r2, "growth_mb": growth,
                              "steps": [int(steps[0]), int(steps[-1])]})
        if found:
            last, first = self.samples[-1][0], self.samples[0][0]
            self._quiet_until = last + (last - first)
        return found


def describe_leak(rank: int, host: str, leak: dict[str, Any]) -> str:
    what = "host RSS" if leak["memory"] == "rss" else "CUDA allocated memory"
    a, b = leak["steps"]
    return (f"memory: rank {rank} on {host}: {what} grows {leak['mb_per_step']:.2f} MiB/step over steps {a}-{b} "
            f"(+{leak['growth_mb']:.0f} MiB, linear fit R^2 {leak['r2']:.2f}): a leak? Look for tensors kept "
            "across steps (a list of losses without .item()/.detach(), a growing cache)")


def gpu0_pids() -> list[int]:
    """Pids of every process with a CUDA context on GPU 0 (nvidia-smi); empty without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        bus = subprocess.run([smi, "--query-gpu=index,pci.bus_id", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        apps = subprocess.run([smi, "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpu0 = next((line.split(",")[1].strip() for line in bus.splitlines() if line.split(",")[0].strip() == "0"), None)
    return sorted(int(p) for p, b in (line.split(",")[:2] for line in apps.splitlines() if "," in line)
                  if b.strip() == gpu0 and p.strip().isdigit())


def stray_gpu0_contexts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks with a context on their node's GPU 0 that are not that node's local rank 0.
    `rows`: every rank's `rank`, `host`, `pid`, `local_rank` and, on local rank 0, `gpu0_pids`."""
    on_gpu0 = {r["host"]: set(r.get("gpu0_pids") or []) for r in rows if r["local_rank"] == 0}
    return [{"rank": r["rank"], "host": r["host"], "pid": r["pid"]} for r in rows
            if r["local_rank"] != 0 and r["pid"] in on_gpu0.get(r["host"], set())]
