"""Cost of the collective fingerprint (torch's flight recorder + the desync watchdog) per step of `dptrain run`.

    python benchmarks/perf/desync_overhead.py [--rounds 4] [--steps 150] [--model toy|llama] [--concurrent]
        [--variants off,default,torch's,check,off again]
    python benchmarks/perf/desync_overhead.py --pairs 8 --model llama    # the whole-step ratio, on vs off

The flight recorder's size is fixed once per process, so each variant is its own 2-rank torchrun job; the
variants take turns in rounds (one job per variant per round), so a slow drift of the machine hits all
alike, or with `--concurrent` run at the same time (on a machine shared with other work, the better
comparison: every variant sees the same load at the same moment); the medians are printed side by side
with the difference from the first variant (the recorder off):

- off: TORCH_FR_BUFFER_SIZE=0 and diagnostics.desync_after_s=0 (no ring, no comparison);
- default: dptrain's default (a 128-entry ring, desync_after_s=5: the watchdog thread reads the ring only
  while the main thread is inside torch.distributed or autograd);
- torch's ring: TORCH_FR_BUFFER_SIZE=2000 (torch's own default) with desync_after_s=5;
- check every 10 steps: the default plus diagnostics.collective_check_every_steps=10;
- off again: the noise.

`--pairs N`: the whole-step ratio of the default (ring + desync checks) to off, measured side by side: N pairs of
one "default" and one "off" job started together (which one starts first alternates), each pair's ratio of median
step times, and the median of the N ratios with their spread. Next to it, two figures that a shared machine's load
moves much less: the ratio of CPU time per step (the process's, so the watchdog thread's reads count), and the
estimate per-collective cost (`--micro`, measured in the same run) x collectives per step (from the ring's sequence
numbers) / the off job's step time.

Each job runs `dptrain run`'s whole step (`run_step`, as benchmarks/perf/diagnostics_overhead.py) with the hang
watchdog on (300 s) in every variant; rank 0 also times one ring read (torch's pickle dump) and one snapshot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {
    "off (no ring)": ({"TORCH_FR_BUFFER_SIZE": "0"}, ["diagnostics.desync_after_s=0"]),
    "default (ring 128, desync 5 s)": ({}, []),
    "torch's ring (2000)": ({"TORCH_FR_BUFFER_SIZE": "2000"}, []),
    "check every 10 steps": ({}, ["diagnostics.collective_check_every_steps=10"]),
    "off again (the noise)": ({"TORCH_FR_BUFFER_SIZE": "0"}, ["diagnostics.desync_after_s=0"]),
}
MODELS = {
    "toy": ["model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
            "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={n: 100000}"],
    "llama": [],  # the default recipe: 0.9 M-parameter LM on the stdlib corpus
}
MICRO = {"toy": 16, "llama": 8}
OTHERS_OFF = ["diagnostics.straggler_every_steps=0", "diagnostics.drift_every_steps=0",
              "diagnostics.rss_every_steps=0", "diagnostics.preflight=false"]


def worker(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from dptrain.config.load import load_config
    from dptrain.diagnostics.collective_ring import read_calls, snapshot
    from dptrain.distributed.flight_recorder import enable_by_default
    from dptrain.tools.bench.harness import run_step
    from dptrain.train.trainer import Trainer

    enable_by_default()  # as dptrain's process group does
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cfg = load_config(None, [
        *MODELS[a.model], f"train.micro_batch_size={MICRO[a.model]}", "train.grad_accum_steps=1",
        f"train.global_batch_size={MICRO[a.model] * world}", "log.progress=false", "optim.warmup_steps=0",
        f"train.max_steps={a.steps + 10}", "diagnostics.hang_timeout_s=300", *OTHERS_OFF, *a.overrides])
    trainer = Trainer(cfg, out_dir=tempfile.mkdtemp(prefix="dptrain-desync-overhead-"))
    trainer.setup()
    for _ in range(5):
        run_step(trainer)
    times, cpu = [], []
    seq0 = _issued()
    for _ in range(a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        run_step(trainer)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    per_step = (_issued() - seq0) / a.steps
    t0 = time.perf_counter()
    for _ in range(20):
        ring = read_calls()
    read_ms = (time.perf_counter() - t0) / 20 * 1e3
    t0 = time.perf_counter()
    for _ in range(20):
        snapshot(rank=dist.get_rank())
    snap_ms = (time.perf_counter() - t0) / 20 * 1e3
    trainer.close()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"times": times, "cpu": cpu, "read_ms": read_ms, "snapshot_ms": snap_ms,
                                      "entries": len(ring), "collectives_per_step": per_step}), flush=True)
    dist.destroy_process_group()


def _issued() -> int:
    """Collectives this process issued so far, all groups (the sum of each group's newest sequence number in the
    ring; 0 with the recorder off)."""
    from dptrain.diagnostics.collective_ring import read_calls

    newest: dict[str, int] = {}
    for c in read_calls():
        newest[c.pg] = max(newest.get(c.pg, 0), c.seq)
    return sum(newest.values())


def start_variant(name: str, a: argparse.Namespace) -> subprocess.Popen:
    env_add, overrides = VARIANTS[name]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FR_BUFFER_SIZE"}
    env.update(env_add, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.abspath(__file__), "--worker", "--model", a.model, "--steps", str(a.steps), "--", *overrides]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def result(name: str, proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=1800)
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{name}: no result (exit {proc.returncode}):\n{stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


MICRO_CODE = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
x = torch.ones(4)
best = []
for _ in range(30):
    t0 = time.perf_counter()
    for _ in range(2000):
        dist.all_reduce(x)
    best.append((time.perf_counter() - t0) / 2000)
print(min(best) * 1e6)
"""


