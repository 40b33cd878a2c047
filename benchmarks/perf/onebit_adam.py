"""1-bit Adam (`optim.name=onebit_adam`) against AdamW and today's `onebit` gradient compression.

    python benchmarks/perf/onebit_adam.py [--steps 100] [--freeze 10,20,50] [--jobs 2] [--out runs/onebit-adam]
    python benchmarks/perf/onebit_adam.py --two-host [--steps 60 --warmup 25 --freeze 20] [--rounds 1]

Convergence (default): `dptrain run` of the built-in LM recipe (its defaults: LLaMA dim 128 x 4
layers, byte-level stdlib corpus, AdamW betas (0.9, 0.95), lr 3e-3 with 20 warm-up steps and cosine
decay, global batch 32) on 2 gloo ranks for `--steps` optimizer steps, per variant: AdamW (no
compression), `parallel.grad_compression=onebit` (EF-SignSGD on AdamW's gradients) from step S, and
`optim.name=onebit_adam` with `optim.freeze_step=F`, for S and F in `--freeze`. The losses are
deterministic (same seed, data order and reduction order), so variants may run side by side
(`--jobs`). Prints a Markdown table: final train loss (mean of the last logging window), final
validation loss, both against AdamW, and the bytes each rank sent per step as the run's meters
measured them (metrics.jsonl `comm_bytes`: the DDP hook's collectives plus 1-bit Adam's momentum
exchange), once compressing, and the run's mean.

Two hosts (`--two-host`, root only): `benchmarks/perf/two_host.py`'s cluster (two network namespaces on a
veth pair limited by `tc tbf`, one worker per "host") at `--rates`, raw DDP against `onebit` and
`onebit_adam`, each compressing from `--freeze`'s first value; step times are the median after
`--warmup` steps (set it past the freeze so only compressed steps count).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import two_host as th  # the cluster, the runs and the table of benchmarks/perf/two_host.py (this script's folder)

from dptrain.tools.bench.harness import dptrain_run

ROOT = Path(__file__).resolve().parents[2]


def variants(freezes: list[int]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"adamw": []}
    for f in freezes:
        out[f"onebit from step {f}"] = ["parallel.grad_compression=onebit", f"parallel.onebit_start_step={f}"]
    for f in freezes:
        out[f"onebit_adam freeze_step {f}"] = ["optim.name=onebit_adam", f"optim.freeze_step={f}"]
    return out


def run(name: str, overrides: list[str], *, steps: int, out: Path) -> dict:
    """One 2-rank `dptrain run`; its summary and per-step records (a finished run directory is reused)."""
    items = [f"train.max_steps={steps}", "train.log_every_steps=1", "log.progress=false", "checkpoint.every_steps=0",
             *overrides]
    r = dptrain_run(items, nproc=2, out=out / name.replace(" ", "-"))
    return {"summary": r.summary(), "steps": r.steps()}


def convergence(args: argparse.Namespace) -> None:
    todo = variants(args.freeze)
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {name: pool.submit(run, name, over, steps=args.steps, out=args.out) for name, over in todo.items()}
        results = {name: f.result() for name, f in futures.items()}
    base = results["adamw"]["summary"]
    print(f"\n{args.steps} steps of the built-in LM recipe, 2 gloo ranks (torch {base['torch_version']})\n")
    print("| variant | final train loss | vs AdamW | final val loss | vs AdamW | bytes/rank/step compressing "
          "| vs AdamW | bytes/rank/step, run mean |")
    print("|---|---|---|---|---|---|---|---|")
    full = results["adamw"]["steps"][-1]["comm_bytes"]
    for name, res in results.items():
        s = res["summary"]
        last = res["steps"][-1]["comm_bytes"]
        tr = (s["final_loss"] - base["final_loss"]) / base["final_loss"]
        va = (s["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"]
        print(f"| {name} | {s['final_loss']:.4f} | {tr:+.2%} | {s['final_val_loss']:.4f} | {va:+.2%} "
              f"| {last:,.0f} | {last / full:.3f} | {s['comm_bytes']:,.0f} |")
    (args.out / "table.json").write_text(json.dumps({k: v["summary"] for k, v in results.items()}, indent=2))


def two_host(args: argparse.Namespace) -> int:
    reason = th.unavailable_reason()
    if reason:
        print(f"onebit_adam: cannot build the two-host cluster: {reason}", file=sys.stderr)
        return 2
    f = args.freeze[0]
    chosen = [
        ("raw-ddp", ["parallel.strategy=ddp"]),
        (f"onebit from step {f}", ["parallel.strategy=ddp", "parallel.grad_compression=onebit",
                                   f"parallel.onebit_start_step={f}"]),
        (f"onebit_adam freeze_step {f}", ["parallel.strategy=ddp", "optim.name=onebit_adam",
                                         f"optim.freeze_step={f}"]),
    ]
    ns = argparse.Namespace(steps=args.steps, warmup=args.warmup, rounds=args.rounds, global_batch=16, seq_len=128,
                            seed=0, timeout=args.timeout, rates=args.rates.split(","))
    results = th.measure(ns, chosen)
    print(th.table(results, rates=ns.rates, variants=[n for n, _ in chosen], skipped={}, steps=args.steps))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--freeze", default="10,20,50", help="comma-separated freeze steps (and onebit start steps)")
    ap.add_argument("--jobs", type=int, default=2, help="variants run side by side (the losses do not depend on it)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "onebit-adam")
    ap.add_argument("--two-host", action="store_true", help="throughput over the rate-limited two-host link")
    ap.add_argument("--rates", default="100mbit", help="--two-host: comma-separated tc rates")
    ap.add_argument("--warmup", type=int, default=25, help="--two-host: steps left out of the step-time median")
    ap.add_argument("--rounds", type=int, default=1, help="--two-host: interleaved rounds")
    ap.add_argument("--timeout", type=float, default=600, help="--two-host: seconds per run")
    args = ap.parse_args()
    args.freeze = [int(x) for x in args.freeze.split(",")]
    if args.two_host:
        return two_host(args)
    convergence(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
