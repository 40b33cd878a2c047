"""Context parallelism (`parallel.cp`) measured on gloo ranks against `dptrain plan` (issue 35).

    python benchmarks/memory/cp_memory.py [--seqs 4096 8192 16384] [--cps 1 2 4] [--budget-mb 160] [--time-seq 4096]
                                          [--steps 6] [--skip memory longest time] [--attention allgather]

The built-in LLaMA (dim 128, 2 layers, 4 heads, 2 KV heads, byte vocabulary; fp32, batch 1), one row split over cp
ranks, each rank a forked process with one thread in a real gloo group (tests/support/mp.py):

1. memory: each rank's activations (tests/support/cp_memory.py: the storages the forward leaves alive for backward,
   through `dptrain run`'s own parallelisation: ddp over dp x cp, gathered-K/V attention, on the CPU blockwise with
   no mask, parallel/cp_attention.py) against the planner's `activations` for the same config on the CPU
   (`tools.plan.predict.predict`, `--gpu-type cpu`), at every seq x cp;
2. longest: the longest row (a multiple of 512) whose planned memory per rank (model states, activations,
   temporaries; no CUDA allowance) fits `--budget-mb`, on 1 rank and on 4 cp ranks, then measured: the activations at
   those lengths, and one SGD step at each (it trains);
3. time: the median step time of `dptrain run`'s own loop (Trainer.fit, `step_time_s` of metrics.jsonl, the first
   step dropped) for cp 1, 2 and 4 on the same row, side by side, with the planner's prediction for H100s (modelled
   efficiency; plan/timing.py: the K/V exchange is not overlapped) for this model and for Llama 3.1 8B at 131,072
   tokens.

Every run and plan takes `--attention` as `parallel.cp_attention` (default allgather, the figures of
docs/guides/long-sequences.md's tables; ulysses needs the 2 KV heads divisible by cp, so cp <= 2 with this model).

The machine has 2 cores: cp 4 runs 4 one-thread ranks on them (oversubscribed 2x); cp 2 uses both; cp 1 one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from dptrain.config.load import load_config  # noqa: E402
from dptrain.tools.plan.predict import predict  # noqa: E402
from dptrain.tools.plan.presets import preset, preset_overrides  # noqa: E402
from dptrain.tools.plan.timing import Link  # noqa: E402
from dptrain.train.trainer import Trainer  # noqa: E402
from support.cp_memory import measure_activations, on_ranks, train_step  # noqa: E402
from support.mp import run_ranks  # noqa: E402

MODEL = {"vocab_size": 256, "dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
MB = 2**20
ATTENTION = "allgather"
"""parallel.cp_attention of every run and plan (`--attention`)."""


def items(seq: int, cp: int, *, model: dict | None = None) -> list[str]:
    kw = {**(model or MODEL), "max_seq_len": seq}
    return [*(f"model.kwargs.{k}={v}" for k, v in kw.items()), f"data.kwargs.seq_len={seq}", f"parallel.cp={cp}",
            "parallel.strategy=ddp", f"parallel.cp_attention={ATTENTION}", "train.micro_batch_size=1",
            "train.global_batch_size=1", "train.grad_accum_steps=1", "optim.name=sgd", "optim.momentum=0",
            "optim.weight_decay=0", "parallel.device=cpu", "log.progress=false", "train.eval_every_steps=0"]


CPU_LINK = Link(bandwidth=1e9, alpha=1e-5)
"""A nominal link for `--gpu-type cpu` plans (it enters only the time, which the memory tables do not use)."""


def planned(seq: int, cp: int, *, gpu: str = "cpu", efficiency: float | None = 0.5, model: dict | None = None):
    """The plan of one row of `seq` tokens on cp ranks; on the CPU by default (the blockwise attention path, the one
    measured here), on `gpu` for the time table's GPU figures (SDPA with the gathered-K/V mask there)."""
    return predict(load_config(None, items(seq, cp, model=model)), gpus=cp, nodes=1, gpu_type=gpu,
                   interconnect="nvlink", comm=CPU_LINK if gpu == "cpu" else None, efficiency=efficiency)


def measured(seq: int, cp: int) -> int:
    got = run_ranks(on_ranks, cp, measure_activations, {**MODEL, "max_seq_len": seq}, seq, cp, ATTENTION,
                    timeout=600)
    return max(got)


