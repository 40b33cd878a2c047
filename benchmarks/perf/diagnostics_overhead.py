"""Per-step cost of each diagnostic, measured on the real step under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        benchmarks/perf/diagnostics_overhead.py [--model toy|llama]

Every variant gets its own Trainer on the same process group and runs `dptrain run`'s whole step
(`end_step(train_step())`: logging, the preemption agreement, ...); variants take turns in rounds
of `--steps` steps (default 1: round-robin, so slow drift of the machine affects all alike) and
rank 0 prints the median step time of each and its difference from `off` (every diagnostic
disabled) and from a second `off` (the noise). The drift check and the memory sample run every
step here, so their rows are the cost of one check; the straggler probe runs every step (it
normally runs on 10 steps of every `straggler_every_steps`). Then the pieces too small to see in
a step time: one watchdog heartbeat, one watchdog tick (store calls, once a second), and the
drift checksum's throughput.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from dptrain.tools.bench.harness import run_step

OFF = [
    "diagnostics.hang_timeout_s=0",
    "diagnostics.straggler_every_steps=0",
    "diagnostics.drift_every_steps=0",
    "diagnostics.rss_every_steps=0",
    "diagnostics.nonfinite=off",
    "diagnostics.preflight=false",
]
VARIANTS = {
    "off": [],
    "watchdog": ["diagnostics.hang_timeout_s=300"],
    "nonfinite=skip": ["diagnostics.nonfinite=skip"],
    "straggler (probe every step)": ["diagnostics.straggler_every_steps=10"],
    "drift check (1 per step)": ["diagnostics.drift_every_steps=1"],
    "memory sample (1 per step)": ["diagnostics.rss_every_steps=1"],
    "off (again: the noise)": [],
}
MODELS = {
    "toy": [
        "model.factory=dptrain.models.toy:build_mlp",
        "model.kwargs={}",
        "data.factory=dptrain.models.toy:build_regression_data",
        "data.kwargs={n: 100000}",
    ],
    "llama": [],  # the default recipe: 0.9 M-parameter LM on the stdlib corpus
}
MICRO = {"toy": 16, "llama": 8}


def build(variant: list[str], model: str, steps: int):
    from dptrain.config.load import load_config
    from dptrain.train.trainer import Trainer

    world = int(os.environ["WORLD_SIZE"])
    cfg = load_config(
        None,
        [
            *MODELS[model],
            f"train.micro_batch_size={MICRO[model]}",
            "train.grad_accum_steps=1",
            f"train.global_batch_size={MICRO[model] * world}",
            "log.progress=false",
            "optim.warmup_steps=0",
            f"train.max_steps={steps}",
            *OFF,
            *variant,
        ],
    )
    trainer = Trainer(cfg, out_dir=tempfile.mkdtemp(prefix="dptrain-diag-overhead-"))
    trainer.setup()  # outputs, model, data, diagnostics armed: as `dptrain run`
    return trainer


def micro_benchmarks(watchdog) -> dict[str, str]:
    """Costs too small to measure in a step time."""
    from dptrain.diagnostics.drift import param_checksums

    n = 100_000
    t0 = time.perf_counter()
    for i in range(n):
        watchdog.beat(10**6 + i, "forward")
    beat_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(100):
        watchdog.store.set(f"hb/{watchdog.rank}", "x" * 200)
        watchdog.store.add("hang", 0)
    tick_ms = (time.perf_counter() - t0) / 100 * 1e3
    big = torch.nn.Linear(4096, 4096)  # 64 MiB of fp32
    t0 = time.perf_counter()
    for _ in range(5):
        param_checksums(big)
    gbps = 5 * 4097 * 4096 * 4 / (time.perf_counter() - t0) / 1e9
    return {
        "watchdog heartbeat (per phase change)": f"{beat_us:.2f} us",
        "watchdog tick (store set + add, once per second)": f"{tick_ms:.3f} ms",
        "drift checksum throughput (CPU, 1 thread)": f"{gbps:.2f} GB/s of parameters",
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="toy")
    p.add_argument("--steps", type=int, default=1, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=60)
    a = p.parse_args()
    dist.init_process_group("gloo")
    trainers = {name: build(v, a.model, a.steps * a.rounds + 5) for name, v in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for tr in trainers.values():  # warm-up
        for _ in range(3):
            run_step(tr)  # one step of `dptrain run`: the optimizer step and the whole step boundary
    for _ in range(a.rounds):
        for name, tr in trainers.items():
            dist.barrier()
            for _ in range(a.steps):
                t0 = time.perf_counter()
                run_step(tr)
                times[name].append(time.perf_counter() - t0)
    watchdog = trainers["watchdog"].diag.watchdog
    micro_costs = micro_benchmarks(watchdog)
    for tr in trainers.values():
        tr.close()
    if dist.get_rank() == 0:
        base = statistics.median(times["off"])
        print(f"model {a.model}, world size {dist.get_world_size()}, {a.steps * a.rounds} steps per variant")
        print(f"{'variant':<28} {'median step ms':>15} {'vs off ms':>10} {'vs off %':>9}")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:<28} {med * 1e3:>15.3f} {(med - base) * 1e3:>+10.3f} {(med / base - 1) * 100:>+8.1f}%")
        for what, value in micro_costs.items():
            print(f"{what}: {value}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
