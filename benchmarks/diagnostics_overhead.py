"""Per-step cost of each diagnostic, measured on the real step under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/diagnostics_overhead.py [--model toy|llama]

Every variant gets its own Trainer on the same process group; variants take turns in rounds
of `--steps` steps (so slow drift of the machine affects all alike) and rank 0 prints the
median step time of each and its difference from `off` (every diagnostic disabled). The drift
check and the memory sample run every step here, so their rows are the cost of one check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

OFF = ["diagnostics.hang_timeout_s=0", "diagnostics.straggler_every_steps=0", "diagnostics.drift_every_steps=0",
       "diagnostics.memory_every_steps=0", "diagnostics.nonfinite=off", "diagnostics.preflight=false"]
VARIANTS = {
    "off": [],
    "watchdog": ["diagnostics.hang_timeout_s=300"],
    "nonfinite=skip": ["diagnostics.nonfinite=skip"],
    "straggler probe": ["diagnostics.straggler_every_steps=50"],
    "drift check (1 per step)": ["diagnostics.drift_every_steps=1"],
    "memory sample (1 per step)": ["diagnostics.memory_every_steps=1"],
    "off (again: the noise)": [],
}
MODELS = {
    "toy": ["model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
            "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={n: 100000}"],
    "llama": [],  # the default recipe: 0.9 M-parameter LM on the stdlib corpus
}
MICRO = {"toy": 16, "llama": 8}


def build(variant: list[str], model: str, steps: int):
    from dptrain.overrides import load_config
    from dptrain.trainer import Trainer

    world = int(os.environ["WORLD_SIZE"])
    cfg = load_config(None, [*MODELS[model], f"train.micro_batch_size={MICRO[model]}", "train.grad_accum_steps=1",
                             f"train.global_batch_size={MICRO[model] * world}", "log.progress=false",
                             "optim.warmup_steps=0", f"train.max_steps={steps}", *OFF, *variant])
    trainer = Trainer(cfg, out_dir="/tmp/dptrain-diag-overhead")
    trainer.device = torch.device("cpu")
    trainer._setup()
    trainer.diag.start(trainer.model, step=0, device=trainer.device)
    return trainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="toy")
    p.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    dist.init_process_group("gloo")
    trainers = {name: build(v, a.model, a.steps * a.rounds + 5) for name, v in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for tr in trainers.values():  # warm-up
        for _ in range(3):
            tr.train_step()
            tr.state.step += 1
            tr.diag.on_step_end(tr.state.step)
    for _ in range(a.rounds):
        for name, tr in trainers.items():
            dist.barrier()
            for _ in range(a.steps):
                t0 = time.perf_counter()
                tr.train_step()
                tr.state.step += 1
                tr.diag.on_step_end(tr.state.step)
                times[name].append(time.perf_counter() - t0)
    for tr in trainers.values():
        tr.diag.close()
    if dist.get_rank() == 0:
        base = statistics.median(times["off"])
        print(f"model {a.model}, world size {dist.get_world_size()}, {a.steps * a.rounds} steps per variant")
        print(f"{'variant':<28} {'median step ms':>15} {'vs off ms':>10} {'vs off %':>9}")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:<28} {med * 1e3:>15.3f} {(med - base) * 1e3:>+10.3f} {(med / base - 1) * 100:>+8.1f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
