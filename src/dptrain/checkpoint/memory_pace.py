"""What the default in-memory snapshots (`checkpoint.memory_every_steps: null`) may cost: room and time.

Room: before the first snapshot every rank reports the bytes of its share; a node holds its own ranks'
shares plus, on more than one node, the previous node's as the replica, twice (the newest complete
snapshot and the one being written). The default turns itself off when that exceeds half of the
tmpfs's free space (`room_problem`).

Time: the default snapshots every step "if the overhead allows". `Pace` measures it during a probe:
snapshots on every other step (the first one, which also sets things up, not counted), so that each
snapshot is followed by a step it may slow down (its background write competes for the cores and the
GIL) and then by a clean step. A snapshot's cost is the time it holds the loop (staging, and waiting
for the previous one's background write) plus how much longer the step after it takes than the clean
one after that (medians over `PROBE` snapshots and pairs of steps); the ranks agree on the mean share
of a clean step, and when it is over `BUDGET` the interval becomes the smallest number of steps that
brings it under (`interval_for`). Torch-free.
"""

from __future__ import annotations

import math
import statistics
import time

BUDGET = 0.03
"""The share of step time the default snapshots may take."""
PROBE = 8
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
    """Times the probe (see the module docstring): `tick()` at every step boundary while `probing`, `begin()` /
    `end()` around each snapshot's blocking part; `share()` is the cost over a clean step's time, once PROBE
    snapshots are measured (None before, and after: the probe is over)."""

    def __init__(self) -> None:
        self.spent: list[float] = []  # each measured snapshot's blocking time
        self.steps: list[tuple[bool, float]] = []  # (follows a snapshot, duration) of each probed step, in order
        self.count = -1  # the first snapshot is not measured
        self.done = False
        self._start = 0.0
        self._tick: float | None = None
        self._snapped = False  # a snapshot ended since the last tick

    @property
    def probing(self) -> bool:
        return not self.done

    def tick(self) -> None:
        now = time.perf_counter()
        if self._tick is not None and 0 < self.count <= PROBE:
            self.steps.append((self._snapped, now - self._tick))
        self._tick, self._snapped = now, False

    def begin(self) -> None:
        self._start = time.perf_counter()

    def end(self) -> None:
        now = time.perf_counter()
        if 0 <= self.count < PROBE:
            self.spent.append(now - self._start)
        self.count += 1
        self._tick, self._snapped = now, True  # the next step is timed from here

    def share(self) -> float | None:
        """This rank's snapshot cost over its clean step time, once (when PROBE snapshots are measured). The drag
        is the median over pairs of a step after a snapshot minus the clean step that follows it: pairs cancel the
        machine's slow drift, the median a step slowed by something else (a disk checkpoint, an evaluation)."""
        if self.done or self.count < PROBE:
            return None
        self.done = True
        pairs = [a - c for (sa, a), (sc, c) in zip(self.steps, self.steps[1:], strict=False) if sa and not sc]
        clean = [d for snapped, d in self.steps if not snapped]
        if not clean:
            return 0.0
        drag = max(0.0, statistics.median(pairs)) if pairs else 0.0
        base = statistics.median(clean)
        return (statistics.median(self.spent) + drag) / base if base > 0 else 0.0
