"""`dptrain plan` against published runs: predicted vs published memory and throughput, with sources (issue 21).

    python benchmarks/planner/plan_published.py [--markdown]

Pure arithmetic, no GPU. The rows are src/dptrain/tools/plan/published_runs.py (sources there and in
docs/results/planner.md); the predictions plan/published.py, plan/efficiency.py, plan/gpt.py, plan/memory.py. Bounds
(the issue's): memory within 15%, throughput within 20%. The one factor set from a published run (SUSTAINED, from
MosaicML's MPT-7B reference row) is printed with that row, which is not counted.
"""

from __future__ import annotations

import argparse

from dptrain.tools.plan import efficiency, gpt, published
from dptrain.tools.plan.memory import zero_states
from dptrain.tools.plan.published_runs import MPT_REFERENCE, checked_throughput, mpt, runs, torchtitan_memory

GIB = 2**30


def memory_rows() -> list[tuple[str, float, float, str, str]]:
    """(row, predicted, published, unit, source)."""
    rows = [(r.name, torchtitan_memory(r) / GIB, r.memory / GIB, "GiB", r.source) for r in runs() if r.memory]
    zero = zero_states(params=7.5e9, gpus=64, optimizer="adam", precision="fp16")
    for stage, pub in enumerate([120.0, 31.4, 16.6, 1.9]):
        rows.append((f"ZeRO 7.5B on 64 GPUs, stage {stage}", zero[stage] / 1e9, pub, "GB",
                     "Rajbhandari et al. 2020 (ZeRO) fig. 1"))
    for name, (h, a, layers, p), pub in [("175B", (12288, 96, 96, 8), 10.3), ("530B", (20480, 128, 105, 35), 18.7),
                                         ("1T", (25600, 160, 128, 64), 28.5)]:
        blk = gpt.Block(h=h, a=a, layers=layers, ffn=4 * h, kv=h, vocab=51200)
        got = gpt.megatron_first_stage_bytes(s=2048, b=1, blk=blk, t=8, p=p, m=p, sp=True, recompute="selective")
        rows.append((f"GPT-3 {name} first stage activations (t8 p{p}, sp + selective)", got / 1e9, pub, "GB",
                     "Korthikanti et al. 2022 sec. 4 formula 34*s*b*h*L/t (formula, not a measurement)"))
    return rows


def throughput_rows() -> list[tuple[str, float, float, str, str]]:
    rows = []
    for r in filter(checked_throughput, runs()):  # torchtitan's table 2: memory only (Float8 is not modelled)
        tokens = published.tokens_per_gpu(r)
        if r.mfu is not None:
            rows.append((r.name, 100 * published.mfu(r, tokens), 100 * r.mfu, "MFU %", r.source))
        else:
            rows.append((r.name, tokens, r.tokens_per_gpu, "tokens/s/GPU", r.source))
    return rows


def table(title: str, rows: list[tuple[str, float, float, str, str]], bound: float, markdown: bool) -> list[str]:
    inside = sum(abs(p / q - 1) <= bound for _, p, q, _, _ in rows)
    out = [f"{title}: {inside}/{len(rows)} within {bound:.0%} ({inside / len(rows):.0%})"]
    if markdown:
        out += ["", "| run | predicted | published | unit | error | source |", "|---|---:|---:|---|---:|---|"]
    for name, p, q, unit, source in rows:
        err = p / q - 1
        mark = "" if abs(err) <= bound else " **out**" if markdown else "  OUT"
        if markdown:
            out.append(f"| {name} | {p:,.4g} | {q:,.4g} | {unit} | {err:+.1%}{mark} | {source} |")
        else:
            out.append(f"  {name:<62}{p:>11,.4g}{q:>11,.4g} {unit:<13}{err:>+8.1%}{mark}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print markdown tables (docs/results/planner.md)")
    args = ap.parse_args()
    ref = mpt(MPT_REFERENCE)
    print(f"SUSTAINED = {efficiency.SUSTAINED} (from the reference run {ref.name}: "
          f"{published.sustained_from(ref):.4f}; published {MPT_REFERENCE[6]:,} tokens/s/GPU; not counted below)")
    mem, thr = memory_rows(), throughput_rows()
    print("\n".join(table("memory", mem, 0.15, args.markdown)))
    print()
    print("\n".join(table("throughput", thr, 0.20, args.markdown)))
    both = [abs(p / q - 1) <= 0.15 for _, p, q, _, _ in mem] + [abs(p / q - 1) <= 0.20 for _, p, q, _, _ in thr]
    print(f"\nall rows: {sum(both)}/{len(both)} within bounds ({sum(both) / len(both):.0%})")


if __name__ == "__main__":
    main()
