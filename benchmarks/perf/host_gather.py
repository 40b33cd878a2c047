"""Step time of FSDP2 on the host with dptrain's host all-gather against FSDP2's own, side by side in one run.

    python benchmarks/perf/host_gather.py [--nproc 2] [--dim 512] [--layers 8] [--vocab 8192] [--seq 256]
        [--steps 5] [--rounds 6]

On the CPU dptrain gathers each FSDP2 unit with one broadcast per rank into FSDP2's buffer (or, for a one-parameter
unit, into the parameter's own storage) and frees the buffer at its copy-out (`parallel/fsdp.py`
`free_gather_buffers_early`): it saves memory (benchmarks/memory/finetune_memory.py). This prints what it costs in
time. The built-in LLaMA under `fsdp` on `--nproc` gloo ranks trains `--steps` SGD steps per variant and round; the
two variants alternate for `--rounds` rounds on the same model (the host path switched on and off between rounds:
FSDP2's `DefaultAllGather` and its synchronous unshard restored), and the ratio of the rounds' median step times is
reported as a median and range (harness.Ratios). Losses are compared: the two paths gather the same values.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dptrain import api
from dptrain.models.llama import build_llama
from dptrain.tools.bench.harness import Ratios, alternate, under_torchrun


def host_path(model: torch.nn.Module, *, on: bool) -> None:
    """Switch dptrain's host path (parallel/fsdp.py) on, or back to FSDP2's own all-gather and synchronous unshard."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    from dptrain.parallel.fsdp import free_gather_buffers_early

    if on:
        free_gather_buffers_early(model)
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module._set_unshard_async_op(False)
            module.set_custom_all_gather(DefaultAllGather())


def worker(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        net = build_llama(dim=a.dim, n_layers=a.layers, n_heads=8, vocab_size=a.vocab, max_seq_len=a.seq)
        pm = api.parallelize(net, strategy="fsdp", device=torch.device("cpu"))
        opt = torch.optim.SGD(pm.module.parameters(), lr=0.0)  # lr 0: every round trains the same weights
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        batch = torch.randint(0, a.vocab, (1, a.seq + 1), generator=g)

        def steps(on: bool) -> tuple[float, float]:
            host_path(pm.module, on=on)
            times, loss = [], 0.0
            for _ in range(a.steps):
                dist.barrier()
                t0 = time.perf_counter()
                out = pm.module(batch)
                out.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - t0)
                loss = float(out.detach())
            return statistics.median(times), loss

        steps(True)  # warm-up
        got = alternate({"host": lambda: steps(True), "fsdp2": lambda: steps(False)}, a.rounds)
        host, fsdp2 = ([t for t, _ in got[k]] for k in ("host", "fsdp2"))
        same = all(h == f for (_, h), (_, f) in zip(got["host"], got["fsdp2"], strict=True))
        if dist.get_rank() == 0:
            print(f"fsdp on {dist.get_world_size()} gloo ranks, LLaMA dim {a.dim} x {a.layers} layers, vocabulary "
                  f"{a.vocab}, {a.seq} tokens per rank, {a.steps} steps x {a.rounds} rounds")
            print(f"median step: host all-gather {statistics.median(host) * 1e3:.1f} ms, FSDP2's own "
                  f"{statistics.median(fsdp2) * 1e3:.1f} ms; ratio host / FSDP2's {Ratios.of(host, fsdp2)}; "
                  f"same losses: {same}")
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args(argv)
    return under_torchrun(lambda: worker(a), script=str(Path(__file__).resolve()), argv=argv, nproc=a.nproc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
