"""Hang watchdog: heartbeats through the job's store, stacks of every rank, one report, exit.

Every rank runs a daemon thread. The training thread only records where it is, in a `Pulse` (step,
phase, last collective, a count of phases within the step): plain attribute writes, which the trainer
makes inline on a steady step (no call into this module) and `beat` makes for other callers. The thread
reads the pulse every `interval_s`, publishes the position to the job's store (torch.distributed's
default store: torchrun's TCPStore) when it changed, and times local progress from the last change it
saw (so a hang is declared between `timeout_s` and `timeout_s + interval_s` after the last beat).
When a rank has made no progress for `timeout_s`, it raises a flag in
the store; the first rank to do so is the reporter. On seeing the flag every rank writes the
Python stacks of all its threads to `RUN_DIR/stacks/rank<N>.txt` and into the store; the
reporter collects them, names the suspect rank(s) (`find_suspects`), writes
`RUN_DIR/hang_report.txt` and prints it; then every rank leaves with `os._exit(EXIT_HANG)`.
`os._exit` from the watchdog thread ends a process even while its main thread is blocked
inside a collective, so the launcher sees the failure at once and no process is left behind.

A rank whose main thread holds the GIL forever (stuck inside C code that does not release
it) cannot run its watchdog thread either: it sends no stack, and is named for that reason.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dptrain.diagnostics.collective_ring import format_stacks, snapshot
from dptrain.diagnostics.desync import Desync, find_desync
from dptrain.diagnostics.desync_watch import DesyncWatch
from dptrain.distributed.exit_marks import mark_exit

EXIT_HANG = 3
"""Exit code of every rank after a hang report."""

STORE_PREFIX = "dptrain/diag/"
_FLAG, _DONE, _REASON = "hang", "hang_reported", "hang_reason"
_ACTIVE: list[Watchdog] = []  # the watchdogs running in this process (a yielding one steps aside for the others)
def active_desync() -> DesyncWatch | None:
    """The ring comparison of a watchdog running in this process (None when none runs, or at world size 1)."""
    return next((w.desync for w in list(_ACTIVE) if w.desync is not None), None)


class Pulse:
    """Where the training thread is: the step being trained (1-based), the phase it entered last, the
    last collective named, and `seq`, the phases entered within the step. Written by the training thread
    (attribute stores only: a steady step calls no function to beat), read by the watchdog thread;
    (step, seq) only grows while the thread makes progress."""

    __slots__ = ("collective", "phase", "seq", "step")

    def __init__(self) -> None:
        self.step, self.seq, self.phase, self.collective = 0, 0, "setup", ""

    def position(self) -> tuple[int, int]:
        return self.step, self.seq


def job_store() -> Any:
    """The job's store (torch.distributed's default store: torchrun's TCPStore) under the watchdog's prefix."""
    return dist.PrefixStore(STORE_PREFIX, dist.distributed_c10d._get_default_store())


def find_suspects(beats: dict[int, dict[str, Any] | None]) -> tuple[list[int], str]:
    """Ranks that are not where the others are, and why.

    `beats[rank]` is the rank's last heartbeat (`step`, `seq`: phase changes within the step;
    `answered`: False when it sent no stack after the alarm), or None when it sent nothing. A rank
    that did not answer is named; otherwise a strict majority at one position names the others,
    and without one (e.g. two ranks) the ranks furthest behind are named: the rest wait for them.
    """
    silent = sorted(r for r, b in beats.items() if b is None or not b.get("answered", True))
    pos = {r: (b["step"], b["seq"]) for r, b in beats.items() if b is not None}
    if silent:
        return silent, ("did not answer the alarm: the process is dead, or frozen in code that holds the GIL "
                        "(its last heartbeat is in the table)")
    counts = collections.Counter(pos.values())
    if len(counts) == 1:
        if len(pos) == 1:
            return sorted(pos), "made no progress (a world of one: this rank is the only candidate)"
        outside = sorted(r for r, b in beats.items() if b is not None and not b.get("in_collective", True))
        if 0 < len(outside) < len(pos):
            return outside, ("at the same step and phase as the others but not inside torch.distributed or "
                             "autograd, where the others wait for it")
        places = {b.get("where") for b in beats.values() if b is not None}
        if len(places) > 1 and all(b is not None and b.get("in_collective") for b in beats.values()):
            return [], ("every rank waits inside torch.distributed or autograd, but at different lines: different "
                        "collectives on different ranks (a collective one rank skipped or called in another order; "
                        "the table shows each rank's line)")
        return [], ("all ranks are at the same point: the hang is inside that operation or the backend "
                    "(compare the stacks; a collective called with different arguments?)")
    (common, n), = counts.most_common(1)
    if n * 2 > len(pos) and list(counts.values()).count(n) == 1:
        return sorted(r for r, p in pos.items() if p != common), "not where the majority of ranks is"
    behind = min(pos.values())
    return sorted(r for r, p in pos.items() if p == behind), "behind the others, which wait for it in a collective"


class Watchdog:
    """A daemon thread per rank that detects a hang and ends the job with a report.

    `store` is a torch.distributed Store shared by all ranks (only non-blocking calls are used:
    set, add, check, get after check). `on_exit` replaces `os._exit` in tests. `on_death(error)` is
    called from the watchdog thread if its loop fails (the store went away, a bug): from then on this
    rank has no hang detection, and the caller should say so loudly (the hub does).
    `desync_after_s`: a rank waiting this long in a collective compares the ranks' collective rings
    (diagnostics/desync_watch.py); a certain desync ends the job at once, with the report (0: off).
    `timeout_s=inf`: no progress timeout, only the desync verdict (the `dptrain launch` shim). `run_dir=None`:
    the report is printed, no file written. `yielding`: idle while another watchdog runs in this process.
    `pulse`: the training thread's position, shared with its writer (the diagnostics hub's; default: its own,
    written by `beat`).
    """

    def __init__(
        self,
        *,
        timeout_s: float,
        store: Any,
        rank: int,
        world_size: int,
        run_dir: Path | None,
        interval_s: float | None = None,
        on_exit: Callable[[int], None] = os._exit,
        on_death: Callable[[BaseException], None] | None = None,
        desync_after_s: float = 0.0,
        yielding: bool = False,
        pulse: Pulse | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.store, self.rank, self.world_size = store, rank, world_size
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.interval_s = interval_s or min(1.0, max(0.05, timeout_s / 10), desync_after_s / 10 or 1.0)
        self.desync_after_s, self.yielding = desync_after_s, yielding
        later = (f"if it never does, the watchdog ends the job after diagnostics.hang_timeout_s={timeout_s:g}s"
                 if math.isfinite(timeout_s) else "dptrain does not end the job for this")
        self.desync = (DesyncWatch(store=store, rank=rank, world_size=world_size, wait_s=desync_after_s,
                                   heartbeat=self.heartbeat, later=later)
                       if world_size > 1 else None)  # wait_s=0: only the hang report and the check mode compare
        self._on_exit = on_exit
        self._on_death = on_death or self._print_death
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pulse = pulse if pulse is not None else Pulse()
        self._seen: tuple[int, int] | None = None  # the pulse's position at the last look, and when it changed:
        self._published: tuple[int, int] | None = None
        self._last_progress = time.monotonic()
        self.host = socket.gethostname()

    # ------------------------------------------------------------ training thread
    def beat(self, step: int, phase: str, collective: str | None = None) -> None:
        """Record progress: the training thread is at `step`, entering `phase` (the pulse's writes)."""
        pulse = self.pulse
        if step != pulse.step:
            pulse.step, pulse.seq = step, 0
        pulse.phase = phase
        pulse.seq += 1
        if collective is not None:
            pulse.collective = collective

    def start(self) -> None:
        self._last_progress = time.monotonic()
        self._seen = self.pulse.position()
        # Publish once from this thread: a rank that freezes (holding the GIL) before its watchdog
        # thread first runs is still known by host and pid, so the report can name and end it.
        if not self.yielding:
            self.store.set(f"hb/{self.rank}", json.dumps(self.heartbeat()))
            self._published = self._seen
        _ACTIVE.append(self)
        self._thread = threading.Thread(target=self._run, name="dptrain-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(ValueError):
            _ACTIVE.remove(self)
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1)
            self._thread = None

    # ------------------------------------------------------------ watchdog thread
    def heartbeat(self) -> dict[str, Any]:
        """This rank's position, as published to the store."""
        pulse = self.pulse
        return {"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": pulse.step, "seq": pulse.seq,
                "phase": pulse.phase, "collective": pulse.collective, "time": time.time(),
                "idle_s": round(time.monotonic() - self._last_progress, 2)}

    def _look(self) -> tuple[int, int]:
        """The pulse's position now; a change since the last look is progress (timed from now)."""
        position = self.pulse.position()
        if position != self._seen:
            self._seen, self._last_progress = position, time.monotonic()
        return position

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                if self.yielding and any(w is not self for w in _ACTIVE):
                    continue  # dptrain.monitor's watchdog runs in this process: it does this job
                if (position := self._look()) != self._published:
                    self._published = position
                    self.store.set(f"hb/{self.rank}", json.dumps(self.heartbeat()))
                if self.store.add(_FLAG, 0) > 0:
                    self._on_hang(reporter=False)
                elif time.monotonic() - self._last_progress > self.timeout_s:
                    self._on_hang(reporter=self.store.add(_FLAG, 1) == 1)
                elif self.desync is not None and (found := self.desync.tick()) is not None:
                    by = found.found_by or (f"rank {self.rank}, waiting in {self.desync.waited} "
                                            f"(diagnostics.desync_after_s={self.desync_after_s:g}: the job does not "
                                            "wait for hang_timeout_s when the ranks' collectives disagree)")
                    self.store.set(_REASON, f"collective desync ({found.kind}) found by {by}")
                    self._on_hang(reporter=self.store.add(_FLAG, 1) == 1)
        except Exception as e:  # noqa: BLE001 - any failure ends hang detection on this rank: report it
            if not self._stop.is_set():  # after stop(): the job is ending, the store may be gone
                self._on_death(e)

    def _print_death(self, error: BaseException) -> None:
        print(f"dptrain watchdog: rank {self.rank}: died ({type(error).__name__}: {error}); "
              "no hang detection on this rank from now on", file=sys.stderr, flush=True)

    def _on_hang(self, *, reporter: bool) -> None:
        heartbeat = self.heartbeat()
        record = {**heartbeat, **snapshot(rank=self.rank, heartbeat=heartbeat)}
        stacks = format_stacks(skip_ident=threading.get_ident())
        written = ""
        if self.run_dir is not None:
            path = self.run_dir / "stacks" / f"rank{self.rank}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_describe(record) + "\n\n" + stacks)
            written = f"; stacks written to {path}"
        self.store.set(f"stack/{self.rank}", json.dumps({**record, "stacks": stacks}))
        print(f"dptrain watchdog: rank {self.rank} ({self.host}): {_describe(record)}{written}",
              file=sys.stderr, flush=True)
        deadline = time.monotonic() + 3 * self.interval_s + 3.0
        if reporter:
            beats = self._collect(deadline)
            reason = self.store.get(_REASON).decode() if self.store.check([_REASON]) else None
            report = hang_report(beats, timeout_s=self.timeout_s, reporter=self.rank, run_dir=self.run_dir,
                                 reason=reason, desync=self._desync_of(beats))
            if self.run_dir is not None:
                (self.run_dir / "hang_report.txt").write_text(report)
            print(report, file=sys.stderr, flush=True)
            self._kill_frozen(beats)
            self._silence()
            self.store.set(_DONE, str(self.rank))
        else:
            self._silence()
            with contextlib.suppress(Exception):  # the store's host (rank 0, the reporter) left: the report is out
                while time.monotonic() < deadline and not self.store.check([_DONE]):
                    time.sleep(0.05)
        detail = str(self.run_dir / "hang_report.txt") if self.run_dir is not None else "the report above"
        mark_exit(EXIT_HANG, "hang watchdog", detail=detail)  # for the launcher
        self._on_exit(EXIT_HANG)

    def _silence(self) -> None:
        if self._on_exit is os._exit:  # not in a test that keeps the process
            _silence_main_thread()

    def _desync_of(self, beats: dict[int, dict[str, Any] | None]) -> Desync | None:
        """The ring comparison of the ranks that answered (their records carry their rings)."""
        snaps = {r: b for r, b in beats.items() if b is not None and b.get("answered") and "ring" in b}
        found = find_desync(snaps, wait_s=min(self.desync_after_s or 5.0, self.timeout_s))
        if found is None and self.desync is not None and self.desync.last is not None and self.desync.last.certain:
            found = self.desync.last  # a mismatch the check mode found in a window the rings no longer hold
        return found

    def _kill_frozen(self, beats: dict[int, dict[str, Any] | None]) -> None:
        """SIGKILL ranks on this host that never answered the alarm: they are frozen holding the GIL,
        so neither their watchdog nor a Python SIGTERM handler (preemption) can end them, and the
        launcher would otherwise wait out its shutdown timeout before killing them."""
        for r, b in beats.items():
            if b is not None and not b.get("answered", True) and b.get("host") == self.host and b.get("pid"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(b["pid"]), signal.SIGKILL)
                    print(f"dptrain watchdog: killed frozen rank {r} (pid {b['pid']})", file=sys.stderr, flush=True)

    def _collect(self, deadline: float) -> dict[int, dict[str, Any] | None]:
        """Every rank's stack record, waiting until `deadline` for late ones (then their last heartbeat)."""
        keys = [f"stack/{r}" for r in range(self.world_size)]
        while time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(self.interval_s / 4)
        beats: dict[int, dict[str, Any] | None] = {}
        for r in range(self.world_size):
            beats[r] = None
            for key, answered in ((f"stack/{r}", True), (f"hb/{r}", False)):
                if self.store.check([key]):
                    beats[r] = {**json.loads(self.store.get(key)), "answered": answered}
                    break
        return beats


def _silence_main_thread() -> None:
    """This process ends in a moment, and so do its peers: its main thread, blocked in a collective, may see a
    peer go first and raise "connection closed by peer" before `os._exit` runs. That traceback (on the console and in
    torchelastic's error file, where torchrun's report would take it for the cause) is noise after the report:
    stderr goes to /dev/null and the error file's variable is dropped, once this rank's own lines are out."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ.pop("TORCHELASTIC_ERROR_FILE", None)
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)


def _describe(b: dict[str, Any]) -> str:
    if b.get("phase") == "setup" and not b.get("step"):  # no heartbeats (the `dptrain launch` shim's watchdog)
        return f"main thread at {b.get('site') or b.get('where') or '?'}"
    coll = f", last collective: {b['collective']}" if b.get("collective") else ""
    return f"no progress for {b['idle_s']:.1f}s at step {b['step']}, phase {b['phase']}{coll}"


def hang_report(beats: dict[int, dict[str, Any] | None], *, timeout_s: float, reporter: int, run_dir: Path | None,
                reason: str | None = None, desync: Desync | None = None) -> str:
    """The text of `hang_report.txt`: suspects, a table of every rank's position, suspects' stacks. `reason`: why
    the report came (default: no progress for timeout_s); `desync`: where the collective rings diverge, which
    then names the suspects (a rank that did not answer is still named first)."""
    suspects, why = find_suspects(beats)
    if desync is not None and desync.certain and "did not answer" not in why:
        suspects, why = desync.ranks, f"collective desync: {desync.summary}"
    elif desync is not None:  # a rank outside the collective the others wait in: their positions agree on it
        suspects, why = suspects or desync.ranks, f"{why}. Collectives: {desync.summary}"
    named = ", ".join(f"rank {r}" + (f" ({b['host']}, pid {b['pid']})" if (b := beats[r]) else "") for r in suspects)
    lines = [
        "dptrain hang report",
        f"{reason or f'no progress for {timeout_s:g}s (diagnostics.hang_timeout_s)'}; detected by rank {reporter} "
        f"at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"suspect rank(s): {named or 'none singled out'} -- {why}",
        "",
        f"{'rank':>4}  {'host':<16} {'pid':>7}  {'step':>6}  {'phase':<12} {'idle s':>7}  last collective",
    ]
    for r, b in sorted(beats.items()):
        if b is None:
            lines.append(f"{r:>4}  (no heartbeat)")
            continue
        lines.append(f"{r:>4}  {b['host'][:16]:<16} {b['pid']:>7}  {b['step']:>6}  {b['phase']:<12} "
                     f"{b['idle_s']:>7.1f}  {b.get('collective') or '-'}")
        if b.get("where"):
            lines.append(f"{'':>6}at {b['where']}")
    if desync is not None:
        lines += ["", f"collectives around #{desync.key[1]} (flight recorder ring; main-thread position):",
                  *(f"  {line}" for line in desync.details)]
    for r in suspects or sorted(beats):
        stack = (beats.get(r) or {}).get("stacks")
        if stack:
            lines += ["", f"===== rank {r} stacks =====", stack.rstrip()]
    if run_dir is not None:
        lines += ["", f"stacks of every rank: {run_dir / 'stacks'}/rank<N>.txt"]
    return "\n".join([*lines, ""])
