"""Convergence of each `parallel.grad_compression` against none on the built-in LM recipe.

    python benchmarks/perf/compression_convergence.py [--steps 100] [--jobs 5] [--out runs/compression]

Each variant is `dptrain run` with the recipe's defaults (LLaMA dim 128 x 4 layers, byte-level
stdlib corpus, AdamW, global batch 32) on 2 gloo ranks for `--steps` optimizer steps, only
`parallel.grad_compression` (and its own knobs) changed; PowerSGD starts after max(warmup, 10%)
of the steps, as torch's documentation suggests. The losses are deterministic (the same seed, data
order and reduction order), so the variants may run side by side (`--jobs`): load changes their
speed, never their numbers. A finished variant's run directory is reused (`dptrain run` on a
finished run exits at once), so an interrupted benchmark continues where it stopped. bf16 is not run:
its DDP hook needs NCCL.

Prints a Markdown table: final train loss (mean of the last logging window), final validation
loss, their relative difference to none, and the bytes each rank hands to collectives per step
(computed from the model's parameter shapes with the hooks' own formulas).
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dptrain.tools.bench.harness import dptrain_run

ROOT = Path(__file__).resolve().parents[2]
WARMUP = 20  # optim.warmup_steps of the recipe


def variants(steps: int) -> dict[str, tuple[str, int, list[str]]]:
    """name -> (compression, PowerSGD rank, overrides)."""
    start = max(WARMUP, steps // 10)

    def psgd(rank: int, begin: int) -> tuple[str, int, list[str]]:
        return (
            "powersgd",
            rank,
            [
                "parallel.grad_compression=powersgd",
                f"parallel.powersgd_rank={rank}",
                f"parallel.powersgd_start_step={begin}",
            ],
        )

    def ob(begin: int) -> tuple[str, int, list[str]]:
        return ("onebit", 1, ["parallel.grad_compression=onebit", f"parallel.onebit_start_step={begin}"])

    return {
        "none": ("none", 1, []),
        "fp16": ("fp16", 1, ["parallel.grad_compression=fp16"]),
        f"powersgd rank 1, from step {start}": psgd(1, start),
        f"powersgd rank 4, from step {start}": psgd(4, start),
        f"powersgd rank 8, from step {start}": psgd(8, start),
        f"powersgd rank 16, from step {start}": psgd(16, start),
        f"powersgd rank 4, from step {steps // 2}": psgd(4, steps // 2),
        f"powersgd rank 8, from step {steps // 2}": psgd(8, steps // 2),
        "onebit from step 0": ob(0),
        f"onebit from step {start}": ob(start),
        f"onebit from step {steps // 2}": ob(steps // 2),
    }


def bytes_per_step(name: str, rank: int) -> int:
    """Bytes one rank hands to collectives per step for the recipe's model (one DDP bucket: the
    model is 3.5 MB, under the 25 MiB cap), by the hooks' own formulas."""
    import torch

    from dptrain.models.llama import build_llama
    from dptrain.parallel import onebit
    from dptrain.parallel.comm_hooks import _compressed_pieces

    with torch.device("meta"):
        model = build_llama(dim=128, n_layers=4, n_heads=4, max_seq_len=128)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    if name == "none":
        return numel * 4
    if name == "fp16":
        return numel * 2
    if name == "onebit":
        return onebit.payload_bytes(numel, len(params), 4)
    p, q, uncompressed = _compressed_pieces(
        [str(i) for i in range(len(params))], [x.shape for x in params], rank=rank, min_rate=2
    )
    return (uncompressed + sum(n for _, n in p) + sum(n for _, n in q)) * 4


def run(name: str, overrides: list[str], *, steps: int, out: Path) -> dict:
    run_dir = out / name.replace(" ", "-").replace(",", "")
    items = [f"train.max_steps={steps}", "log.progress=false", "checkpoint.every_steps=0", *overrides]
    return dptrain_run(items, nproc=2, out=run_dir).summary()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=9, help="variants run side by side (the losses do not depend on it)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "compression-convergence")
    args = ap.parse_args()
    todo = variants(args.steps)
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            name: pool.submit(run, name, over, steps=args.steps, out=args.out) for name, (_, _, over) in todo.items()
        }
        results = {name: f.result() for name, f in futures.items()}
    base = results["none"]
    print(f"\n{args.steps} steps of the built-in LM recipe, 2 gloo ranks (torch {base['torch_version']})\n")
    print(
        "| compression | final train loss | vs none | final val loss | vs none "
        "| bytes/rank/step once compressing | vs none |"
    )
    print("|---|---|---|---|---|---|---|")
    full = bytes_per_step("none", 1)
    for name, s in results.items():
        kind, rank, _ = todo[name]
        b = bytes_per_step(kind, rank)
        tr = (s["final_loss"] - base["final_loss"]) / base["final_loss"]
        va = (s["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"]
        print(
            f"| {name} | {s['final_loss']:.4f} | {tr:+.2%} | {s['final_val_loss']:.4f} | {va:+.2%} | "
            f"{b:,} | {b / full:.3f} |"
        )
    (args.out / "table.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
