"""`dptrain plan`'s memory for the pure-bf16 FSDP2 path against a real 2-rank gloo run.

    python benchmarks/memory/bf16_memory.py [--micro-batch 16] [--port 29517] [--checkpointing none selective ...]

The built-in recipe's model (LLaMA dim 128 x 4 layers, 4 heads, byte vocabulary, seq 128) under
`parallel.strategy=fsdp precision.dtype=bf16`, once per path: `fsdp_param_dtype` fp32 (autocast
over fp32 parameters) and bf16 (FSDP2 gathers bf16 copies; `fsdp_reduce_dtype=fp32`). Each rank
builds it with `dptrain.parallelize`, takes one AdamW step (warm-up), then measures:

- params, grads, optimizer: the bytes of its local shards (as tests/test_plan_measure.py);
- activations: the storages the forward (under bf16 autocast, as the Trainer runs it) created that
  are still allocated when it returns, each once at its current size, less the parameters'
  storages (the shards and FSDP2's unsharded parameters: those are the plan's `temporary`) and
  the loss (tests/support/fsdp_alive.py; the method of tests/support/alive.py).

With `--checkpointing` each path is measured under each `parallel.activation_checkpointing` mode given; the
predicted activations are then what the forward keeps (the plan's figure less the one block it recomputes at a
time in backward, which a measurement after the forward does not see).

The prediction is `dptrain plan`'s own (`tools.plan.predict.predict` on the same overrides; the
memory does not depend on the GPU type). Prints a Markdown table, bytes per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from dptrain import api  # noqa: E402
from dptrain.config.load import load_config  # noqa: E402
from dptrain.models.llama import LlamaConfig  # noqa: E402
from dptrain.tools.plan.llama import activation_parts  # noqa: E402
from dptrain.tools.plan.predict import predict  # noqa: E402
from support.fsdp_alive import fsdp_llama_memory  # noqa: E402

MODEL = {"dim": 128, "n_layers": 4, "n_heads": 4, "max_seq_len": 128}  # the recipe's model.kwargs
SEQ = 128
PATHS = {"autocast (fsdp_param_dtype=fp32)": "fp32", "pure bf16 (fsdp_param_dtype=bf16)": "bf16"}
KEYS = ("params", "grads", "optimizer", "activations")


def _rank(rank: int, port: int, micro_batch: int, modes: list[str], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    api.init_distributed(device="cpu")
    try:
        batch = torch.randint(0, 256, (micro_batch, SEQ + 1), generator=torch.Generator().manual_seed(rank))
        for name, pdt in PATHS.items():
            for mode in modes:
                out[rank, name, mode] = fsdp_llama_memory(MODEL, batch, param_dtype=pdt,
                                                          activation_checkpointing=mode)
    finally:
        dist.destroy_process_group()


def predicted(pdt: str, micro_batch: int, mode: str = "none") -> dict[str, float]:
    cfg = load_config(None, ["parallel.strategy=fsdp", "precision.dtype=bf16", f"parallel.fsdp_param_dtype={pdt}",
                             "parallel.fsdp_reduce_dtype=fp32", f"train.micro_batch_size={micro_batch}",
                             f"train.global_batch_size={2 * micro_batch}", "train.grad_accum_steps=1",
                             f"parallel.activation_checkpointing={mode}"])
    p = predict(cfg, gpus=2, nodes=1, gpu_type="H100", interconnect="ib", comm=None, efficiency=0.5)
    _, work = activation_parts(LlamaConfig(**MODEL), batch=micro_batch, seq=SEQ, precision="bf16",
                               checkpointing=mode, param_dtype=pdt)
    return {**p.memory, "activations": p.memory["activations"] - work}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--micro-batch", type=int, default=16, help="per rank (the recipe: global 32 on 2 ranks)")
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--checkpointing", nargs="+", default=["none"],
                    help="parallel.activation_checkpointing modes to measure each path under")
    args = ap.parse_args()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(args.port, args.micro_batch, args.checkpointing, out), nprocs=2, join=True)
        measured = dict(out)
    print(f"\nbuilt-in recipe model, fsdp on 2 gloo ranks, bf16, micro-batch {args.micro_batch} x {SEQ} tokens, "
          "bytes per rank\n")
    print("| path | checkpointing | part | predicted | rank 0 | rank 1 | error (rank 0) |")
    print("|---|---|---|---|---|---|---|")
    for name, pdt in PATHS.items():
        for mode in args.checkpointing:
            want = predicted(pdt, args.micro_batch, mode)
            for key in KEYS:
                got = [measured[r, name, mode][key] for r in range(2)]
                err = (want[key] - got[0]) / got[0]
                print(f"| {name} | {mode} | {key} | {want[key]:,.0f} | {got[0]:,} | {got[1]:,} | {err:+.1%} |")


if __name__ == "__main__":
    main()
