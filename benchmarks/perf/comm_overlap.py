"""How much of DDP's gradient communication hides behind backward, by bucket size,
gradient_as_bucket_view and static_graph.

    python benchmarks/perf/comm_overlap.py [--nproc 2] [--buckets 1,5,25,50,100] [--rounds 6] [--dim 512]

Starts itself under torchrun (gloo on CPU). Every rank builds the same LLaMA-style model once and
one DDP replica of it per variant (dptrain's `apply_ddp` with the configured flags, metered by
dptrain's `CommMeter` around torch's default all-reduce hook: what `dptrain run` installs). Each
round runs one step (forward, backward, SGD step) of every variant, the order rotating from round to
round so all variants see the same machine noise; the first round is warm-up (DDP rebuilds its
buckets after the first step; static_graph learns the graph there). Prints, per variant, the
median step time, comm_s (union of the buckets' in-flight intervals) and exposed_comm_s (last
bucket launched -> backward returns), with the spread (min-max over rounds), as a Markdown table.
`--json PATH` also writes the raw numbers.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import statistics
import sys
import time

import torch


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--buckets", default="1,5,25,50,100", help="bucket_cap_mb values, comma-separated")
    p.add_argument("--rounds", type=int, default=6, help="steps per variant (the first is warm-up)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--static", default="off,on", help="static_graph values to try (off,on)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _variants(a: argparse.Namespace) -> list[tuple[float, bool, bool]]:
    buckets = [float(b) for b in a.buckets.split(",")]
    static = [s == "on" for s in a.static.split(",")]
    return list(itertools.product(buckets, (True, False), static))


def worker(a: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from dptrain.metrics.comm import CommMeter, bucket_payload
    from dptrain.models.llama import build_llama
    from dptrain.parallel.ddp import apply_ddp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    base = build_llama(dim=a.dim, n_layers=a.layers, n_heads=8, max_seq_len=a.seq)
    n_params = sum(p.numel() for p in base.parameters())
    runs = []
    for bucket, view, static in _variants(a):
        meter = CommMeter(group_size=world, device=cpu)
        model = apply_ddp(copy.deepcopy(base), device=cpu, bucket_cap_mb=bucket, gradient_as_bucket_view=view,
                          static_graph=static)
        model.register_comm_hook(*meter.wrap(None, default_hooks.allreduce_hook, bucket_payload))
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        runs.append({"bucket_cap_mb": bucket, "gradient_as_bucket_view": view, "static_graph": static,
                     "model": model, "opt": opt, "meter": meter, "step_s": [], "comm_s": [], "exposed_comm_s": []})
    gen = torch.Generator().manual_seed(rank)
    for rnd in range(a.rounds):
        ids = torch.randint(0, 256, (a.micro, a.seq), generator=gen)
        shift = rnd % len(runs)
        for run in runs[shift:] + runs[:shift]:
            dist.barrier()
            t = time.perf_counter()
            run["model"](ids, labels=ids).backward()
            run["opt"].step()
            run["opt"].zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - t
            run["meter"].step_done()
            w = run["meter"].window()
            if rnd:  # round 0: warm-up
                run["step_s"].append(elapsed)
                run["comm_s"].append(w["comm_s"])
                run["exposed_comm_s"].append(w["exposed_comm_s"])
    if rank == 0:
        _report(a, runs, n_params=n_params, world=world)
    # Free the DDP reducers (and the hooks' futures) while the process group still exists: a reducer
    # freed after destroy_process_group can deadlock gloo's teardown (the trainer does the same).
    for run in runs:
        run.clear()
    runs.clear()
    gc.collect()
    dist.destroy_process_group()


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.0f} ({min(values) * 1e3:.0f}-{max(values) * 1e3:.0f})"


def _report(a: argparse.Namespace, runs: list[dict], *, n_params: int, world: int) -> None:
    print(f"world {world} (gloo, CPU), LLaMA dim {a.dim} x {a.layers} layers = {n_params / 1e6:.1f} M parameters "
          f"({n_params * 4 / 2**20:.0f} MiB of fp32 gradients), micro batch {a.micro} x seq {a.seq}, "
          f"{a.rounds - 1} measured rounds (+1 warm-up), variants interleaved; ms, median (min-max)")
    print("| bucket_cap_mb | gradient_as_bucket_view | static_graph | step | comm_s | exposed_comm_s | hidden |")
    print("|---:|:---:|:---:|---:|---:|---:|---:|")
    for r in runs:
        comm, exposed = statistics.median(r["comm_s"]), statistics.median(r["exposed_comm_s"])
        hidden = max(0.0, 1 - exposed / comm) if comm > 0 else 0.0
        print(f"| {r['bucket_cap_mb']:g} | {'on' if r['gradient_as_bucket_view'] else 'off'} | "
              f"{'on' if r['static_graph'] else 'off'} | {_cell(r['step_s'])} | {_cell(r['comm_s'])} | "
              f"{_cell(r['exposed_comm_s'])} | {hidden:.0%} |")
    if a.json:
        keys = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "step_s", "comm_s", "exposed_comm_s")
        with open(a.json, "w") as f:
            json.dump([{k: r[k] for k in keys} for r in runs], f, indent=1)


def main(argv: list[str]) -> int:
    from dptrain.tools.bench.harness import under_torchrun

    a = _args(argv)
    return under_torchrun(lambda: worker(a), script=__file__, argv=argv, nproc=a.nproc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