def per_collective_us(batches: int = 30) -> dict[str, float]:
    """The recorder's cost per collective, where noise cannot hide it: the best of `batches` batches of 2000
    world-of-one all_reduces (no network: what is left is the per-call overhead), recorder off and on."""
    out = {}
    for size in ("0", "128", "2000"):
        env = {**os.environ, "TORCH_FR_BUFFER_SIZE": size, "OMP_NUM_THREADS": "1"}
        code = MICRO_CODE.replace("range(30)", f"range({batches})")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        out[size] = float(run.stdout.strip().splitlines()[-1])
    return out


def pairs(a: argparse.Namespace) -> None:
    """The whole-step ratio, default vs off, as the median of side-by-side pairs (module docstring)."""
    on, off = "default (ring 128, desync 5 s)", "off (no ring)"
    wall, cpu, per_step, step_off = [], [], [], []
    for i in range(a.pairs):
        order = [on, off] if i % 2 == 0 else [off, on]
        procs = {name: start_variant(name, a) for name in order}
        runs = {name: result(name, proc) for name, proc in procs.items()}
        wall.append(statistics.median(runs[on]["times"]) / statistics.median(runs[off]["times"]))
        cpu.append(statistics.median(runs[on]["cpu"]) / statistics.median(runs[off]["cpu"]))
        per_step.append(runs[on]["collectives_per_step"])
        step_off.append(statistics.median(runs[off]["times"]))
        print(f"pair {i + 1}: step {statistics.median(runs[on]['times']) * 1e3:.2f} vs {step_off[-1] * 1e3:.2f} ms "
              f"({(wall[-1] - 1) * 100:+.2f}%), CPU {(cpu[-1] - 1) * 100:+.2f}%", flush=True)
    us = per_collective_us(batches=a.micro_batches)
    added_us = us["128"] - us["0"]  # can come out below zero: the cost is under the timer's noise
    estimate = added_us * 1e-6 * statistics.median(per_step) / statistics.median(step_off)

    def spread(xs: list[float]) -> str:
        pct = [(x - 1) * 100 for x in (statistics.median(xs), min(xs), max(xs))]
        return f"{pct[0]:+.2f}% (pairs {pct[1]:+.2f}% to {pct[2]:+.2f}%)"

    print(f"model {a.model}, 2 ranks (gloo), {a.pairs} pairs x {a.steps} steps, a pair's two jobs at the same time")
    print(f"whole step, default vs off (median of pair ratios): {spread(wall)}; on a shared machine two identical "
          "jobs differ by more than this, see the spread")
    print(f"CPU time per step, default vs off (median of pair ratios): {spread(cpu)}")
    print(f"estimate: {added_us:+.2f} us per collective (ring 128: {us['128']:.2f} us vs off: {us['0']:.2f} us, best "
          f"of {a.micro_batches} x 2000) x "
          f"{statistics.median(per_step):.1f} collectives per step / {statistics.median(step_off) * 1e3:.2f} ms per "
          f"step = {estimate * 100:.3f}% of the step")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="toy")
    p.add_argument("--steps", type=int, default=150, help="timed steps per job")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrent", action="store_true",
                   help="run the variants' jobs at the same time (each round): they share the machine's load alike")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS to run")
    p.add_argument("--micro", action="store_true", help="only the per-collective cost of the recorder")
    p.add_argument("--pairs", type=int, default=0, help="the whole-step ratio from this many on/off pairs")
    p.add_argument("--micro-batches", type=int, default=30, help="batches of 2000 calls for the per-collective cost")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    if a.pairs:
        pairs(a)
        return
    if a.micro:
        us = per_collective_us(batches=a.micro_batches)
        print("one world-of-one all_reduce (best of 30 x 2000), by TORCH_FR_BUFFER_SIZE: "
              + ", ".join(f"{k}: {v:.2f} us" for k, v in us.items())
              + f"; the recorder adds {us['128'] - us['0']:.2f} us per collective (128), "
              f"{us['2000'] - us['0']:.2f} us (2000)")
        return
    names = [n for n in VARIANTS if n.split(" ")[0] in a.variants.split(",") or n in a.variants.split(",")]
    times: dict[str, list[float]] = {name: [] for name in names}
    micro: dict[str, dict] = {}
    for _ in range(a.rounds):
        if a.concurrent:
            procs = {name: start_variant(name, a) for name in names}
            runs = {name: result(name, proc) for name, proc in procs.items()}
        else:
            runs = {name: result(name, start_variant(name, a)) for name in names}
        for name, r in runs.items():
            times[name] += r["times"]
            micro[name] = r
    base = statistics.median(times[names[0]])
    how = "at the same time" if a.concurrent else "one after another"
    print(f"model {a.model}, 2 ranks (gloo) per job, jobs {how}, {a.rounds} rounds x {a.steps} steps per variant")
    print(f"{'variant':<32} {'median step ms':>15} {'vs off ms':>10} {'vs off %':>9}  ring read / snapshot")
    for name, ts in times.items():
        med = statistics.median(ts)
        m = micro[name]
        print(f"{name:<32} {med * 1e3:>15.3f} {(med - base) * 1e3:>+10.3f} {(med / base - 1) * 100:>+8.2f}%  "
              f"{m['read_ms']:.3f} / {m['snapshot_ms']:.3f} ms ({m['entries']} entries)")


if __name__ == "__main__":
    main()
