"""What the time model takes from measurements instead of datasheets.

- `link_from_sweep`: α and β of the data-parallel link, fitted to a `dptrain doctor --comm --json
  FILE` all-reduce sweep. A ring all-reduce of S bytes on n ranks takes t = 2(n-1)α + 2(n-1)/n·S/B
  (plan/timing.py); a least-squares line t = a + b·S through the sweep, each point weighted by
  1/t (so the 4 KiB and the 64 MiB points count alike, as relative errors), gives α = a/(2(n-1))
  and B = 2(n-1)/(n·b).
- `efficiency_from_run`: the compute efficiency of a finished `dptrain run` (its run directory):
  the median over its logged steps (the first `skip` dropped: warm-up) of the achieved share of
  the peak while computing, mfu·t/(t - exposed comm) with t the step time; dptrain logs all three
  per step (`metrics.jsonl`: mfu against the device's peak, step_time_s, exposed_comm_s).
- `cpu_spec`: this machine's CPU as a "device" for `--gpu-type cpu`: the fp32 (and bf16) matmul
  peak measured here at the threads a rank gets (`dptrain run` gives each of n ranks
  cores // n threads), times cores / (n·threads) when the ranks oversubscribe the cores.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from dptrain.metrics.hardware import GpuSpec
from dptrain.tools.plan.timing import Link


def load_sweep(path: str | Path) -> dict:
    """A `dptrain doctor --comm --json FILE` document; ValueError naming the file when it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--comm {path}: cannot read a JSON sweep ({e}); write one with "
                         f"`dptrain doctor --comm --json {path}`") from e
    if not isinstance(doc, dict) or doc.get("kind") != "dptrain.commcheck" or len(doc.get("all_reduce", [])) < 2:
        raise ValueError(f"--comm {path}: not a `dptrain doctor --comm --json` sweep (needs kind "
                         f"'dptrain.commcheck' and at least 2 all_reduce rows)")
    return doc


def link_from_sweep(doc: dict) -> Link:
    """α (s per ring step) and B (bytes/s per link, one direction) fitted to the sweep (module doc)."""
    n = int(doc["ranks"])
    if n < 2:
        raise ValueError(f"the sweep ran on {n} rank(s); alpha and beta need at least 2")
    pts = [(float(r["bytes"]), float(r["seconds"])) for r in doc["all_reduce"]]
    w = [1 / t**2 for _, t in pts]  # least squares on relative errors: minimise sum((fit - t) / t)^2
    sw = sum(w)
    mx = sum(wi * s for wi, (s, _) in zip(w, pts, strict=True)) / sw
    my = sum(wi * t for wi, (_, t) in zip(w, pts, strict=True)) / sw
    sxx = sum(wi * (s - mx) ** 2 for wi, (s, _) in zip(w, pts, strict=True))
    slope = sum(wi * (s - mx) * (t - my) for wi, (s, t) in zip(w, pts, strict=True)) / sxx
    intercept = max(0.0, my - slope * mx)
    if slope <= 0:
        raise ValueError("the sweep's times do not grow with the message size: no bandwidth can be fitted")
    return Link(bandwidth=2 * (n - 1) / (n * slope), alpha=intercept / (2 * (n - 1)))


def efficiency_from_run(run_dir: str | Path, *, skip: int = 3) -> tuple[float, int]:
    """(compute efficiency, steps it is the median of) from a run directory's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"--calibrate {run_dir}: no metrics.jsonl there (give the run directory of a `dptrain run`)")
    shares = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("mfu") is None or not rec.get("step_time_s") or rec.get("step", 0) <= skip:
            continue
        busy = rec["step_time_s"] - (rec.get("exposed_comm_s") or 0.0)
        if busy > 0:
            shares.append(rec["mfu"] * rec["step_time_s"] / busy)
    if not shares:
        raise ValueError(f"--calibrate {run_dir}: metrics.jsonl has no step after {skip} with mfu and step_time_s "
                         f"(run longer, with log.every_steps small enough)")
    return statistics.median(shares), len(shares)


def run_ranks_per_host(run_dir: Path) -> int:
    """Ranks per host of a finished run: its config's launch.nproc_per_node, else its world size."""
    import yaml

    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    nproc = ((cfg or {}).get("launch") or {}).get("nproc_per_node")
    return int(nproc) if isinstance(nproc, int) or (isinstance(nproc, str) and nproc.isdigit()) \
        else int(summary.get("world_size", 1))


def calibrated_efficiency(run_dir: str | Path, *, cpu: bool, skip: int = 3) -> tuple[float, str]:
    """(efficiency, where it comes from) of a run directory for the time model. On the CPU the run's
    own peak (measured in the run, summary.json) and this process's measurement of the same
    configuration differ by their noise: the efficiency is rescaled by their ratio, so that
    efficiency x this process's peak is the compute rate the run achieved, and other rank counts
    scale from it by this process's own measurements."""
    eff, steps = efficiency_from_run(run_dir, skip=skip)
    source = f"calibrated: median of {steps} steps of {run_dir}"
    summary_path = Path(run_dir) / "summary.json"
    if cpu and summary_path.is_file() and (run_peak := json.loads(summary_path.read_text()).get("peak_flops")):
        rph = run_ranks_per_host(Path(run_dir))
        here = cpu_spec(ranks_per_host=rph).peaks["fp32"]
        eff *= run_peak / here
        source += (
            f", its peak {run_peak / 1e9:.1f} GFLOP/s per rank against {here / 1e9:.1f} measured here ({rph} rank(s))"
        )
    return eff, source


def threads_per_rank(nproc: int, cores: int | None = None) -> int:
    """The OMP threads `dptrain run` gives each of `nproc` ranks on this machine (launch.py)."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) >= 1:
        return int(env)
    return max(1, (cores or os.cpu_count() or 1) // max(1, nproc))


def cpu_spec(*, ranks_per_host: int, seconds: float = 0.3) -> GpuSpec:
    """This CPU as a device: memory, and the fp32 matmul peak at the threads one rank gets (the
    median of three timings, measured once per thread count in a process: every prediction of a
    plan uses the same figure)."""
    import psutil

    cores = os.cpu_count() or 1
    threads = threads_per_rank(ranks_per_host, cores)
    share = min(1.0, cores / (ranks_per_host * threads))  # oversubscribed: the ranks split the cores
    fp32 = matmul_peak(threads, seconds) * share
    name = (
        f"CPU ({cores} cores, {ranks_per_host} rank(s) x {threads} thread(s), measured fp32 matmul peak "
        f"{fp32 / 1e9:.1f} GFLOP/s per rank)"
    )
    # autocast on the CPU: the same fp32 peak is used for bf16/fp16 (not measured separately)
    peaks = {"fp32": fp32, "tf32": fp32, "bf16": fp32, "fp16": fp32}
    return GpuSpec("cpu", "", name, psutil.virtual_memory().total / 1e9 / ranks_per_host, peaks, 0, 0)


_PEAKS: dict[tuple[int, float], float] = {}


def matmul_peak(threads: int, seconds: float) -> float:
    """FLOP/s of fp32 matmuls on `threads` threads (`metrics.mfu.cpu_matmul_peak`, the figure a run's
    MFU uses), the median of three timings; cached per process."""
    key = (threads, seconds)
    if key not in _PEAKS:
        import torch

        # lazy: torch: only to measure this CPU
        from dptrain.metrics import mfu

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            _PEAKS[key] = statistics.median(mfu.cpu_matmul_peak(seconds=seconds) for _ in range(3))
        finally:
            torch.set_num_threads(before)
    return _PEAKS[key]
