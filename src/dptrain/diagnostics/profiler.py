"""`diagnostics.profile_steps="A-B"`: torch.profiler over exactly optimizer steps A..B.

`StepProfiler` starts one `torch.profiler.profile` before the first step and advances its
schedule at every step boundary (`step_done`, called by the diagnostics hub's `on_step_end`).
The schedule waits until step A - 1, warms up for that one step (the profiler's first recorded
step carries its start-up cost), records steps A..B and then stops: the trace holds those steps
only. When B ends, every rank writes `RUN_DIR/profile/rank<R>.json` (Chrome trace format: open in
chrome://tracing or https://ui.perfetto.dev) and `rank<R>_ops.txt` (the top operations by self
time, `key_averages().table`), and `summarize` splits the self time into communication (operator
names of c10d, gloo, NCCL and the collectives) and everything else, so a step's communication
share is one number. Nothing is recorded outside the window, so steps before and after it run at
full speed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

COMM_PATTERN = re.compile(
    r"c10d|gloo|nccl|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all|alltoall|barrier"
    r"|record_param_comms|ProcessGroup|_c10d_functional|send|recv",
    re.IGNORECASE,
)
"""Operator names counted as communication (self time; nested ops are not counted twice)."""

TOP_OPS = 15


def is_communication(name: str) -> bool:
    return COMM_PATTERN.search(name) is not None


def summarize(events: Any, *, steps: int, device_time: bool) -> dict[str, Any]:
    """Self time of `key_averages()` rows split into communication and the rest, in ms per step;
    `device_time`: use the CUDA kernels' self time as well as the host's."""
    rows = []
    for e in events:
        cpu = e.self_cpu_time_total / 1e3
        dev = getattr(e, "self_device_time_total", 0.0) / 1e3 if device_time else 0.0
        rows.append({"name": e.key, "calls": e.count, "self_cpu_ms": cpu, "self_device_ms": dev,
                     "communication": is_communication(e.key)})
    comm = [r for r in rows if r["communication"]]
    total_cpu = sum(r["self_cpu_ms"] for r in rows)
    comm_cpu = sum(r["self_cpu_ms"] for r in comm)
    out: dict[str, Any] = {
        "steps": steps,
        "self_cpu_ms_per_step": total_cpu / steps,
        "communication_cpu_ms_per_step": comm_cpu / steps,
        "communication_share": comm_cpu / total_cpu if total_cpu else 0.0,
        "communication_ops": sorted(({k: r[k] for k in ("name", "calls", "self_cpu_ms", "self_device_ms")}
                                     for r in comm), key=lambda r: -(r["self_cpu_ms"] + r["self_device_ms"]))[:8],
    }
    if device_time:
        total_dev = sum(r["self_device_ms"] for r in rows)
        comm_dev = sum(r["self_device_ms"] for r in comm)
        out.update(self_device_ms_per_step=total_dev / steps, communication_device_ms_per_step=comm_dev / steps)
    return out


def describe(summary: dict[str, Any], *, rank: int) -> str:
    """Two lines under the table: communication apart from the rest."""
    s = summary
    line = (f"rank {rank}: per profiled step {s['self_cpu_ms_per_step']:.2f} ms of host self time, of which "
            f"communication {s['communication_cpu_ms_per_step']:.2f} ms ({100 * s['communication_share']:.1f}%)")
    if "self_device_ms_per_step" in s:
        line += (f"; GPU: {s['self_device_ms_per_step']:.2f} ms of kernels, communication "
                 f"{s['communication_device_ms_per_step']:.2f} ms")
    names = ", ".join(
        f"{o['name']} ({o['self_cpu_ms']:.1f} ms / {o['calls']} calls)" for o in s["communication_ops"][:4]
    )
    return line + (f"\n  communication ops: {names}" if names else "\n  no communication op was recorded")


class StepProfiler:
    """torch.profiler over steps `first..last` (1-based) of a run that has done `start_step` steps."""

    def __init__(
        self,
        steps: tuple[int, int],
        *,
        run_dir: Path,
        rank: int,
        device: torch.device,
        start_step: int = 0,
        say: Callable[[str], None] | None = None,
        is_main: bool = True,
    ) -> None:
        self.first, self.last = steps
        self.dir = Path(run_dir) / "profile"
        self.rank, self.device, self.is_main = rank, device, is_main
        self._say = say or print
        self.summary: dict[str, Any] | None = None
        self.prof: Any = None
        if self.first <= start_step:
            if is_main:
                self._say(
                    f"dptrain: diagnostics.profile_steps={self.first}-{self.last}: this run resumed after step "
                    f"{start_step}, so those steps are not profiled"
                )
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        # Profiler steps count from 0 at the first step this process trains (start_step + 1).
        skip = self.first - start_step - 1
        warmup = 1 if skip >= 1 else 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(
            activities=activities,
            record_shapes=False,
            schedule=schedule(wait=skip - warmup, warmup=warmup, active=self.last - self.first + 1, repeat=1),
            on_trace_ready=self._write,
        )
        self.prof.__enter__()

    def step_done(self, step: int) -> None:
        """After optimizer step `step` (1-based): advance the schedule; stop after the last step."""
        if self.prof is None:
            return
        self.prof.step()
        if step >= self.last:
            self.close()

    def _write(self, prof: Any) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.dir / f"rank{self.rank}.json"))
        events = prof.key_averages()
        cuda = self.device.type == "cuda"
        table = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=TOP_OPS)
        self.summary = summarize(events, steps=self.last - self.first + 1, device_time=cuda)
        text = f"{table}\n{describe(self.summary, rank=self.rank)}\n"
        (self.dir / f"rank{self.rank}_ops.txt").write_text(text)
        if self.is_main:
            self._say(
                f"profile of steps {self.first}-{self.last} (rank {self.rank}; every rank's trace and table: "
                f"{self.dir}/rank<R>.json, rank<R>_ops.txt)\n{text.rstrip()}"
            )

    def close(self) -> None:
        """Stop profiling (a run shorter than the window writes what it recorded, if anything)."""
        prof, self.prof = self.prof, None
        if prof is not None:
            prof.__exit__(None, None, None)
