"""The fast desync verdict: ranks compare their collective rings through the job's store, in seconds.

Run by each rank's watchdog thread (diagnostics/watchdog.py) every tick, with non-blocking store calls
only (add, set, check, get after check). When this rank's oldest unfinished collective has waited
`wait_s` seconds while its main thread is inside torch.distributed or autograd, it asks every rank for
its snapshot (diagnostics/collective_ring.py: ring + main-thread position) by bumping a request counter;
every rank's thread answers at its next tick; the asking rank compares them (diagnostics/desync.py):
a certain desync is handed back to the watchdog, which ends the job with a report; an uncertain one
(a rank outside the collective the others wait in) is printed once as a warning naming that rank and
its line. While it stays stuck the rank asks again every `wait_s` (a late rank may have moved on).

`request_check(step)` (the check mode, `diagnostics.collective_check_every_steps`): the training thread
asks for a comparison without any wait; every rank publishes its snapshot, rank 0 compares the rings
for mismatches (a collective called with another op, shape or dtype that completed anyway: gloo's
broadcast does so silently).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from dptrain.diagnostics.collective_ring import main_thread_frame, main_thread_position, p2p_wait, read_calls, snapshot
from dptrain.diagnostics.desync import Desync, describe_call, find_desync

_REQUEST, _RING, _CHECK = "ring_req", "ring/", "ring_check/"


class DesyncWatch:
    """One rank's part of the ring comparison; `tick()` from the watchdog thread returns a certain Desync."""

    def __init__(self, *, store: Any, rank: int, world_size: int, wait_s: float,
                 heartbeat: Callable[[], dict[str, Any]], later: str,
                 say: Callable[[str], None] | None = None) -> None:
        self.store, self.rank, self.world_size, self.wait_s = store, rank, world_size, wait_s
        self._heartbeat = heartbeat
        self._later = later  # what happens to a merely uncertain finding ("the job ends at hang_timeout_s=...")
        self._say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self._answered = 0
        self._asked: tuple[int, float, str] | None = None  # (request number, when, what this rank waits in)
        self._next_ask = 0.0
        self._warned: set[str] = set()
        self._check_step, self._checked_step, self._check_published = 0, 0, 0
        self._p2p_key: str | None = None  # the send/recv the main thread waits in, and since when
        self._p2p_since = 0.0
        self.last: Desync | None = None  # the last finding, certain or not
        self.waited = ""  # what this rank waited in when it last compared ("barrier #9, waiting 5.2s")

    # ------------------------------------------------------------------ training thread
    def request_check(self, step: int) -> None:
        """Compare the rings at this step boundary (check mode); the watchdog thread does the work."""
        self._check_step = step

    # ------------------------------------------------------------------ watchdog thread
    def tick(self) -> Desync | None:
        wanted = self.store.add(_REQUEST, 0)
        if wanted > self._answered:
            self._publish(_RING, wanted)
            self._answered = wanted
        now = time.monotonic()
        if self.wait_s > 0 and self._asked is None and now >= self._next_ask and main_thread_position()[1]:
            # at most one ring read (~1 ms with the GIL held, 128 entries) per wait_s / 5: ~0.1% of the main thread
            self._next_ask = now + self.wait_s / 5
            pending = [c for c in read_calls() if not c.done and not c.p2p]
            oldest = max(pending, key=lambda c: c.age_s, default=None)
            p2p = self._p2p_waited(now)
            if oldest is not None and oldest.age_s >= self.wait_s:
                self._ask(now, f"{describe_call(oldest)} for {oldest.age_s:.1f}s")
            elif p2p is not None:
                self._ask(now, p2p)
        found = self._verdict(now) if self._asked is not None else None
        if self._check_step > self._checked_step:
            found = found or self._check()
        return found

    def _ask(self, now: float, waits_in: str) -> None:
        number = self.store.add(_REQUEST, 1)
        self._publish(_RING, number)
        self._answered = max(self._answered, number)
        self._asked = (number, now, waits_in)

    def _p2p_waited(self, now: float) -> str | None:
        """"recv from rank 0 for 5.2s" once the main thread has waited `wait_s` in one send or recv (which the flight
        recorder does not record under gloo), else None."""
        wait = p2p_wait(main_thread_frame())
        key = None if wait is None else json.dumps(wait, sort_keys=True)
        if key != self._p2p_key:
            self._p2p_key, self._p2p_since = key, now
        if wait is None or now - self._p2p_since < self.wait_s:
            return None
        where = "from" if wait["op"] == "recv" else "to"
        return f"{wait['op']} {where} rank {wait['peer']} for {now - self._p2p_since:.1f}s"

    def ask_all(self, *, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Every rank's snapshot now, this one's included: for a rank about to die (gloo aborting it), which cannot
        wait for its own thread's next tick. The others answer at their next tick; waits at most `timeout_s`."""
        number = self.store.add(_REQUEST, 1)
        self._publish(_RING, number)
        deadline = time.monotonic() + timeout_s
        while True:
            snaps = self._gather(_RING, number)
            if len(snaps) >= self.world_size or time.monotonic() >= deadline:
                return snaps
            time.sleep(0.05)

    def _publish(self, prefix: str, number: int) -> None:
        snap = snapshot(rank=self.rank, heartbeat=self._heartbeat())
        self.store.set(f"{prefix}{self.rank}", json.dumps({**snap, "number": number}))

    def _gather(self, prefix: str, number: int) -> dict[int, dict[str, Any]]:
        """The snapshots answering request `number` (or a later one) that are in the store now."""
        out = {}
        for r in range(self.world_size):
            key = f"{prefix}{r}"
            if self.store.check([key]):
                snap = json.loads(self.store.get(key))
                if snap.get("number", 0) >= number:
                    out[r] = snap
        return out

    def _verdict(self, now: float) -> Desync | None:
        assert self._asked is not None
        number, since, waits_in = self._asked
        snaps = self._gather(_RING, number)
        if len(snaps) < self.world_size and now - since < 3.0:
            return None  # the others answer at their next tick; a dead or frozen rank never does
        self._asked, self._next_ask, self.waited = None, now + self.wait_s, waits_in
        found = find_desync(snaps, wait_s=self.wait_s)
        missing = sorted(set(range(self.world_size)) - set(snaps))
        if found is None and missing:
            self._warn(f"missing:{missing}", f"dptrain watchdog: rank {self.rank} waits in {waits_in}; rank(s) "
                       f"{', '.join(map(str, missing))} did not send their collectives within 3s (dead, or frozen "
                       f"holding the GIL); {self._later}")
        if found is None:
            return None
        self.last = found
        if found.certain:
            return found
        self._warn(f"{found.key}:{found.ranks}", "dptrain watchdog: WARNING: " + found.summary + ". Legal if that "
                   f"rank is only late (e.g. evaluating or saving alone) and then calls it; {self._later}")
        return None

    def _check(self) -> Desync | None:
        """Check mode: publish this rank's ring; rank 0 compares once every rank published this step's."""
        step = self._check_step
        if self._check_published < step:
            self._publish(_CHECK, step)
            self._check_published = step
        if self.rank != 0:
            self._checked_step = step
            return None
        # Every rank's newest ring since the last comparison: the ranks' threads tick at their own times, so another
        # rank's ring is often from a step or two before this one's (the rings overlap: a mismatch at any sequence
        # number both still hold is found); asking for this very step could wait for ever on a loaded machine.
        snaps = self._gather(_CHECK, self._checked_step + 1)
        if len(snaps) < self.world_size:
            return None  # the others publish at their next tick
        self._checked_step = step
        found = find_desync(snaps, wait_s=float("inf"))  # mismatches only: nothing has to wait here
        if found is not None:
            found.found_by = f"the collective check at step {step} (diagnostics.collective_check_every_steps)"
            self.last = found
        return found

    def _warn(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self._say(text)
