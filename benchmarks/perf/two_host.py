"""Two "hosts" over a rate-limited link: raw DDP against each gradient compression.

Builds one two-namespace cluster per bandwidth (dptrain.tools.netns: a veth pair with `tc tbf`
on both ends), runs `dptrain run` on the built-in LM recipe across it (one node, one worker per
namespace, c10d rendezvous) for every variant, and prints a Markdown table: median step time
(and its spread over rounds), tokens/s, the throughput ratio to raw DDP at the same bandwidth,
and the loss after N steps with its difference to raw DDP's.

Variants are `name=override[,override...]`; the defaults are raw DDP and
`parallel.grad_compression=fp16|powersgd|onebit` (PowerSGD from step 2: its default start step
would leave a short run uncompressed). A variant whose overrides this checkout's
config refuses (a field it does not have yet) is reported as not available, never estimated.
Runs are interleaved (round-robin over bandwidths and variants), so a load spike on this shared
machine lands on all of them alike; each round's step time is the median of its steps after
`--warmup`. Needs root (network namespaces).

    python benchmarks/perf/two_host.py --steps 30 --rounds 3 --json two_host.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from dptrain.tools.netns import Cluster, dptrain_argv, unavailable_reason  # noqa: E402

DEFAULT_VARIANTS = [
    "raw-ddp=parallel.strategy=ddp",
    "fp16=parallel.strategy=ddp,parallel.grad_compression=fp16",
    "powersgd=parallel.strategy=ddp,parallel.grad_compression=powersgd,parallel.powersgd_start_step=2",
    "onebit=parallel.strategy=ddp,parallel.grad_compression=onebit",
]


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition("=")
    if not rest:
        raise SystemExit(f"--variant {text!r}: write name=override[,override...]")
    return name, rest.split(",")


def env() -> dict[str, str]:
    # One thread per worker: two "hosts" share this machine's cores.
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def refusal(overrides: list[str]) -> str | None:
    """Why this checkout's config refuses `overrides` (None when it accepts them)."""
    layout = ["launch.nnodes=2", "launch.rdzv_endpoint=h0:29500", "--nproc-per-node", "1"]  # as measured: 2 x 1
    r = subprocess.run([sys.executable, "-m", "dptrain", "config", "show", *overrides, *layout],
                       capture_output=True, text=True, env=env(), cwd=ROOT)
    if r.returncode == 0:
        return None
    last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
    return last.removeprefix("dptrain: error: ").split(";")[0]


