"""Peak host memory per rank of building a sharded model: eager build vs meta-device init.

    python benchmarks/memory/meta_init_memory.py [--nproc 2] [--strategy fsdp] [--vocab 32000] [--dim 1024] [--layers 8]

Two torchrun jobs, one per mode, so that memory the allocator kept from one mode cannot hide
the other's peak. Every rank resets its peak RSS (Linux `/proc/self/clear_refs`) once the
process group is up. It then builds the LLaMA-style model with `parallel.strategy` applied:

- eager: `build_model` on the CPU, then `dptrain.parallelize`;
- meta: `build_model_meta`, then FSDP sharding on meta and `materialize`, or, for DDP,
  `materialize` before wrapping.

It prints the increase of the peak (VmHWM) and current (VmRSS) resident memory, and the bytes
of parameters the rank holds. Both modes must give the same weights (SHA-256 of the gathered
state dict, printed by rank 0).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time

import torch

from dptrain.tools.bench.harness import torchrun_output


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--strategy", default="fsdp", choices=["ddp", "zero1", "zero2", "fsdp"])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--mode", choices=["eager", "meta"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def worker(a: argparse.Namespace) -> None:
    from torch.distributed.tensor import DTensor

    from dptrain.api import parallelize
    from dptrain.config import ModelConfig
    from dptrain.distributed.env import DistEnv
    from dptrain.distributed.process_group import destroy_process_group, init_process_group
    from dptrain.parallel import full_state_dict
    from dptrain.parallel.materialize import make_materializer
    from dptrain.train.build import build_model, build_model_meta, import_object

    cpu = torch.device("cpu")
    env = DistEnv.from_env()
    init_process_group(env, backend="gloo", device=cpu, timeout_s=600)
    cfg = ModelConfig(factory="dptrain.models.llama:build_llama",
                      kwargs={"vocab_size": a.vocab, "dim": a.dim, "n_layers": a.layers, "n_heads": 8})
    import_object(cfg.factory)  # imports are not what is measured
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS := current RSS
    base = _status_mib("VmRSS")
    t0 = time.perf_counter()
    if a.mode == "eager":
        model = parallelize(build_model(cfg, seed=0), strategy=a.strategy, device=cpu).module
    else:
        model, reason = build_model_meta(cfg, seed=0)
        assert reason is None, reason
        # the trainer's path: parallelize calls the hook after sharding (FSDP) or before DDP
        model = parallelize(model, strategy=a.strategy, device=cpu,
                            materialize=make_materializer(device=cpu, seed=0)).module
    seconds = time.perf_counter() - t0
    peak, now = _status_mib("VmHWM") - base, _status_mib("VmRSS") - base
    params = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters()) / 2**20
    sd = full_state_dict(model)
    digest = hashlib.sha256(b"".join(sd[k].contiguous().view(torch.uint8).numpy().tobytes() for k in sorted(sd)))
    row = {"mode": a.mode, "rank": env.rank, "peak_mib": round(peak, 1), "rss_after_mib": round(now, 1),
           "param_mib": round(params, 1), "seconds": round(seconds, 2),
           "sha256": digest.hexdigest()[:16] if env.rank == 0 else None}
    rows: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rows, row)  # rank 0 prints every row: ranks' lines never interleave
    if env.rank == 0:
        print("\n".join(json.dumps(r) for r in rows), flush=True)
    del model, sd
    gc.collect()
    destroy_process_group()


def main(argv: list[str]) -> int:
    a = _args(argv)
    if "RANK" in os.environ:
        worker(a)
        return 0
    rows = []
    for mode in ("eager", "meta"):
        r = torchrun_output(__file__, [*argv, "--mode", mode], nproc=a.nproc)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            return r.returncode
        rows += [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    print(f"strategy {a.strategy}, {a.nproc} ranks, llama vocab={a.vocab} dim={a.dim} layers={a.layers}")
    for row in sorted(rows, key=lambda x: (x["rank"], x["mode"])):
        print(f"  rank {row['rank']} {row['mode']:5s}: peak RSS +{row['peak_mib']:8.1f} MiB, after "
              f"+{row['rss_after_mib']:8.1f} MiB, parameters {row['param_mib']:8.1f} MiB, {row['seconds']:.1f} s")
    hashes = {row["mode"]: row["sha256"] for row in rows if row["sha256"]}
    print(f"weights identical (SHA-256 of the gathered state dict): {hashes['eager'] == hashes['meta']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
