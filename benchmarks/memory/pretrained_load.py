"""Sharded loading of a pretrained HF Llama: bytes read, time and peak memory per rank.

    python benchmarks/memory/pretrained_load.py make /tmp/llama200m --size 200m     # random weights, save_pretrained
    python benchmarks/memory/pretrained_load.py measure /tmp/llama200m --ranks 2 --strategy fsdp --reader slices
    python benchmarks/memory/pretrained_load.py measure /tmp/llama200m --ranks 2 --strategy fsdp --reader dcp

`measure` forks `--ranks` gloo ranks; each builds `dptrain.models.hf:causal_lm` on the meta device and lays it
out as the Trainer does. `--reader slices` is dptrain's path (the Materializer reads each rank's chunk with
safetensors' `get_slice`); `--reader dcp` allocates the same shards empty and fills them with
`torch.distributed.checkpoint.load(..., storage_reader=HuggingFaceStorageReader(DIR))`. Each rank prints the
bytes it read (slices only), the load's wall time, its peak RSS during the build and load (VmHWM, reset before
the build) and its private memory after it (RssAnon: the file's mapped pages are shared, not counted there).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

SIZES = {  # LlamaConfig fields
    "tiny": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 2},
    "200m": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12,
             "num_attention_heads": 16, "num_key_value_heads": 16},
}


def make(folder: Path, size: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SIZES[size], max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(str(folder))
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"folder": str(folder), "params": n, "file_bytes": (folder / "model.safetensors").stat().st_size}))


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return -1


def _rank(rank: int, world: int, port: int, folder: str, strategy: str, reader: str, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401 - imported before the clock and the memory peak start

    import dptrain.models.hf  # noqa: F401
    from dptrain.config import ModelConfig, ParallelConfig
    from dptrain.config.layout import resolve_layout
    from dptrain.distributed.mesh import ParallelMesh
    from dptrain.parallel import parallelize_model
    from dptrain.parallel.materialize import make_materializer
    from dptrain.train.build import build_model_meta

    dist.init_process_group("gloo", rank=rank, world_size=world)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak of what follows
    start = time.perf_counter()
    model, _ = build_model_meta(ModelConfig(factory="dptrain.models.hf:causal_lm", kwargs={"pretrained": folder}),
                                seed=0)
    cfg = ParallelConfig(strategy=strategy)
    dims, _ = resolve_layout(cfg, world_size=world)
    mesh = ParallelMesh.build(dims, device_type="cpu")
    if reader == "slices":
        mat = make_materializer(device="cpu", seed=0)
        parallelize_model(model, cfg=cfg, mesh=mesh, device=torch.device("cpu"), materialize=mat)
        read = mat.reports[0].bytes_read
    else:
        import torch.distributed.checkpoint as dcp

        def allocate(module: torch.nn.Module) -> None:
            module.to_empty(device="cpu")

        pmodel = parallelize_model(model, cfg=cfg, mesh=mesh, device=torch.device("cpu"), materialize=allocate)
        state = dict(pmodel.plain.named_parameters())
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(folder))
        read = -1
    dist.barrier()
    seconds = time.perf_counter() - start
    out.put({"rank": rank, "reader": reader, "strategy": strategy, "bytes_read": read, "seconds": round(seconds, 2),
             "peak_rss": _status("VmHWM"), "rss_anon_after": _status("RssAnon")})
    dist.destroy_process_group()


def measure(folder: Path, *, ranks: int, strategy: str, reader: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")  # a fresh interpreter per rank: nothing inherited from this one
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, str(folder), strategy, reader, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    rows = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    file_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    for row in sorted(rows, key=lambda r: r["rank"]):
        print(json.dumps({**row, "file_bytes": file_bytes}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("folder", type=Path)
    mk.add_argument("--size", choices=sorted(SIZES), default="tiny")
    me = sub.add_parser("measure")
    me.add_argument("folder", type=Path)
    me.add_argument("--ranks", type=int, default=2)
    me.add_argument("--strategy", default="fsdp")
    me.add_argument("--reader", choices=("slices", "dcp"), default="slices")
    args = parser.parse_args()
    if args.cmd == "make":
        make(args.folder, args.size)
    else:
        measure(args.folder, ranks=args.ranks, strategy=args.strategy, reader=args.reader)


if __name__ == "__main__":
    sys.exit(main())
