"""The two bf16 training paths under FSDP2 against fp32, on the built-in LM recipe.

    python benchmarks/perf/bf16_path.py [--steps 100] [--jobs 1] [--out runs/bf16-path]

Each variant is `dptrain run` with the recipe's defaults (LLaMA dim 128 x 4 layers, byte-level
stdlib corpus, AdamW, global batch 32) on 2 gloo ranks under `parallel.strategy=fsdp` for `--steps`
optimizer steps, logging every step:

- fp32: `precision.dtype=fp32`, the reference;
- bf16 autocast: `precision.dtype=bf16 parallel.fsdp_param_dtype=fp32`: fp32 parameters gathered
  in fp32, cast by autocast per op;
- bf16 params: `precision.dtype=bf16 parallel.fsdp_param_dtype=bf16 parallel.fsdp_reduce_dtype=fp32`:
  FSDP2 gathers bf16 copies of the fp32 shards, reduce-scatters fp32 gradients, the optimizer
  steps the fp32 shards (torchtitan's MixedPrecisionPolicy).

The losses are deterministic (same seed, data order and reduction order), so `--jobs` > 1 changes
only the step times; keep `--jobs 1` when the step times matter. A finished variant's run directory
is reused (`dptrain run` on a finished run exits at once).

Prints a Markdown table: final train loss (mean of the last 10 steps), final validation loss, the
largest per-step relative difference of the train loss to fp32 and to the autocast path, and the
median step time (steps 6 onwards).
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dptrain.tools.bench.harness import dptrain_run

ROOT = Path(__file__).resolve().parents[2]

VARIANTS: dict[str, list[str]] = {
    "fp32": ["precision.dtype=fp32"],
    "bf16 autocast (fp32 params)": ["precision.dtype=bf16", "parallel.fsdp_param_dtype=fp32"],
    "bf16 params, fp32 reduce": [
        "precision.dtype=bf16", "parallel.fsdp_param_dtype=bf16", "parallel.fsdp_reduce_dtype=fp32",
    ],
}


def run(name: str, overrides: list[str], *, steps: int, seed: int, out: Path) -> list[dict]:
    run_dir = out / name.split(" (")[0].replace(" ", "-").replace(",", "")
    items = [f"train.max_steps={steps}", f"train.seed={seed}", "train.log_every_steps=1", "log.progress=false",
             "checkpoint.every_steps=0", "parallel.strategy=fsdp", *overrides]
    return dptrain_run(items, nproc=2, out=run_dir).records()


def curve(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def max_rel(a: dict[int, float], b: dict[int, float]) -> float:
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=1, help="variants run side by side (the losses do not depend on it)")
    ap.add_argument("--seed", type=int, default=1234, help="train.seed (the recipe's: 1234)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bf16-path")
    args = ap.parse_args()
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {n: pool.submit(run, n, over, steps=args.steps, seed=args.seed, out=args.out)
                   for n, over in VARIANTS.items()}
        results = {n: f.result() for n, f in futures.items()}
    curves = {n: curve(r) for n, r in results.items()}
    ref, auto = curves["fp32"], curves["bf16 autocast (fp32 params)"]
    print(f"\n{args.steps} steps of the built-in LM recipe, parallel.strategy=fsdp, 2 gloo ranks, seed {args.seed}\n")
    print("| path | final train loss (last 10) | final val loss | max rel. diff/step vs fp32 "
          "| max rel. diff/step vs autocast | median step time (s) |")
    print("|---|---|---|---|---|---|")
    for name, recs in results.items():
        c = curves[name]
        last = [c[s] for s in sorted(c)[-10:]]
        val = [r["val_loss"] for r in recs if "val_loss" in r][-1]
        times = [r["step_time_s"] for r in recs if "step_time_s" in r and r["step"] > 5]
        print(f"| {name} | {statistics.mean(last):.4f} | {val:.4f} | {max_rel(c, ref):.2%} | "
              f"{max_rel(c, auto):.2%} | {statistics.median(times):.3f} |")
    print("\nloss every 10 steps:\n")
    print("| step | " + " | ".join(curves) + " |")
    print("|---" * (len(curves) + 1) + "|")
    for s in sorted(ref):
        if s == 1 or s % 10 == 0:
            print(f"| {s} | " + " | ".join(f"{c[s]:.4f}" for c in curves.values()) + " |")
    (args.out / "curves.json").write_text(json.dumps(curves, indent=2))


if __name__ == "__main__":
    main()
