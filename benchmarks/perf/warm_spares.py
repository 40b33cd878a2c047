"""Warm spare workers (launch.warm_workers) against cold ones: seconds from a worker SIGKILL to the next step trained.

One node, `dptrain run` of the toy MLP recipe with 2 workers, launch.max_restarts=3, checkpoints every 5 steps
(in-memory snapshots every step, the default of a run that can restart). Once step 8 is logged, the process that
trains rank 1 (its pid from RUN_DIR/attempts/rank1.json: the worker itself, or the process the warm server forked)
is SIGKILLed; the recovery time is from the kill to the appearance of the next step's record in metrics.jsonl (as
benchmarks/acceptance/chaos_soak.py measures it).
Trials alternate warm_workers=false and true. Also printed: the warm server's
import time and memory (its ready.json, psutil), and the load average around each trial.

    python benchmarks/perf/warm_spares.py --trials 5 --md docs/results/warm_spares.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PACE_S = 0.05

TOY = [
    "model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
    "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every_steps=1", "train.eval_every_steps=0",
    "log.progress=false", "train.loss=warm_spares:paced_loss", "train.max_steps=16", "checkpoint.every_steps=5",
    "launch.max_restarts=3",
]


def paced_loss(model: Any, batch: Any) -> Any:
    """The model's own loss after a short sleep: steps slow enough to aim the kill at."""
    time.sleep(PACE_S)
    return model(batch)


def loss_steps(run: Path) -> list[int]:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(ln)["step"] for ln in lines if '"loss"' in ln and ln.endswith("}")]


def trainer_pid(run: Path, rank: int) -> int | None:
    try:
        return int(json.loads((run / "attempts" / f"rank{rank}.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def server_cost(launcher: int) -> dict[str, Any] | None:
    """The warm server's ready.json (import time, RSS then) and its memory now."""
    for child in psutil.Process(launcher).children():
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if "dptrain.launch.warm_server" in cmd:
            folder = Path(cmd[cmd.index("dptrain.launch.warm_server") + 1])
            try:
                ready = json.loads((folder / "ready.json").read_text())
                mem = child.memory_full_info()
            except (OSError, ValueError, psutil.Error):
                return None
            return {**ready, "rss_now_bytes": mem.rss, "uss_now_bytes": mem.uss}
    return None


def trial(work: Path, warm: bool, env: dict[str, str]) -> dict[str, Any]:
    run = work / f"run-{'warm' if warm else 'cold'}-{time.monotonic_ns()}"
    load_before = os.getloadavg()[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dptrain", "run", *TOY, f"launch.warm_workers={str(warm).lower()}",
         "--nproc-per-node", "2", "--out", str(run)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while max(loss_steps(run), default=0) < 8:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run did not reach step 8: {proc.communicate()[0][-2000:]}")
            time.sleep(0.005)
        cost = server_cost(proc.pid) if warm else None
        seen = len(loss_steps(run))
        pid = trainer_pid(run, 1)
        assert pid is not None, "no pid for rank 1"
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while len(loss_steps(run)) <= seen:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run did not train again: {proc.communicate()[0][-2000:]}")
            time.sleep(0.005)
        recovery = time.monotonic() - t0
        output = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed ({proc.returncode}): {output[-2000:]}")
    cold_lines = [ln for ln in output.splitlines() if "without it (cold)" in ln]
    shutil.rmtree(run, ignore_errors=True)
    return {"warm": warm, "recovery_s": round(recovery, 3), "load_before": load_before,
            "load_after": os.getloadavg()[0], "server": cost, "cold_fallbacks": len(cold_lines)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5, help="kills per setting (alternating)")
    p.add_argument("--md", type=Path, help="write the table here")
    args = p.parse_args(argv)
    paths = [str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    work = Path(tempfile.mkdtemp(prefix="warm-spares-"))
    results = []
    try:
        for i in range(2 * args.trials):
            r = trial(work, warm=bool(i % 2), env=env)
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cold = [r["recovery_s"] for r in results if not r["warm"]]
    warm = [r["recovery_s"] for r in results if r["warm"]]
    servers = [r["server"] for r in results if r["server"]]
    loads = [x for r in results for x in (r["load_before"], r["load_after"])]
    summary = {
        "cold_median_s": statistics.median(cold), "warm_median_s": statistics.median(warm),
        "cold_s": cold, "warm_s": warm, "load_min": min(loads), "load_max": max(loads),
        "server_import_s": statistics.median(s["import_s"] for s in servers) if servers else None,
        "server_rss_mib": round(statistics.median(s["rss_now_bytes"] for s in servers) / 2**20, 1) if servers else None,
        "server_uss_mib": round(statistics.median(s["uss_now_bytes"] for s in servers) / 2**20, 1) if servers else None,
        "cold_fallbacks": sum(r["cold_fallbacks"] for r in results if r["warm"]),
    }
    print(json.dumps(summary, indent=1))
    if args.md:
        args.md.write_text(markdown(summary, argv=sys.argv[1:]))
    return 0


def markdown(s: dict[str, Any], *, argv: list[str]) -> str:
    return "\n".join([
        "# Warm spare workers", "",
        f"`python benchmarks/perf/warm_spares.py {' '.join(argv)}` (toy MLP, 2 workers on one node, "
        "launch.max_restarts=3; "
        "rank 1's training process SIGKILLed after step 8; recovery: the kill to the next step's metrics record). "
        f"Load average {s['load_min']:.1f}-{s['load_max']:.1f} over the trials (2 shared cores).", "",
        "| launch.warm_workers | median | each trial (s) |", "|---|---|---|",
        f"| false (cold workers) | **{s['cold_median_s']:.2f} s** | {', '.join(f'{x:.2f}' for x in s['cold_s'])} |",
        f"| true (warm spares) | **{s['warm_median_s']:.2f} s** | {', '.join(f'{x:.2f}' for x in s['warm_s'])} |",
        "",
        f"The warm server (one per node): imports in {s['server_import_s']} s (beside the first workers' start), "
        f"RSS {s['server_rss_mib']} MiB, of which {s['server_uss_mib']} MiB its own (USS; the rest is shared "
        f"libraries); workers that fell back to a cold start: {s['cold_fallbacks']}.", "",
    ])


if __name__ == "__main__":
    sys.exit(main())
