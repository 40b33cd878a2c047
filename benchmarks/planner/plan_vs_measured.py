"""`dptrain plan`'s step time predicted vs measured on this machine: 1, 2 and 4 ranks on loopback
gloo, and two "hosts" over a rate-limited link (dptrain.tools.netns; needs root).

What the prediction is given, all measured here and nothing taken from the runs it predicts:
- the compute efficiency, calibrated on the `--calibrate-on` rank run only (`dptrain plan
  --calibrate RUN_DIR`; default the 2-rank run: one thread per rank, as every other setup but the
  1-rank one, which runs two threads);
- the CPU's matmul peak at the threads each rank gets (`--gpu-type cpu`);
- alpha and beta of each link from `dptrain doctor --comm --json` over that link (for two hosts: the
  same all-reduce sweep, run by torchrun across the two namespaces).
The calibration row therefore checks only that the calibration round-trips; the others are
predictions. Runs are interleaved over `--rounds` (a load spike hits every setup
alike); each round's time is the median step after `--warmup`; the table gives the median of the
round medians and their range.

    python benchmarks/planner/plan_vs_measured.py --steps 20 --rounds 3 --json plan_vs_measured.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from dptrain.config.load import load_config  # noqa: E402
from dptrain.tools.bench.harness import dptrain_run, read_jsonl  # noqa: E402
from dptrain.tools.netns import Cluster, dptrain_argv, unavailable_reason  # noqa: E402
from dptrain.tools.plan.calibrate import calibrated_efficiency, link_from_sweep, load_sweep  # noqa: E402
from dptrain.tools.plan.predict import predict  # noqa: E402

RECIPE = ["train.eval_every_steps=0", "log.progress=false", "checkpoint.every_steps=0", "train.log_every_steps=1"]
# Over the slow link, each compression too (from step 2: a short run would otherwise stay uncompressed)
VARIANTS = {"ddp": [], "fp16": ["parallel.grad_compression=fp16"],
            "powersgd": ["parallel.grad_compression=powersgd", "parallel.powersgd_start_step=2"],
            "onebit": ["parallel.grad_compression=onebit", "parallel.onebit_start_step=2"]}


def env(threads: int | None = None) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    e = {**os.environ, "PYTHONPATH": path}
    if threads:
        e["OMP_NUM_THREADS"] = str(threads)
    return e


def dptrain(*argv: str, timeout: float = 600) -> None:
    r = subprocess.run([sys.executable, "-m", "dptrain", *argv], capture_output=True, text=True, env=env(),
                       cwd=ROOT, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"dptrain {' '.join(argv)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def step_times(run_dir: Path, warmup: int) -> list[float]:
    recs = read_jsonl(run_dir / "metrics.jsonl")
    return [r["step_time_s"] for r in recs if "step_time_s" in r and r["step"] > warmup]


def two_host(c: Cluster, *, out: Path, items: list[str], port: int, timeout: float) -> None:
    """One `dptrain run` across the two namespaces, one worker each (OMP_NUM_THREADS=1)."""
    procs = [c.popen(i, dptrain_argv([*items, "--nproc-per-node", "1", "--out", str(out),
                                      *c.launch_overrides(i, port=port)]),
                     cwd=ROOT, env=env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                c.kill_node(i)
    if any(p.returncode for p in procs):
        raise SystemExit(f"two-host run failed: {[p.returncode for p in procs]}\n{logs[0][-2000:]}\n{logs[1][-2000:]}")


def two_host_sweep(c: Cluster, *, path: Path, port: int, timeout: float) -> None:
    """`dptrain doctor --comm`'s all-reduce sweep, run by torchrun across the two namespaces."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", c.rdzv_endpoint(port), "--rdzv-id", f"{c.name}-sweep",
            "--module", "dptrain.diagnostics.commcheck", "--json", str(path)]
    procs = [c.popen(i, [*argv[:5], "--node-rank", str(i), *argv[5:]], cwd=ROOT, env=env(1),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs) or not path.is_file():
        raise SystemExit(f"two-host sweep failed: {[p.returncode for p in procs]}\n{logs[0][-2000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of each run's median")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", default="1,2,4", help="loopback world sizes")
    p.add_argument("--calibrate-on", type=int, default=2, help="the loopback world size the efficiency comes from")
    p.add_argument("--rates", default="100mbit", help="two-host link rates (tc units); empty: skip")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"two-host gradient compressions ({', '.join(VARIANTS)})"
    )
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("items", nargs="*", help="config overrides for every run (default: the built-in recipe)")
    args = p.parse_args()
    ranks = [int(n) for n in args.ranks.split(",")]
    rates = [r for r in args.rates.split(",") if r]
    if args.calibrate_on not in ranks:
        raise SystemExit(f"--calibrate-on {args.calibrate_on} is not one of --ranks {args.ranks}")
    if rates and (why := unavailable_reason()):
        print(f"plan_vs_measured: two-host rows skipped: {why}", file=sys.stderr)
        rates = []
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        raise SystemExit(f"--variants: unknown {unknown} (valid: {', '.join(VARIANTS)})")
    items = [f"train.max_steps={args.steps}", *RECIPE, *args.items]
    with tempfile.TemporaryDirectory(prefix="plan_vs_measured_") as tmp_s:
        tmp = Path(tmp_s)
        links = {}
        for n in ranks[1:]:
            dptrain("doctor", "--comm", "--nproc-per-node", str(n), "--json", str(tmp / f"comm{n}.json"))
            links[f"loopback x{n}"] = link_from_sweep(load_sweep(tmp / f"comm{n}.json"))
        clusters = {rate: Cluster(rate=rate) for rate in rates}
        try:
            for i, (rate, c) in enumerate(clusters.items()):
                c.create()
                two_host_sweep(c, path=tmp / f"comm-{rate}.json", port=29700 + i, timeout=args.timeout)
                links[f"two hosts, {rate}"] = link_from_sweep(load_sweep(tmp / f"comm-{rate}.json"))
            medians: dict[str, list[float]] = {}
            port = 29800
            for r in range(args.rounds):
                for n in ranks:
                    out = tmp / f"run{n}-{r}"
                    run = dptrain_run(items, nproc=n, out=out, timeout=args.timeout, env=env(), cwd=ROOT)
                    times = run.step_times(after=args.warmup)
                    medians.setdefault(f"loopback x{n}", []).append(statistics.median(times))
                for rate, c in clusters.items():
                    for v in variants:
                        port += 1
                        out = tmp / f"two-{rate}-{v}-{r}"
                        two_host(c, out=out, items=[*items, *VARIANTS[v]], port=port, timeout=args.timeout)
                        medians.setdefault(f"two hosts, {rate}, {v}", []).append(
                            statistics.median(step_times(out, args.warmup))
                        )
                print(
                    f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in medians.items()),
                    file=sys.stderr,
                    flush=True,
                )
            effs = [
                calibrated_efficiency(tmp / f"run{args.calibrate_on}-{r}", cpu=True, skip=args.warmup)[0]
                for r in range(args.rounds)
            ]
        finally:
            for c in clusters.values():
                c.destroy()
    eff = statistics.median(effs)
    rows = []
    for name, times in medians.items():
        two = name.startswith("two")
        variant = name.rsplit(", ", 1)[1] if two else "ddp"
        cfg = load_config(None, [*items, *VARIANTS[variant]])
        link = links.get(name.rsplit(", ", 1)[0] if two else name)
        n = 2 if two else int(name.split("x")[1])
        if two:
            os.environ["OMP_NUM_THREADS"] = "1"  # as each two-host worker ran
        try:
            pr = predict(
                cfg, gpus=n, nodes=2 if two else 1, gpu_type="cpu", interconnect="ethernet", comm=link, efficiency=eff
            )
        finally:
            os.environ.pop("OMP_NUM_THREADS", None) if two else None
        measured = statistics.median(times)
        rows.append(
            {
                "setup": name,
                "ranks": n,
                "measured_s": measured,
                "min_s": min(times),
                "max_s": max(times),
                "predicted_s": pr.time["step"],
                "compute_s": pr.time["compute"],
                "exposed_comm_s": pr.time["exposed_comm"],
                "error": pr.time["step"] / measured - 1,
                "link_gbps": link.bandwidth / 1e9 if link else None,
                "alpha_us": link.alpha * 1e6 if link else None,
            }
        )
    print(
        f"efficiency calibrated on the {args.calibrate_on}-rank runs: {eff:.3f} "
        f"(per round: {', '.join(f'{e:.3f}' for e in effs)})"
    )
    print(
        "| setup | ranks | link fitted (GB/s, alpha us) | measured step s [range] | predicted s (compute + "
        "exposed comm) | error |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        link = f"{r['link_gbps']:.3f}, {r['alpha_us']:.0f}" if r["link_gbps"] else "-"
        print(
            f"| {r['setup']} | {r['ranks']} | {link} | {r['measured_s']:.3f} [{r['min_s']:.3f}-{r['max_s']:.3f}] | "
            f"{r['predicted_s']:.3f} ({r['compute_s']:.3f} + {r['exposed_comm_s']:.3f}) | {r['error']:+.1%} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"efficiency": eff, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
