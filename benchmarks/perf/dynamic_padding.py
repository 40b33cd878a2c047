"""Dynamic padding with length-grouped batches under a token budget vs fixed padding, and the data wait.

    python benchmarks/perf/dynamic_padding.py [--examples 3000] [--rounds 3] [--steps 12] [--only padding|wait]
                                         [--wait-runs 3] [--wait-steps 60] [--wait-recipe built-in|fine-tuning]

1. **Padding** (`--only padding`): a synthetic long-tailed instruction set (prompt and response lengths
   log-normal, as in instruction-tuning sets: most rows short, a few near the context), written as JSON
   lines and read by ``dptrain.data.finetune:build_finetune`` with the bytes tokenizer (one token per byte).
   Two variants of the same run (the built-in LLaMA, ``seq_len`` tokens of context, world size 1):
   ``padding=max`` (fixed batches of ``--rows`` rows, every row padded to ``seq_len``) and ``padding=dynamic``
   (``max_tokens = rows x seq_len``: the same padded tokens per step at most, so the same peak memory). Each
   round is a fresh process holding both Trainers, their steps alternating (so both see the same load on a
   shared machine): ``--steps`` timed steps of the Trainer's own ``end_step(train_step())`` each, after
   ``--warmup``. Per step: real tokens (the rows' lengths), padded tokens (each micro-batch's rows x the length
   it is padded to), the time. Prints, per variant, the pad fraction (1 - real / padded, over all timed steps),
   the median over rounds of real tokens per second, and the per-round ratio dynamic / fixed and its median.
2. **Data wait** (`--only wait`): ``dptrain run`` of the built-in recipe with ``data.num_workers=2`` on 2 ranks,
   ``--wait-runs`` times, and of the fine-tuning set with dynamic padding the same way; the diagnostics'
   step split (``diagnostics.straggler_every_steps=20``: the last 10 steps of every 20, per rank) gives the
   data share of each window and rank; prints every run's shares and the median over all of them.

Prints one JSON line per measurement, then a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dptrain.tools.bench.harness import dptrain_run, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("explain the difference between data parallel and model parallel training give an example write a short "
         "function that sorts a list summarize this paragraph in two sentences translate the following into french "
         "what is the capital of why does the loss go down").split()


def make_instructions(path: Path, n: int, *, seq_len: int, seed: int = 0) -> Path:
    """`n` prompt/response pairs with log-normal byte lengths (prompt median ~70, response median ~160, a tail
    beyond the context)."""
    r = random.Random(seed)

    def text(median: float, sigma: float) -> str:
        target = max(4, int(math.exp(math.log(median) + sigma * r.gauss(0, 1))))
        out = ""
        while len(out) < target:
            out += r.choice(WORDS) + " "
        return out[:target]

    path.write_text("".join(json.dumps({"prompt": text(70, 0.7) + "\n", "response": text(160, 0.9)}) + "\n"
                            for _ in range(n)))
    return path


def padding_job(rank: int, variants: dict[str, list[str]], steps: int, warmup: int) -> dict[str, dict]:
    """Both variants at world size 1 in one process, their steps alternating (the same machine load for both):
    the Trainer's own step, timed; real and padded tokens per step."""
    from dptrain.config.load import load_config
    from dptrain.distributed.process_group import process_group
    from dptrain.train.trainer import Trainer

    trainers = {name: Trainer(load_config(None, [*items, f"train.max_steps={steps + warmup}"]),
                              out_dir=tempfile.mkdtemp(prefix="dptrain-dynpad-")) for name, items in variants.items()}
    first = next(iter(trainers.values()))
    out: dict[str, dict] = {name: {"real": [], "padded": [], "times": [], "rows": []} for name in trainers}
    with process_group(first.env, backend=first.res.backend, device=first.device, timeout_s=600):
        for trainer in trainers.values():
            trainer.setup()
        for s in range(steps + warmup):
            order = list(trainers.items())
            for name, trainer in order if s % 2 == 0 else reversed(order):
                ds, rec = trainer.train_ds, out[name]
                pad_to = ds.collate.keywords.get("pad_to")
                micro = trainer.sampler.micro_batches(s)
                t = time.perf_counter()
                trainer.end_step(trainer.train_step())
                if s >= warmup:
                    rec["times"].append(time.perf_counter() - t)
                    lens = [ds.lengths[m] for m in micro]
                    rec["real"].append(int(sum(int(x.sum()) for x in lens)))
                    rec["padded"].append(int(sum((pad_to or int(x.max())) * len(x) for x in lens)))
                    rec["rows"].append(sum(len(x) for x in lens))
        for trainer in trainers.values():
            trainer.close()
            trainer.model = trainer.parallel.release()
            trainer.mesh.release()
    return out


