"""The pipeline bubble of gpipe and 1f1b, measured, against theory (p - 1) / (m + p - 1).

    python benchmarks/perf/pipeline_bubble.py [--pp 2] [--steps 8] [--rows 2] [--dim 128] [--layers 4] [--seq 128]

Starts itself under torchrun with `--pp` ranks (parallel.pp = world size, no data parallelism). For
each schedule and m in {2, 4, 8} pipeline micro-batches it builds dptrain's Trainer (the built-in
LLaMA and corpus; every pipeline micro-batch has `--rows` rows, so the work per piece is the same
for every m) and times `trainer.end_step(trainer.train_step())`, exactly what `dptrain run` does
per step.

Method: on every rank, the time inside the schedule (`schedule.step`) is split into busy time
(the stage's own forward and backward compute: `PipelineStage.forward_one_chunk` and
`backward_one_chunk`, timed by wrapping them) and the rest (waiting on the neighbouring stage's
send/recv: the bubble, plus the transfers themselves). Measured bubble = 1 - busy / schedule time
per step; the table shows its median over the timed steps (after `--warmup` untimed ones), averaged over
ranks (times likewise: medians, averaged over ranks). Theory assumes equal stages and
free communication: (p - 1) / (m + p - 1). On this CPU machine two ranks share two cores with
other work, so expect the trend (the bubble shrinks as m grows; gpipe and 1f1b have the same
bubble, 1f1b holding fewer activations) rather than the exact numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (shape inference, allocator)")
    p.add_argument("--rows", type=int, default=2, help="rows per pipeline micro-batch")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--microbatches", default="2,4,8")
    p.add_argument("--schedules", default="gpipe,1f1b")
    return p.parse_args(argv)


def _timed(fn: Callable[..., Any], box: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            box[0] += time.perf_counter() - t
    return wrapper


def measure(a: argparse.Namespace, *, schedule: str, m: int) -> tuple[float, float, float, float]:
    """(median step time, median schedule time, median busy time, median per-step bubble) of this
    rank, in seconds (the bubble as a fraction)."""
    import torch.distributed as dist

    from dptrain.config.load import load_config
    from dptrain.tools.bench.harness import run_step
    from dptrain.train.trainer import Trainer

    world = int(os.environ["WORLD_SIZE"])
    micro = m * a.rows
    cfg = load_config(
        None,
        [
            f"model.kwargs.dim={a.dim}",
            f"model.kwargs.n_layers={a.layers}",
            f"model.kwargs.max_seq_len={a.seq}",
            f"data.kwargs.seq_len={a.seq}",
            f"train.micro_batch_size={micro}",
            "train.grad_accum_steps=1",
            f"train.global_batch_size={micro}",
            "optim.name=sgd",
            "optim.warmup_steps=0",
            "optim.schedule=constant",
            "log.progress=false",
            f"train.max_steps={a.steps + a.warmup}",
            "train.eval_every_steps=0",
            "parallel.strategy=ddp",
            f"parallel.pp={world}",
            f"parallel.pp_schedule={schedule}",
            f"parallel.pp_microbatches={m}",
        ],
    )
    trainer = Trainer(cfg, out_dir=tempfile.mkdtemp(prefix="dptrain-bubble-"))
    trainer.setup()
    pmodel: Any = trainer.parallel
    busy, inside = [0.0], [0.0]
    for stage in pmodel.stages:
        stage.forward_one_chunk = _timed(stage.forward_one_chunk, busy)
        stage.backward_one_chunk = _timed(stage.backward_one_chunk, busy)
    pmodel.schedule.step = _timed(pmodel.schedule.step, inside)
    steps, busies, insides = [], [], []
    for i in range(a.steps + a.warmup):
        busy[0] = inside[0] = 0.0
        dist.barrier()
        t = time.perf_counter()
        run_step(trainer)  # end_step(train_step()), as `dptrain run`
        if i >= a.warmup:  # the first steps are warm-up (shape inference, buffers, allocator)
            steps.append(time.perf_counter() - t)
            busies.append(busy[0])
            insides.append(inside[0])
    trainer.close()
    trainer.model = trainer.parallel.release()
    trainer.mesh.release()
    bubbles = [1 - b / i for b, i in zip(busies, insides, strict=True)]
    return statistics.median(steps), statistics.median(insides), statistics.median(busies), statistics.median(bubbles)


def worker(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from dptrain.distributed.env import DistEnv
    from dptrain.distributed.process_group import process_group

    env = DistEnv.from_env()
    rows = []
    with process_group(env, backend="gloo", device=torch.device("cpu"), timeout_s=300):
        p = dist.get_world_size()
        for schedule in a.schedules.split(","):
            for m in (int(x) for x in a.microbatches.split(",")):
                per_rank: list[Any] = [None] * p
                dist.all_gather_object(per_rank, measure(a, schedule=schedule, m=m))
                step, inside, busy, bubble = (statistics.mean(r[k] for r in per_rank) for k in range(4))
                rows.append((schedule, m, step, inside, busy, bubble, (p - 1) / (m + p - 1)))
        if env.rank == 0:
            print(
                f"pipeline bubble: pp={p}, {a.steps} timed steps ({a.warmup} warm-up), {a.rows} rows per pipeline "
                f"micro-batch, dim {a.dim}, layers {a.layers}, seq {a.seq}"
            )
            print("| schedule | m | step ms | schedule ms | busy ms | measured bubble | theory (p-1)/(m+p-1) |")
            print("|---|---|---|---|---|---|---|")
            for schedule, m, step, inside, busy, bubble, theory in rows:
                print(
                    f"| {schedule} | {m} | {step * 1e3:.1f} | {inside * 1e3:.1f} | {busy * 1e3:.1f} | "
                    f"{bubble:.3f} | {theory:.3f} |"
                )


def main(argv: list[str]) -> int:
    from dptrain.tools.bench.harness import under_torchrun

    a = _args(argv)
    return under_torchrun(lambda: worker(a), script=__file__, argv=argv, nproc=a.pp)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