def memory_table(seqs: list[int], cps: list[int]) -> list[str]:
    out = ["activations per rank (MiB), measured on gloo ranks vs `dptrain plan`:", "",
           "| seq | cp | tokens/rank | measured | predicted | error | the SDPA path's mask (GPUs; not kept here) |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
    for seq in seqs:
        for cp in cps:
            got, want = measured(seq, cp), planned(seq, cp).memory["activations"]
            mask = 4 * (seq // cp) * seq if cp > 1 else 0
            out.append(f"| {seq:,} | {cp} | {seq // cp:,} | {got / MB:,.1f} | {want / MB:,.1f} | "
                       f"{got / want - 1:+.1%} | {mask / MB:,.1f} |")
            print(out[-1], flush=True)
    return out


def states_and_acts(seq: int, cp: int) -> float:
    """Planned bytes per rank without the CUDA allowance."""
    mem = planned(seq, cp).memory
    return mem["total"] - mem["overhead"]


def longest(cp: int, budget: float, *, step: int = 512, limit: int = 1 << 17) -> int:
    seq = 0
    while seq + step <= limit and states_and_acts(seq + step, cp) <= budget:
        seq += step
    return seq


def longest_table(budget_mb: float) -> list[str]:
    budget = budget_mb * MB
    out = [f"longest row at the same planned memory per rank ({budget_mb:g} MiB: states + activations + "
           "temporaries, no CUDA allowance):", "",
           "| ranks | longest seq (planned) | planned MiB/rank | measured activations MiB | planned activations MiB "
           "| one SGD step |", "|---:|---:|---:|---:|---:|---|"]
    for cp in (1, 4):
        seq = longest(cp, budget)
        got = measured(seq, cp)
        loss = run_ranks(on_ranks, cp, train_step, {**MODEL, "max_seq_len": seq}, seq, cp, ATTENTION, timeout=600)
        out.append(f"| {cp} | {seq:,} | {states_and_acts(seq, cp) / MB:,.1f} | {got / MB:,.1f} | "
                   f"{planned(seq, cp).memory['activations'] / MB:,.1f} | trains (loss {loss[0]:.3f}) |")
        print(out[-1], flush=True)
    return out


def _fit(rank: int, run_items: list[str], out_dir: str) -> dict:
    torch.set_num_threads(1)
    return Trainer(load_config(None, run_items), out_dir=out_dir).fit()


def step_times(seq: int, cp: int, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        run_items = items(seq, cp) + [f"train.max_steps={steps}", "train.log_every_steps=1"]
        run_ranks(_fit, cp, run_items, tmp, timeout=900)
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in records if "step_time_s" in r][1:]


def time_table(seq: int, cps: list[int], steps: int) -> list[str]:
    out = [f"step time, one row of {seq:,} tokens (`dptrain run`'s loop, median of {steps - 1} steps) and the "
           "planner's H100 prediction (modelled efficiency):", "",
           "| cp | CPU/gloo median s | vs cp 1 | H100 predicted s | of which K/V exchange (exposed) |",
           "|---:|---:|---:|---:|---:|"]
    base = None
    for cp in cps:
        med = statistics.median(step_times(seq, cp, steps))
        base = base or med
        t = planned(seq, cp, gpu="H100", efficiency=None).time
        out.append(f"| {cp} | {med:.3f} | {med / base:.2f}x | {t['step']:.3g} | {t['cp_comm']:.2g} |")
        print(out[-1], flush=True)
    return out + ["", *llama8b_lines()]


def llama8b_lines() -> list[str]:
    """Llama 3.1 8B, one row of 131,072 tokens per replica, fsdp over 8 H100s: the planner at cp 1, 2, 4, 8."""
    p = preset("llama3-8b")
    base = preset_overrides(p)
    model = {**base["model"]["kwargs"], "max_seq_len": 131072}
    out = ["Llama 3.1 8B, 131,072 tokens per row, fsdp (bf16 parameters) on 8 H100 80GB, full checkpointing "
           "(planner only):", "", "| cp | dp | GB/rank | fits | step s | K/V exchange s | MFU |",
           "|---:|---:|---:|---|---:|---:|---:|"]
    for cp in (1, 2, 4, 8):
        over = [*(i for i in items(131072, cp, model=model) if not i.startswith("parallel.strategy")),
                "parallel.strategy=fsdp", "precision.dtype=bf16", "parallel.fsdp_param_dtype=bf16",
                "parallel.activation_checkpointing=full", f"train.global_batch_size={8 // cp}", "optim.name=adamw"]
        pr = predict(load_config(None, over), gpus=8, nodes=1, gpu_type="H100", interconnect="nvlink", comm=None,
                     efficiency=None)
        fits = "yes" if pr.memory["total"] <= pr.spec.memory_gb * 1e9 else "no"
        out.append(f"| {cp} | {8 // cp} | {pr.memory['total'] / 1e9:,.1f} | {fits} | {pr.time['step']:.3g} | "
                   f"{pr.time['cp_comm']:.3g} | {pr.time['mfu']:.1%} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--budget-mb", type=float, default=160.0)
    ap.add_argument("--time-seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", nargs="*", default=[], choices=["memory", "longest", "time"])
    ap.add_argument("--attention", default="allgather", choices=["auto", "allgather", "ulysses"])
    args = ap.parse_args()
    global ATTENTION
    ATTENTION = args.attention
    lines: list[str] = []
    if "memory" not in args.skip:
        lines += memory_table(args.seqs, args.cps) + [""]
    if "longest" not in args.skip:
        lines += longest_table(args.budget_mb) + [""]
    if "time" not in args.skip:
        lines += time_table(args.time_seq, args.cps, args.steps)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