def padding(a: argparse.Namespace, tmp: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from support.mp import run_ranks

    src = make_instructions(tmp / "instructions.jsonl", a.examples, seq_len=a.seq)
    model = [f"model.kwargs={{vocab_size: 256, dim: {a.dim}, n_layers: {a.layers}, n_heads: 4, max_seq_len: {a.seq}}}",
             f"data.source={src}", f"train.global_batch_size={a.rows}", f"train.micro_batch_size={a.rows}",
             "train.eval_every_steps=0", "train.log_every_steps=1000", "log.progress=false",
             "optim.warmup_steps=0", "optim.schedule=constant", "checkpoint.every_steps=0"]
    variants = {
        "fixed (pad to seq_len)": [*model, f"data.kwargs={{seq_len: {a.seq}, padding: max}}"],
        "dynamic + length-grouped": [*model, f"data.kwargs={{seq_len: {a.seq}, max_tokens: {a.rows * a.seq}, "
                                             f"min_rows: 1, sort_window: {a.sort_window}}}"],
    }
    results: dict[str, list[dict]] = {k: [] for k in variants}
    ratios = []
    for rnd in range(a.rounds):
        res = run_ranks(padding_job, 1, variants, a.steps, a.warmup, timeout=1800)[0]
        tps = {}
        for name, r in res.items():
            results[name].append(r)
            tps[name] = sum(r["real"]) / sum(r["times"])
            print(json.dumps({"what": "padding", "variant": name, "round": rnd, "steps": len(r["times"]),
                              "real_tokens": sum(r["real"]), "padded_tokens": sum(r["padded"]),
                              "median_step_s": round(statistics.median(r["times"]), 4),
                              "real_tokens_per_s": round(tps[name])}), flush=True)
        fixed, dyn = tps.values()
        ratios.append(dyn / fixed)
    print(f"\n{a.examples} instructions (bytes), seq_len {a.seq}, LLaMA dim {a.dim} x {a.layers} layers, world size 1, "
          f"at most {a.rows} x {a.seq} padded tokens per step; {a.rounds} rounds x {a.steps} timed steps of each "
          "variant, alternating")
    print("| variant | pad fraction | real tokens/s (median of rounds) | rows per step (mean) | step time (median) |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        real = sum(sum(r["real"]) for r in runs)
        padded = sum(sum(r["padded"]) for r in runs)
        tps_med = statistics.median(sum(r["real"]) / sum(r["times"]) for r in runs)
        mean_rows = statistics.mean(n for r in runs for n in r["rows"])
        step = statistics.median(t for r in runs for t in r["times"])
        print(f"| {name} | {1 - real / padded:.3f} | {tps_med:,.0f} | {mean_rows:.1f} | {step:.3f} s |")
    print(f"tokens/s ratio dynamic / fixed, per round: {', '.join(f'{x:.2f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.2f}")


def share_of_runs(run_dir: Path) -> list[float]:
    shares = []
    for rec in read_jsonl(run_dir / "diagnostics.jsonl"):
        if rec.get("kind") == "step_split":
            for row in rec["ranks"]:
                total = sum(row[k] for k in ("data", "compute", "wait", "other"))
                shares.append(row["data"] / total)
    return shares


def data_wait(a: argparse.Namespace, tmp: Path) -> None:
    src = make_instructions(tmp / "wait.jsonl", 4000, seq_len=128)
    common = ["data.num_workers=2", f"train.max_steps={a.wait_steps}", "train.eval_every_steps=0",
              "diagnostics.straggler_every_steps=20", "log.progress=false", "checkpoint.every_steps=0"]
    recipes = {
        "built-in recipe": [],
        "fine-tuning, dynamic padding": [f"data.source={src}", "data.kwargs={seq_len: 128, max_tokens: 4096}"],
    }
    if a.wait_recipe is not None:
        recipes = {name: items for name, items in recipes.items() if name.startswith(a.wait_recipe)}
    summary = {}
    for name, items in recipes.items():
        every = []
        for k in range(a.wait_runs):
            out = tmp / f"wait-{len(summary)}-{k}"
            dptrain_run([*common, *items], nproc=2, out=out, timeout=1800)
            shares = share_of_runs(out)
            every += shares
            pct = [round(100 * s, 2) for s in shares]
            print(json.dumps({"what": "data_wait", "recipe": name, "run": k, "shares_pct": pct}), flush=True)
        summary[name] = every
    print(f"\ndata share of the step, 2 ranks, data.num_workers=2, {a.wait_runs} runs x {a.wait_steps} steps "
          "(windows of the last 10 of every 20 steps, per rank)")
    print("| recipe | median | max | windows x ranks |")
    print("|---|---|---|---|")
    for name, every in summary.items():
        print(f"| {name} | {100 * statistics.median(every):.2f} % | {100 * max(every):.2f} % | {len(every)} |")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=("padding", "wait"), default=None)
    p.add_argument("--examples", type=int, default=3000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sort-window", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--wait-runs", type=int, default=3)
    p.add_argument("--wait-steps", type=int, default=60)
    p.add_argument("--wait-recipe", choices=("built-in", "fine-tuning"), default=None, help="only this one")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dptrain-dynpad-") as d:
        if a.only in (None, "padding"):
            padding(a, Path(d))
        if a.only in (None, "wait"):
            data_wait(a, Path(d))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
