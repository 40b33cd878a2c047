"""One command for a lent GPU machine: the GPU paths dptrain cannot run on a CPU, in under 5 minutes.

    bash benchmarks/gpu_check.sh [--out DIR] [--quick]

Prints ONE table:
1. NCCL smoke runs: `dptrain run` with parallel.strategy=ddp and =fsdp on every GPU present
   (backend nccl, a small LLaMA, 10 steps): exit status and final loss.
2. MFU of a ~1B-parameter LLaMA (dim 2048, 20 layers, 16 heads, FFN 5632: 1.03e9 non-embedding
   parameters; byte vocabulary) on one GPU, bf16 autocast, train.compile=true (inductor): tokens/s
   is the median of the log windows after the second, so the steps that compile are not counted;
   MFU = tokens/s x FLOPs per token (the model's `flops_per_token`, 6N + 12·L·d·T) / peak, the peak
   from the GPU's name (`dptrain.metrics.mfu.lookup_peak` when that module exists, else the small
   table below).
3. `dp` (nn.DataParallel, one process) against `ddp` (one process per GPU) on the same model and
   global batch: tokens/s of each and the ratio. Skipped with one GPU (there is nothing to split).
4. `dptrain plan`'s memory per rank against `torch.cuda.max_memory_allocated` (the largest
   `cuda_peak_mb` in diagnostics.jsonl) for ddp and fsdp of a 0.3B LLaMA, fp32 and bf16, on every
   GPU: the prediction without its stated framework allowance (the CUDA context and workspaces are
   not allocations), and the ratio (the issue's bar: within 10%).

Without a CUDA GPU it stops at once with exit status 1 and says why. Every run has its own time
limit, so the script ends within about 5 minutes even when a step hangs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Used only when dptrain.metrics.mfu is not installed: dense bf16 tensor-core peaks in FLOP/s
# (vendor datasheets; figures with sparsity halved). Pattern matched against the device name.
BF16_PEAKS = [("H200", 989.5e12), ("H100.*PCIe", 756.5e12), ("H100", 989.5e12), ("A100", 312e12),
              ("L40S", 362.05e12), ("RTX 4090", 165.2e12)]
LLAMA_1B = {"dim": 2048, "n_layers": 20, "n_heads": 16, "ffn_hidden": 5632, "max_seq_len": 1024}
SMALL = {"dim": 256, "n_layers": 4, "n_heads": 4, "max_seq_len": 256}


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the check, or None when a CUDA GPU is visible."""
    try:
        import torch
    except ImportError as e:
        return f"torch cannot be imported ({e})"
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA GPU"
    return None


def peak_bf16(name: str) -> tuple[float | None, str]:
    try:
        from dptrain.metrics.mfu import lookup_peak  # type: ignore[import-not-found]
    except ImportError:
        import re

        for pattern, peak in BF16_PEAKS:
            if re.search(pattern, name, re.IGNORECASE):
                return peak, f"{pattern} bf16 dense (gpu_check table)"
        return None, f"{name!r} not in gpu_check's table"
    p = lookup_peak(name, "bf16")
    return p.flops, p.source


