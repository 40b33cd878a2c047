"""What the default in-memory snapshots (`checkpoint.snapshot_every_steps: null`) may cost: room and time.

Room: before the first snapshot every rank reports the bytes of its share; a node holds its own ranks'
shares plus, on more than one node, the previous node's as the replica, twice (the newest complete
snapshot and the one being written). The default turns itself off when that exceeds half of the
tmpfs's free space (`room_problem`).

Time: the default snapshots every step "if the overhead allows". `Pace` measures it during a probe of `PROBE`
snapshots at every step (the first one, which also sets things up, not counted): a snapshot's cost is the time
it holds the loop (staging, and waiting for the previous one's background write) plus the CPU time of its
background write (on a machine whose cores are all busy training, that much step time; where a core is idle it
is an upper bound) and the wall time of its transfer to and from another node, from when the peer's write is
done (gloo's own threads copy those bytes: an upper bound too), over the step's own time (medians). The ranks
agree on the largest share (the slowest rank sets the pace of all), and when it is over `BUDGET` the interval
becomes the smallest number of steps that brings it under (`interval_for`). Torch-free.
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


def cpu_clock() -> float:
    """The calling thread's CPU time (s): what the background write of a snapshot costs the machine."""
    return time.thread_time()


class Pace:
    """Times the probe (see the module docstring): `tick()` at every step boundary while `probing`, `begin()` /
    `end()` around each snapshot's blocking part, `background(seconds)` with each snapshot's background CPU time;
    `share()` is the cost over a step's own time, once PROBE snapshots are measured (None before, and after: the
    probe is over)."""

    def __init__(self) -> None:
        self.spent: list[float] = []  # each measured snapshot's blocking time
        self.behind: list[float] = []  # each measured snapshot's background CPU time
        self.steps: list[float] = []  # boundary to boundary, each probed step (its snapshot's blocking included)
        self.count = -1  # the first snapshot is not measured
        self.done = False
        self._start = 0.0
        self._tick: float | None = None
        self._background = -1  # the first snapshot's background write is not measured either

    @property
    def probing(self) -> bool:
        return not self.done

    def tick(self) -> None:
        now = time.perf_counter()
        if self._tick is not None and 0 < self.count <= PROBE:
            self.steps.append(now - self._tick)
        self._tick = now

    def begin(self) -> None:
        self._start = time.perf_counter()

    def end(self) -> None:
        if 0 <= self.count < PROBE:
            self.spent.append(time.perf_counter() - self._start)
        self.count += 1

    def background(self, seconds: float) -> None:
        """The background CPU time of the snapshots, in order, as each is collected."""
        if 0 <= self._background < PROBE:
            self.behind.append(seconds)
        self._background += 1

    def share(self) -> float | None:
        """This rank's snapshot cost over its step time, once (when PROBE snapshots are measured)."""
        if self.done or self.count < PROBE or not self.steps:
            return None
        self.done = True
        spent = statistics.median(self.spent)
        behind = statistics.median(self.behind) if self.behind else 0.0
        base = statistics.median(self.steps) - spent
        return (spent + behind) / base if base > 0 else 0.0
