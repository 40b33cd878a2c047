"""The two LLaMA-7B points of `dptrain plan` (issue 13), printed: pure arithmetic, no GPU.

    python benchmarks/planner/plan_llama7b.py [--model llama2-7b] [--global-batch 1024] [--efficiency E]

1. The guides' LLaMA-7B layout DP8 x PP4 x TP2, ZeRO-3 (fsdp) + CPU offload on 64 H100 SXM (8 nodes
   x 8, InfiniBand): whether dptrain accepts it, memory per GPU and predicted throughput for every
   micro-batch / pipeline split / checkpointing the search tries for that layout (best first), and
   where it ranks among all layouts.
2. The recommendation for the same model, GPUs and global batch: `dptrain plan --recommend --top 5`.

Global batch default: 1024 sequences x 4096 tokens = 4M tokens, the Llama 2 paper's batch (sec. 2.2).
"""

from __future__ import annotations

import argparse

from dptrain.cli.main import main
from dptrain.metrics.hardware import gpu_spec
from dptrain.tools.plan.memory import GB
from dptrain.tools.plan.recommend import distinct, load_plan_config
from dptrain.tools.plan.search import rejected_groups, search


def example(model_name: str, global_batch: int, efficiency: float | None) -> None:
    from dptrain.models.llama import LlamaConfig

    cfg = load_plan_config(["precision.dtype=bf16"], model=model_name)
    model = LlamaConfig(**cfg.model.kwargs)
    seq = int(cfg.data.kwargs["seq_len"])
    spec = gpu_spec("H100")
    result = search(cfg, model, spec, gpus=64, nodes=8, interconnect="ib", global_batch=global_batch, seq=seq,
                    efficiency=efficiency)

    def chosen(c) -> bool:  # noqa: ANN001
        return (c.strategy, c.cpu_offload, c.tp, c.pp, c.dp) == ("fsdp", True, 2, 4, 8)

    mine = [(i, r, label) for i, (r, label) in enumerate(distinct(result.ranked), 1) if chosen(r.cand)]
    refused = [r for r in result.rejected if chosen(r.cand)]
    print(
        f"{model_name} DP8 x PP4 x TP2 fsdp + cpu_offload on 64 x {spec.name} (8 x 8, ib), global batch "
        f"{global_batch} x {seq}, bf16 AdamW, efficiency "
        f"{'modelled per layout' if efficiency is None else f'{efficiency:g} (assumed)'}: {len(mine)} variants "
        "accepted "
        f"and fit, {len(refused)} rejected; of all {len(distinct(result.ranked))} distinct layouts that fit, "
        "its best ranks "
        f"#{mine[0][0] if mine else '-'}"
    )
    print(f"{'rank':>5}  {'layout':<58}{'GB/GPU':>8}{'host GB':>9}{'step s':>8}{'tok/s/GPU':>11}{'MFU':>7}")
    for i, r, label in mine[:6]:
        tok = r.time["tokens_per_s"] * r.time["step"] / r.step_s / 64
        print(
            f"{i:>5}  {label:<58}{r.memory['total'] / GB:>8.1f}{r.memory['host'] / GB:>9.2f}"
            f"{r.step_s:>8.2f}{tok:>11,.0f}{r.mfu:>7.1%}"
        )
    for reason, items in rejected_groups(refused):
        print(f"  {len(items)} rejected: {reason} (e.g. {items[0].cand.label()}: {items[0].reason})")


def run() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--efficiency", type=float, default=None,
                    help="default: modelled per layout (plan/efficiency.py)")
    args = ap.parse_args()
    example(args.model, args.global_batch, args.efficiency)
    print()
    main(
        [
            "plan",
            "--model",
            args.model,
            "precision.dtype=bf16",
            "--gpus",
            "64",
            "--nodes",
            "8",
            "--gpu-type",
            "H100",
            "--interconnect",
            "ib",
            "--global-batch",
            str(args.global_batch),
            *(["--efficiency", str(args.efficiency)] if args.efficiency is not None else []),
            "--recommend",
            "--top",
            "5",
        ]
    )


if __name__ == "__main__":
    run()