def dptrain_run(out: Path, overrides: list[str], *, timeout: float) -> dict:
    """`dptrain run` in a subprocess; exit status, seconds, final loss and later-window tokens/s."""
    cmd = [sys.executable, "-m", "dptrain", "run", *overrides, f"log.out_dir={out}", "log.progress=false",
           "train.eval_every_steps=0", "checkpoint.every_steps=0", "checkpoint.keep_last=1"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = 124, f"timed out after {timeout:.0f} s: {str(e.stderr or '')[-1500:]}"
    row: dict = {"rc": rc, "seconds": time.perf_counter() - t0, "tail": tail}
    summary = out / "summary.json"
    if summary.exists():
        row["loss"] = json.loads(summary.read_text()).get("final_loss")
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        tps = [r["tokens_per_s"] for r in map(json.loads, metrics.read_text().splitlines()) if "tokens_per_s" in r]
        if len(tps) > 2:
            row["tokens_per_s"] = statistics.median(tps[2:])  # the first windows hold compilation / warm-up
    return row


def model_args(kw: dict) -> list[str]:
    return [f"model.kwargs.{k}={v}" for k, v in kw.items()] + [f"data.kwargs.seq_len={kw['max_seq_len']}"]


LLAMA_300M = {"dim": 1024, "n_layers": 16, "n_heads": 16, "max_seq_len": 1024}


def plan_memory_rows(root: Path, *, base: list[str], n: int, name: str) -> list[tuple[str, str, str]]:
    """Check 4: predicted memory per rank vs the measured CUDA peak."""
    import re

    from dptrain.config.load import load_config
    from dptrain.metrics import hardware as specs
    from dptrain.tools.plan import predict

    key = next((s.key for s in specs.SPECS if re.search(s.pattern, name, re.IGNORECASE)), None)
    if key is None:
        return [("plan memory vs max_memory_allocated", "skipped", f"{name!r} is not in metrics/hardware.py")]
    rows = []
    for strategy in ("ddp", "fsdp"):
        for dtype in ("fp32", "bf16"):
            items = [*base, *model_args(LLAMA_300M), f"parallel.strategy={strategy}", f"precision.dtype={dtype}",
                     f"launch.nproc_per_node={n}", "train.max_steps=6", "train.micro_batch_size=4",
                     "train.grad_accum_steps=1", "diagnostics.rss_every_steps=1"]
            out = root / f"plan-{strategy}-{dtype}"
            r = dptrain_run(out, items, timeout=90)
            diag = out / "diagnostics.jsonl"
            peaks = [rec["cuda_peak_mb"] * 2**20 for rec in map(json.loads, diag.read_text().splitlines())
                     if "cuda_peak_mb" in rec] if diag.exists() else []
            cfg = load_config(None, [i for i in items if not i.startswith(("parallel.device", "parallel.backend"))])
            pr = predict.predict(cfg, gpus=n, nodes=1, gpu_type=key, interconnect="nvlink", comm=None, efficiency=0.38)
            want = pr.memory["total"] - pr.memory["overhead"]
            detail = (
                f"measured {max(peaks) / 1e9:.3f} GB, predicted {want / 1e9:.3f} GB ({want / max(peaks) - 1:+.1%})"
                if peaks
                else f"no cuda_peak_mb sample\n{r['tail']}"
            )
            rows.append((f"plan memory, {strategy} {dtype}, {n} GPU(s)", f"exit {r['rc']}", detail))
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="directory for the runs (default: a temporary one)")
    p.add_argument("--quick", action="store_true", help="fewer steps (a first look, not a measurement)")
    a = p.parse_args(argv)
    if (why := no_gpu_reason()) is not None:
        print(
            f"gpu_check: no GPU to check: {why}. This script measures dptrain's GPU paths (NCCL, bf16 MFU with "
            "torch.compile, dp vs ddp); run it on a machine with an NVIDIA GPU and a CUDA build of torch.",
            file=sys.stderr,
        )
        return 1
    import torch

    from dptrain.models.llama import build_llama

    n, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    root = Path(a.out or tempfile.mkdtemp(prefix="dptrain-gpu-check-"))
    steps = 20 if a.quick else 40
    rows: list[tuple[str, str, str]] = []
    base = ["parallel.device=cuda", "parallel.backend=nccl", "optim.warmup_steps=0", "train.log_every_steps=5"]
    for strategy in ("ddp", "fsdp"):
        r = dptrain_run(
            root / f"smoke-{strategy}",
            [
                *base,
                *model_args(SMALL),
                f"parallel.strategy={strategy}",
                f"launch.nproc_per_node={n}",
                "train.max_steps=10",
                "train.micro_batch_size=4",
                "train.grad_accum_steps=1",
            ],
            timeout=60,
        )
        rows.append(
            (
                f"NCCL {strategy} smoke, {n} GPU(s), 10 steps",
                f"exit {r['rc']}",
                f"loss {r.get('loss')}, {r['seconds']:.0f} s" + ("" if r["rc"] == 0 else f"\n{r['tail']}"),
            )
        )
    with torch.device("meta"):
        big = build_llama(**LLAMA_1B)
    seq = LLAMA_1B["max_seq_len"]
    fpt, params = big.flops_per_token(seq), big.num_params(exclude_embedding=True)
    r = dptrain_run(
        root / "mfu",
        [
            *base,
            *model_args(LLAMA_1B),
            "parallel.strategy=single",
            "launch.nproc_per_node=1",
            "precision.dtype=bf16",
            "train.compile=true",
            f"train.max_steps={steps}",
            "train.micro_batch_size=8",
            "train.grad_accum_steps=1",
            "diagnostics.rss_every_steps=0",
        ],
        timeout=170,
    )
    peak, source = peak_bf16(name)
    tps = r.get("tokens_per_s")
    mfu = f"MFU {100 * tps * fpt / peak:.1f}%" if tps and peak else "MFU n/a"
    rows.append(
        (
            f"LLaMA {params / 1e9:.2f}B, 1 GPU, bf16, compile, seq {seq}, batch 8",
            f"exit {r['rc']}",
            f"{mfu}: {tps or 0:,.0f} tokens/s x {fpt / 1e9:.2f} GFLOP/token / {peak or 0:.3g} FLOP/s ({source}); "
            f"loss {r.get('loss')}" + ("" if r["rc"] == 0 else f"\n{r['tail']}"),
        )
    )
    if n < 2:
        rows.append(("dp vs ddp", "skipped", f"one GPU ({name}): nn.DataParallel and DDP need >= 2 GPUs to differ"))
    else:
        common = [
            *base,
            *model_args(SMALL),
            f"train.max_steps={steps}",
            f"train.global_batch_size={8 * n}",
            "train.grad_accum_steps=1",
        ]
        dp = dptrain_run(root / "dp", [*common, "parallel.strategy=dp", "launch.nproc_per_node=1"], timeout=60)
        ddp = dptrain_run(root / "ddp", [*common, "parallel.strategy=ddp", f"launch.nproc_per_node={n}"], timeout=60)
        ratio = (
            f"ddp/dp {ddp['tokens_per_s'] / dp['tokens_per_s']:.2f}x"
            if dp.get("tokens_per_s") and ddp.get("tokens_per_s")
            else "ratio n/a"
        )
        rows.append(
            (
                f"dp vs ddp, {n} GPUs",
                f"exit {dp['rc']}/{ddp['rc']}",
                f"{ratio}: dp {dp.get('tokens_per_s', 0):,.0f}, ddp {ddp.get('tokens_per_s', 0):,.0f} tokens/s",
            )
        )
    rows += plan_memory_rows(root, base=base, n=n, name=name)
    width = max(len(r[0]) for r in rows)
    print(f"\ndptrain GPU check: {n} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda}; runs in {root}")
    for what, status, detail in rows:
        print(f"{what:<{width}}  {status:<10}  {detail}")
    return 0 if all(r[1] in ("exit 0", "skipped", "exit 0/0") for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
