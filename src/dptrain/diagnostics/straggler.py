"""Straggler detection: each rank's step time split into data, compute and waiting for others.

How the split is measured (host clocks, per rank, summed over a window of steps):

- data: from entering the data phase to the forward (next(loader) and the copy to the device);
- compute: forward, backward and the optimizer step. DDP and FSDP reduce gradients inside the
  last backward, so a fast rank's backward also contains some waiting for a slow one that
  cannot be separated without hooks in the backend; hence the probe:
- wait: a barrier just before the synchronising backward, over the data-parallel group (the ranks
  that backward reduces gradients with; every rank under pure data parallelism). Whatever a rank does before that
  point (data, forward, earlier micro-steps) shows up as the others' waiting time there. On
  CUDA the device is synchronised before the barrier so that queued kernels count as compute.

Only the last SAMPLE_STEPS steps of every `every_steps` window are timed and probed, so the
probe's cost is paid on at most that many steps per window. At the window's end each rank's median step (per
bucket, over the timed steps: one step the OS delayed, a page fault storm or a neighbour's burst on a shared host
moves a mean, not a median; a rank that is slow on most steps moves both) is gathered (`all_gather_object`); a rank
whose data + compute exceeds the median of the other ranks by more than `margin` (and by at
least 1 ms per step, so that jitter on tiny steps is not news) is named with its host, and the
split says whether its data loading or its compute is slow.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from dptrain.distributed.collectives import all_gather_object

MIN_EXCESS_S = 1e-3
SAMPLE_STEPS = 10
"""Steps timed (and probed) at the end of every `straggler_every_steps` window."""
BUCKETS = ("data", "compute", "wait", "other")
_BUCKET_OF = {"data": "data", "forward": "compute", "backward": "compute", "optimizer": "compute", "wait": "wait"}


class StepTimer:
    """Accumulates this rank's time per bucket between phase changes (a few clock reads per step)."""

    def __init__(self, *, device: torch.device, group: Any = None) -> None:
        self.device = device
        self.group = group  # the probe's barrier: the ranks this step's gradient reduction waits for
        self.host = socket.gethostname()
        self.reset()

    def reset(self) -> None:
        self.done: list[dict[str, float]] = []  # each timed step's seconds per bucket
        self.sums = dict.fromkeys(BUCKETS, 0.0)  # the running step's
        self._bucket, self._last = "other", time.perf_counter()

    @property
    def steps(self) -> int:
        return len(self.done)

    def mark(self, phase: str) -> None:
        """Close the running bucket and open the one of `phase` (unknown phases count as other)."""
        now = time.perf_counter()
        self.sums[self._bucket] += now - self._last
        self._bucket, self._last = _BUCKET_OF.get(phase, "other"), now

    def probe(self) -> None:
        """Time a barrier: how long this rank waits for the slowest one to arrive."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.mark("wait")
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.barrier(group=self.group)
        self.mark("backward")

    def resume(self) -> None:
        """Start timing again after untimed steps (their time is not counted)."""
        self._bucket, self._last = "other", time.perf_counter()

    def step_done(self) -> None:
        self.mark("other")
        self.done.append(self.sums)
        self.sums = dict.fromkeys(BUCKETS, 0.0)

    def row(self, rank: int) -> dict[str, Any]:
        """This rank's median step over the window: seconds per bucket, each the median over the timed steps
        (0 with no step timed)."""
        medians = {k: statistics.median(s[k] for s in self.done) if self.done else 0.0 for k in BUCKETS}
        return {"rank": rank, "host": self.host, "steps": self.steps, **medians}


def find_stragglers(rows: list[dict[str, Any]], *, margin: float) -> list[dict[str, Any]]:
    """Ranks slower than the median of the others by more than `margin`, with the slow part."""
    found = []
    for row in rows:
        others = [r for r in rows if r["rank"] != row["rank"]]
        if not others:
            continue
        busy = row["data"] + row["compute"]
        ref = statistics.median(r["data"] + r["compute"] for r in others)
        if busy <= ref * (1 + margin) or busy - ref < MIN_EXCESS_S:
            continue
        ref_data = statistics.median(r["data"] for r in others)
        ref_compute = statistics.median(r["compute"] for r in others)
        cause = "data" if row["data"] - ref_data >= row["compute"] - ref_compute else "compute"
        found.append({
            "rank": row["rank"], "host": row["host"], "busy_s": busy, "others_busy_s": ref, "cause": cause,
            "data_s": row["data"], "others_data_s": ref_data, "compute_s": row["compute"],
            "others_compute_s": ref_compute, "others_wait_s": statistics.median(r["wait"] for r in others),
        })
    return found


def describe(s: dict[str, Any], *, first: int, last: int) -> str:
    """One console line for a straggler found by `find_stragglers`."""
    ms = 1e3
    slow = "data loading" if s["cause"] == "data" else "compute"
    return (
        f"straggler (steps {first}-{last}): rank {s['rank']} on {s['host']} takes {s['busy_s'] * ms:.1f} ms/step "
        f"of data + compute vs {s['others_busy_s'] * ms:.1f} ms median of the others "
        f"(+{(s['busy_s'] / max(s['others_busy_s'], 1e-9) - 1) * 100:.0f}%); its {slow} is slow "
        f"(data {s['data_s'] * ms:.1f} vs {s['others_data_s'] * ms:.1f} ms, compute {s['compute_s'] * ms:.1f} vs "
        f"{s['others_compute_s'] * ms:.1f} ms); the others wait {s['others_wait_s'] * ms:.1f} ms/step for it"
    )


def gather_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's row, on every rank."""
    return all_gather_object(row)
