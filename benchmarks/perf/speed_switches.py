"""Measure the speed switches on this machine: train.compile, the DataLoader's workers and
prefetching, FSDP2's explicit prefetch and reshard_after_forward, and the chunked loss (train.loss_chunk_tokens;
`loss`: the built-in LLaMA's byte vocabulary of 256, one chunk per micro-batch; `loss32k`: the same model with a
vocabulary of 32,000, where the head outweighs the blocks and the chunks are 256 tokens).

    python benchmarks/perf/speed_switches.py [--suite compile|loader|fsdp|loss|loss32k|all] [--rounds 3] [--steps 25]

Each variant is one 2-rank job (ranks forked from this process by tests/support/mp.py's harness, a real
gloo group with torchrun's environment; forking skips the re-import of torch that makes a torchrun
job cost a minute on this loaded machine) that builds the Trainer exactly as `dptrain run` does and
times `end_step(train_step())` per step (a barrier before each, so a step's time is the slowest
rank's). Jobs are interleaved: round 1 runs every variant once, then round 2, ..., so slow
phases of a loaded machine hit every variant. Reported per variant: the median over rounds of
each job's median step time after `--warmup` steps (so compilation is not in it), the spread
(min-max of the job medians), the first step's time (where compilation lands; inductor's cache
is cold only in the first round), and the peak RSS of the busiest rank (ru_maxrss).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from dptrain.tools.bench.harness import alternate

MODEL = ["model.kwargs.dim=128", "model.kwargs.n_layers=4", "model.kwargs.n_heads=4", "model.kwargs.max_seq_len=128",
         "data.kwargs.seq_len=128", "train.micro_batch_size=4", "train.grad_accum_steps=1",
         "train.global_batch_size=8", "optim.warmup_steps=0", "log.progress=false", "train.log_every_steps=10",
         "train.eval_every_steps=0", "parallel.device=cpu", "diagnostics.straggler_every_steps=0",
         "diagnostics.drift_every_steps=0", "diagnostics.rss_every_steps=0"]

SUITES: dict[str, dict[str, list[str]]] = {
    "compile": {
        "ddp eager": ["parallel.strategy=ddp"],
        "ddp compile (inductor)": ["parallel.strategy=ddp", "train.compile=true"],
    },
    "loader": {
        "num_workers=0": ["parallel.strategy=ddp", "data.num_workers=0"],
        "num_workers=2, prefetch 2": ["parallel.strategy=ddp", "data.num_workers=2"],
        "num_workers=2, prefetch 4": ["parallel.strategy=ddp", "data.num_workers=2", "data.prefetch_factor=4"],
    },
    "fsdp": {
        "implicit prefetch (default)": ["parallel.strategy=fsdp"],
        "forward 1 / backward 1": ["parallel.strategy=fsdp", "parallel.fsdp_forward_prefetch=1",
                                   "parallel.fsdp_backward_prefetch=1"],
        "forward 2 / backward 2": ["parallel.strategy=fsdp", "parallel.fsdp_forward_prefetch=2",
                                   "parallel.fsdp_backward_prefetch=2"],
        "reshard_after_forward=false": ["parallel.strategy=fsdp", "parallel.reshard_after_forward=false"],
    },
    "loss": {
        "whole logits (loss_chunk_tokens=0)": ["parallel.strategy=fsdp", "train.loss_chunk_tokens=0"],
        "chunked (default: one chunk)": ["parallel.strategy=fsdp"],
        "chunked, 128 tokens (4 chunks)": ["parallel.strategy=fsdp", "train.loss_chunk_tokens=128"],
    },
    "loss32k": {
        "whole logits (loss_chunk_tokens=0)": ["parallel.strategy=fsdp", "model.kwargs.vocab_size=32000",
                                               "train.loss_chunk_tokens=0"],
        "chunked (default: 256 tokens)": ["parallel.strategy=fsdp", "model.kwargs.vocab_size=32000"],
    },
}


def job(rank: int, items: list[str], steps: int) -> dict:
    """One rank of one variant: the Trainer's own step, timed; the peak RSS of the busiest rank."""
    import torch
    import torch.distributed as dist

    from dptrain.config.load import load_config
    from dptrain.distributed.process_group import process_group
    from dptrain.train.trainer import Trainer

    cfg = load_config(None, [*MODEL, f"train.max_steps={steps}", *items])
    trainer = Trainer(cfg, out_dir=tempfile.mkdtemp(prefix="dptrain-speed-"))
    with process_group(trainer.env, backend=trainer.res.backend, device=trainer.device, timeout_s=600):
        trainer.setup()
        times = []
        for _ in range(steps):
            dist.barrier()
            t = time.perf_counter()
            trainer.end_step(trainer.train_step())
            dist.barrier()
            times.append(time.perf_counter() - t)
        trainer.close()
        peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])  # KiB -> MiB
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        trainer.model = trainer.parallel.release()
        trainer.mesh.release()
    return {"times": times, "peak_rss_mb": float(peak)}


def run_job(items: list[str], steps: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from support.mp import run_ranks

    return run_ranks(job, 2, items, steps, timeout=900)[0]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--suite", default="all", help=f"all, or comma-separated: {', '.join(SUITES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the ranks share the cores (the harness sets 1 thread per rank too)
    suites = list(SUITES) if a.suite == "all" else a.suite.split(",")
    for suite in suites:
        variants = SUITES[suite]
        results = alternate({name: partial(run_job, items, a.steps) for name, items in variants.items()}, a.rounds)
        print(f"\n{suite}: 2 ranks (gloo, CPU), {a.rounds} interleaved rounds x {a.steps} steps, "
              f"first {a.warmup} steps of each job excluded; 1 thread per rank")
        print("| variant | median step (ms) | spread over rounds (ms) | first step (ms, per round) | peak RSS (MiB) |")
        print("|---|---|---|---|---|")
        base = None
        for name, jobs in results.items():
            meds = [statistics.median(j["times"][a.warmup:]) * 1e3 for j in jobs]
            med = statistics.median(meds)
            base = base or med
            firsts = ", ".join(f"{j['times'][0] * 1e3:.0f}" for j in jobs)
            rss = statistics.median(j["peak_rss_mb"] for j in jobs)
            print(
                f"| {name} | {med:.1f} ({med / base:.2f}x) | {min(meds):.1f}-{max(meds):.1f} | {firsts} | {rss:.0f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
