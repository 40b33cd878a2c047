"""NVMe offload (parallel.nvme_offload_dir, DeepSpeed's offload_optimizer nvme): where the optimizer state lives and
what it costs. One process, torch's AdamW over an MLP, a few steps with the state in RAM and with the state in
memory-mapped files (parallel/nvme_offload.py); each in its own subprocess so the memory counters are its own.

    PYTHONPATH=src python benchmarks/memory/nvme_offload.py [--dir DIR] [--width 2048] [--layers 6] [--steps 5]

Prints per mode: the optimizer state's bytes, RssAnon (anonymous memory: RAM the process owns) and RssFile (file
pages resident in the page cache, which the kernel may write back to the drive and drop), the median step time, and
a digest of the final weights (equal digests: bit-identical training).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dptrain.parallel.nvme_offload import NvmeOptimizerState


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon", "RssFile")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def one(mode: str, directory: str, width: int, layers: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    nvme = NvmeOptimizerState(opt, directory) if mode == "nvme" else None
    g = torch.Generator().manual_seed(1)
    times = []
    before = _status()
    for _ in range(steps):
        x = torch.randn(8, width, generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    after = _status()
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.numel() > 1)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    return {"mode": mode, "state_bytes": state, "anon_growth": after["RssAnon"] - before["RssAnon"],
            "file_growth": after["RssFile"] - before["RssFile"], "step_s": statistics.median(times[1:] or times),
            "mapped": 0 if nvme is None else nvme.bytes_mapped, "digest": digest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the drive (default: a temporary one)")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.dir, args.width, args.layers, args.steps)))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        rows = []
        for mode in ("ram", "nvme"):
            cmd = [sys.executable, __file__, "--one", mode, "--dir", d, "--width", str(args.width),
                   "--layers", str(args.layers), "--steps", str(args.steps)]
            rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    mb = 2**20
    print("| state in | optimizer state (MiB) | RssAnon growth (MiB) | RssFile growth (MiB) | step (s) "
          "| weights digest |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['state_bytes'] / mb:.0f} | {r['anon_growth'] / mb:.0f} "
              f"| {r['file_growth'] / mb:.0f} | {r['step_s']:.3f} | {r['digest']} |")


if __name__ == "__main__":
    main()
