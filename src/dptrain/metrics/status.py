"""Per-rank status files for `dptrain top`: RUN_DIR/status/rank<R>.json.

Every rank runs a daemon thread that rewrites its file every `log.status_every_s` seconds (default 1):
the step being trained and the phase it is in (the diagnostics' heartbeat position: data, forward,
backward, optimizer, eval, checkpoint, ...), this rank's step time and throughput from its last log
record, host memory, CUDA memory and the GPU's NVML readings. The training thread only hands over
its log record at log steps (a dict copy); the thread reads the position (two attribute reads) and
samples memory itself, so no step pays for it and nothing is synchronised across ranks. Each file is
replaced atomically (write, then rename), so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dptrain.metrics import strict_json

if TYPE_CHECKING:  # `dptrain top` imports this module: no torch at import
    import torch

DIR = "status"
RECORD_KEYS = ("step_time_s", "tokens_per_s", "samples_per_s", "tokens_per_s_per_rank", "mfu", "loss", "lr")


def status_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / DIR / f"rank{rank}.json"


class StatusWriter:
    """This rank's status file, rewritten by a background thread."""

    def __init__(self, run_dir: Path, *, rank: int, local_rank: int, world_size: int, device: torch.device,
                 position: Callable[[], tuple[int, str]], every_s: float) -> None:
        self.path = status_path(run_dir, rank)
        with contextlib.suppress(OSError):  # a node that cannot write the run directory just has no status file
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.device, self._position, self.every_s = device, position, every_s
        self._fixed = {"rank": rank, "local_rank": local_rank, "world_size": world_size,
                       "host": socket.gethostname(), "pid": os.getpid(), "device": str(device),
                       "started": time.time()}
        # lazy: gpu imports torch; `dptrain top` reads status without it
        from dptrain.metrics.gpu import GpuSampler

        try:
            self._gpu = GpuSampler.open(device)
        except (RuntimeError, OSError):  # no nvidia-ml-py / NVML library: the view shows no GPU columns
            self._gpu = None
        self._last: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dptrain-status", daemon=True)
        self._thread.start()

    def write(self, record: dict[str, Any]) -> None:
        """A log record of this rank (called by the training thread at log steps)."""
        if "loss" in record:
            self._last = {k: record[k] for k in RECORD_KEYS if k in record} | {"logged_step": record.get("step")}

    def snapshot(self, *, phase: str | None = None) -> dict[str, Any]:
        # lazy: gpu imports torch (see __init__)
        from dptrain.metrics.gpu import process_memory

        step, current = self._position()  # the step being trained (1-based)
        if phase == "done":
            step -= 1  # the run is over: its last finished step
        out = {**self._fixed, "time": time.time(), "step": step, "phase": phase or current, **self._last,
               **process_memory(self.device)}
        if self._gpu is not None:
            with contextlib.suppress(Exception):  # a GPU reading must never stop the status thread
                out.update(self._gpu.sample())
        return out

    def _dump(self, record: dict[str, Any]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(strict_json.dumps(record) + "\n")
        os.replace(tmp, self.path)

    def _run(self) -> None:
        while True:
            with contextlib.suppress(OSError):  # a full disk or a vanished directory: try again next time
                self._dump(self.snapshot())
            if self._stop.wait(self.every_s):
                return

    def close(self, *, finished: bool = True) -> None:
        """The last rewrite says how the run ended here: phase `done`, or `stopped` (failed, preempted)."""
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._dump(self.snapshot(phase="done" if finished else "stopped"))