def run_once(c: Cluster, *, base: list[str], overrides: list[str], out: Path, port: int, timeout: float) -> dict:
    """One two-node run; its per-step records and summary."""
    items = [*base, *overrides, "--nproc-per-node", "1", "--out", str(out)]
    procs = [c.popen(i, dptrain_argv([*items, *c.launch_overrides(i, port=port)]), cwd=ROOT, env=env(),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {timeout:.0f}s"}
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                c.kill_node(i)
    if any(p.returncode != 0 for p in procs):
        said = [next((ln for ln in reversed(log.splitlines()) if ln.startswith("dptrain:")), "") for log in logs]
        return {"failed": f"exit codes {[p.returncode for p in procs]}: {' | '.join(s for s in said if s)}"[:300]}
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    return {"steps": steps, "summary": json.loads((out / "summary.json").read_text())}


def measure(args: argparse.Namespace, variants: list[tuple[str, list[str]]]) -> dict[tuple[str, str], dict]:
    base = [f"train.max_steps={args.steps}", f"train.global_batch_size={args.global_batch}",
            f"train.micro_batch_size={args.global_batch // 2}", "train.log_every_steps=1", "train.eval_every_steps=0",
            "log.progress=false", "checkpoint.every_steps=0", f"train.seed={args.seed}"]
    results: dict[tuple[str, str], dict] = {}
    port = 29600
    clusters = {rate: Cluster(rate=rate) for rate in args.rates}
    try:
        for c in clusters.values():
            c.create()
        with tempfile.TemporaryDirectory(prefix="two_host_") as tmp:
            for r in range(args.rounds):
                for rate, c in clusters.items():
                    for name, overrides in variants:
                        if "failed" in results.get((rate, name), {}):
                            continue  # one failure is reported; the variant is not run again
                        port += 1  # a fresh store port per run: no wait for the last one's sockets
                        rec = run_once(c, base=base, overrides=overrides, out=Path(tmp) / f"{rate}-{name}-{r}",
                                       port=port, timeout=args.timeout)
                        if "failed" in rec:
                            results[(rate, name)] = {"failed": rec["failed"]}
                            print(f"round {r} {rate} {name}: FAILED {rec['failed']}", file=sys.stderr, flush=True)
                            continue
                        times = [s["step_time_s"] for s in rec["steps"][args.warmup:]]
                        res = results.setdefault((rate, name), {"round_medians": [], "losses": []})
                        res["round_medians"].append(statistics.median(times))
                        res["losses"].append(rec["steps"][-1]["loss"])
                        res["tokens_per_step"] = rec["summary"]["global_batch_size"] * args.seq_len
                        print(f"round {r} {rate} {name}: median step {res['round_medians'][-1]:.3f}s, "
                              f"loss@{args.steps} {res['losses'][-1]:.4f}", file=sys.stderr, flush=True)
    finally:
        for c in clusters.values():
            c.destroy()
    return results


def table(results: dict[tuple[str, str], dict], *, rates: list[str], variants: list[str],
          skipped: dict[str, str], steps: int) -> str:
    lines = [f"| link | variant | median step (s) [min-max over rounds] | tokens/s | ratio to raw DDP | "
             f"loss after {steps} steps | loss vs raw DDP |", "|---|---|---|---|---|---|---|"]
    for rate in rates:
        raw = results.get((rate, variants[0]))
        raw = None if raw is None or "failed" in raw else raw
        for name in variants:
            if name in skipped:
                lines.append(f"| {rate} | {name} | not available: {skipped[name]} | | | | |")
                continue
            res = results[(rate, name)]
            if "failed" in res:
                lines.append(f"| {rate} | {name} | run failed: {res['failed']} | | | | |")
                continue
            med = statistics.median(res["round_medians"])
            tps = res["tokens_per_step"] / med
            loss = res["losses"][-1]  # deterministic per variant: every round has the same losses
            ratio = tps / (raw["tokens_per_step"] / statistics.median(raw["round_medians"])) if raw else float("nan")
            dloss = (loss / raw["losses"][-1] - 1) * 100 if raw else float("nan")
            lines.append(
                f"| {rate} | {name} | {med:.3f} [{min(res['round_medians']):.3f}-{max(res['round_medians']):.3f}] "
                f"| {tps:,.0f} | {ratio:.2f}x | {loss:.4f} | {dloss:+.2f}% |"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="1gbit,100mbit", help="comma-separated tc rates")
    p.add_argument(
        "--variant",
        action="append",
        help="name=override[,override...] (repeatable; the first is the "
        "reference the ratios are taken against); default: raw DDP, fp16, powersgd, onebit",
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time median")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample of the recipe (data.kwargs.seq_len)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", help="also write the measurements here")
    args = p.parse_args()
    args.rates = args.rates.split(",")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `kill` still removes the namespaces (finally)
    reason = unavailable_reason()
    if reason:
        print(f"two_host: cannot build the cluster: {reason}", file=sys.stderr)
        return 2
    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    skipped = {name: why for name, ov in variants if (why := refusal(ov))}
    for name, why in skipped.items():
        print(f"two_host: {name}: not available in this checkout ({why})", file=sys.stderr)
    if variants[0][0] in skipped:
        raise SystemExit(f"the reference variant {variants[0][0]} is refused: {skipped[variants[0][0]]}")
    results = measure(args, [(n, ov) for n, ov in variants if n not in skipped])
    print(table(results, rates=args.rates, variants=[n for n, _ in variants], skipped=skipped, steps=args.steps))
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k[0]}/{k[1]}": v for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
