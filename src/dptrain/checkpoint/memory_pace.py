"""What the default in-memory snapshots (`checkpoint.memory_every_steps: null`) may cost: room and time.

Room: before the first snapshot every rank reports the bytes of its share; a node holds its own ranks'
shares plus, on more than one node, the previous node's as the replica, twice (the newest complete
snapshot and the one being written). The default turns itself off when that exceeds half of the
tmpfs's free space (`room_problem`).

Time: the default snapshots every step "if the overhead allows". `Pace` measures, over the first
`PROBE` snapshots after the first, the time a snapshot holds the training loop (staging the state,
and waiting for the previous one's background write) against the time of the steps between them;
the ranks agree on the mean, and when it is over `BUDGET` the interval becomes the smallest number
of steps that brings it under (`interval_for`). Torch-free.
"""

from __future__ import annotations

import math
import time

BUDGET = 0.03
"""The share of step time the default snapshots may take."""
PROBE = 5
"""Snapshots measured (after the first, which also sets things up) before the interval is chosen."""


def node_bytes(rank_bytes: list[float], *, local_world: int) -> list[float]:
    """Bytes of each node's own share (torchrun numbers a node's ranks contiguously)."""
    n = max(1, local_world)
    return [sum(rank_bytes[i : i + n]) for i in range(0, len(rank_bytes), n)]


def room_needed(rank_bytes: list[float], *, local_world: int) -> float:
    """The most tmpfs bytes any node's snapshot folder needs: 2 x (its own share + the previous node's replica)."""
    nodes = node_bytes(rank_bytes, local_world=local_world)
    if len(nodes) == 1:
        return 2 * nodes[0]
    return max(2 * (own + nodes[i - 1]) for i, own in enumerate(nodes))


def room_problem(rank_bytes: list[float], *, local_world: int, free: int, where: str) -> str | None:
    """Why two snapshots would not fit the tmpfs at `where` with `free` bytes free (None: they fit in half of it)."""
    need = room_needed(rank_bytes, local_world=local_world)
    if need > free * 0.5:  # leave half of the tmpfs to everything else that uses it
        return f"{where} has {free / 2**20:,.0f} MiB free, two snapshots need about {need / 2**20:,.0f} MiB"
    return None


def interval_for(share: float, *, budget: float = BUDGET) -> int:
    """Snapshot every N steps so that a snapshot costing `share` of one step's time stays within `budget`."""
    if share <= budget:
        return 1
    return math.ceil(share / budget - 1e-9)


class Pace:
    """Times the snapshots (see the module docstring): `begin()`/`end()` around each one's blocking part;
    `share()` is the measured cost over step time once PROBE snapshots are measured (None before, and after)."""

    def __init__(self) -> None:
        self.spent = 0.0
        self.between = 0.0
        self.count = -1  # the first snapshot is not measured
        self._start = 0.0
        self._last_end: float | None = None
        self.done = False

    def _measuring(self) -> bool:
        return 0 <= self.count < PROBE

    def begin(self) -> None:
        self._start = time.perf_counter()
        if self._last_end is not None and self._measuring():
            self.between += self._start - self._last_end  # the step(s) since the previous snapshot

    def end(self) -> None:
        now = time.perf_counter()
        if self._measuring():
            self.spent += now - self._start
        self.count += 1
        self._last_end = now

    def share(self) -> float | None:
        """This rank's snapshot time over its step time, once (when PROBE snapshots are measured)."""
        if self.done or self.count < PROBE:
            return None
        self.done = True
        return self.spent / self.between if self.between > 0 else 0.0
