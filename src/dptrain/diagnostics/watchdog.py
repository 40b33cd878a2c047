"""Hang watchdog: heartbeats through the job's store, stacks of every rank, one report, exit.

Every rank runs a daemon thread. The training thread only records where it is (`beat`: step,
phase, last collective; a few attribute writes). The thread publishes that position to the
job's store (torch.distributed's default store: torchrun's TCPStore) when it changes, and
watches local progress. When a rank has made no progress for `timeout_s`, it raises a flag in
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
import os
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dptrain.distributed.exit_marks import mark_exit

EXIT_HANG = 3
"""Exit code of every rank after a hang report."""

_FLAG, _DONE = "hang", "hang_reported"
# Where a rank blocked in a collective waits: c10d calls, FSDP/DDP hooks, the autograd engine
# (DDP reduces gradients inside backward). The innermost Python frame of such a rank is in one.
_WAITING_IN = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/")


def main_thread_position() -> tuple[str, bool]:
    """("file:line in function" of the main thread's innermost Python frame, whether it is in torch's
    distributed or autograd code, i.e. most likely waiting for other ranks)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "?", False
    code = frame.f_code
    path = code.co_filename.replace("\\", "/")
    # A DTensor (tensor-parallel) collective waits in torch's op dispatcher (torch/_ops.py), called
    # from torch/distributed's functional collectives: judge by the first frame outside the dispatcher.
    caller: types.FrameType | None = frame
    caller_path = path
    while caller is not None and caller_path.endswith("torch/_ops.py"):
        caller = caller.f_back
        caller_path = caller.f_code.co_filename.replace("\\", "/") if caller is not None else ""
    return f"{path}:{frame.f_lineno} in {code.co_name}", any(part in caller_path for part in _WAITING_IN)


def format_stacks(*, skip_ident: int | None = None) -> str:
    """The Python stack of every thread in this process, the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main)
    parts = []
    for ident, frame in frames:
        if ident == skip_ident:
            continue
        parts.append(f"Thread {names.get(ident, '?')} ({ident}), most recent call last:\n")
        parts.append("".join(traceback.format_stack(frame)))
    return "".join(parts)


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
    """

    def __init__(
        self,
        *,
        timeout_s: float,
        store: Any,
        rank: int,
        world_size: int,
        run_dir: Path,
        interval_s: float | None = None,
        on_exit: Callable[[int], None] = os._exit,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.store, self.rank, self.world_size = store, rank, world_size
        self.run_dir = Path(run_dir)
        self.interval_s = interval_s or min(1.0, max(0.05, timeout_s / 10))
        self._on_exit = on_exit
        self._on_death = on_death or self._print_death
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step, self._phase, self._collective, self._seq = 0, "setup", "", 0
        self._progress, self._published = 0, -1
        self._last_progress = time.monotonic()
        self.host = socket.gethostname()

    # ------------------------------------------------------------ training thread
    def beat(self, step: int, phase: str, collective: str | None = None) -> None:
        """Record progress: the training thread is at `step`, entering `phase`."""
        if step != self._step:
            self._step, self._seq = step, 0
        self._phase = phase
        self._seq += 1
        if collective is not None:
            self._collective = collective
        self._progress += 1
        self._last_progress = time.monotonic()

    def start(self) -> None:
        self._last_progress = time.monotonic()
        # Publish once from this thread: a rank that freezes (holding the GIL) before its watchdog
        # thread first runs is still known by host and pid, so the report can name and end it.
        self.store.set(f"hb/{self.rank}", json.dumps(self.heartbeat()))
        self._published = self._progress
        self._thread = threading.Thread(target=self._run, name="dptrain-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1)
            self._thread = None

    # ------------------------------------------------------------ watchdog thread
    def heartbeat(self) -> dict[str, Any]:
        """This rank's position, as published to the store."""
        return {"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": self._step, "seq": self._seq,
                "phase": self._phase, "collective": self._collective, "time": time.time(),
                "idle_s": round(time.monotonic() - self._last_progress, 2)}

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                if self._progress != self._published:
                    self._published = self._progress
                    self.store.set(f"hb/{self.rank}", json.dumps(self.heartbeat()))
                if self.store.add(_FLAG, 0) > 0:
                    self._on_hang(reporter=False)
                elif time.monotonic() - self._last_progress > self.timeout_s:
                    self._on_hang(reporter=self.store.add(_FLAG, 1) == 1)
        except Exception as e:  # noqa: BLE001 - any failure ends hang detection on this rank: report it
            if not self._stop.is_set():  # after stop(): the job is ending, the store may be gone
                self._on_death(e)

    def _print_death(self, error: BaseException) -> None:
        print(f"dptrain watchdog: rank {self.rank}: died ({type(error).__name__}: {error}); "
              "no hang detection on this rank from now on", file=sys.stderr, flush=True)

    def _on_hang(self, *, reporter: bool) -> None:
        where, in_collective = main_thread_position()
        record = {**self.heartbeat(), "where": where, "in_collective": in_collective}
        stacks = format_stacks(skip_ident=threading.get_ident())
        path = self.run_dir / "stacks" / f"rank{self.rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_describe(record) + "\n\n" + stacks)
        self.store.set(f"stack/{self.rank}", json.dumps({**record, "stacks": stacks}))
        print(f"dptrain watchdog: rank {self.rank} ({self.host}): {_describe(record)}; stacks written to {path}",
              file=sys.stderr, flush=True)
        deadline = time.monotonic() + 3 * self.interval_s + 3.0
        if reporter:
            beats = self._collect(deadline)
            report = hang_report(beats, timeout_s=self.timeout_s, reporter=self.rank, run_dir=self.run_dir)
            (self.run_dir / "hang_report.txt").write_text(report)
            print(report, file=sys.stderr, flush=True)
            self.store.set(_DONE, str(self.rank))
            self._kill_frozen(beats)
        else:
            while time.monotonic() < deadline and not self.store.check([_DONE]):
                time.sleep(self.interval_s / 2)
        sys.stdout.flush()
        mark_exit(EXIT_HANG, "hang watchdog", detail=str(self.run_dir / "hang_report.txt"))  # for the launcher
        self._on_exit(EXIT_HANG)

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


def _describe(b: dict[str, Any]) -> str:
    coll = f", last collective: {b['collective']}" if b.get("collective") else ""
    return f"no progress for {b['idle_s']:.1f}s at step {b['step']}, phase {b['phase']}{coll}"


def hang_report(beats: dict[int, dict[str, Any] | None], *, timeout_s: float, reporter: int, run_dir: Path) -> str:
    """The text of `hang_report.txt`: suspects, a table of every rank's position, suspects' stacks."""
    suspects, why = find_suspects(beats)
    named = ", ".join(f"rank {r}" + (f" ({b['host']}, pid {b['pid']})" if (b := beats[r]) else "") for r in suspects)
    lines = [
        "dptrain hang report",
        f"no progress for {timeout_s:g}s (diagnostics.hang_timeout_s); detected by rank {reporter} at "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}",
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
    for r in suspects or sorted(beats):
        stack = (beats.get(r) or {}).get("stacks")
        if stack:
            lines += ["", f"===== rank {r} stacks =====", stack.rstrip()]
    lines += ["", f"stacks of every rank: {run_dir / 'stacks'}/rank<N>.txt", ""]
    return "\n".join(lines)
