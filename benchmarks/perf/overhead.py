"""dptrain's step vs a hand-written raw PyTorch DDP loop: same model, same batches, one run.

    python benchmarks/perf/overhead.py [--steps 80] [--nproc 2] [--accum 2] [--dim 128]

Starts itself under torchrun. On every rank it builds the same LLaMA-style model twice (same
seed): one trained by dptrain's whole per-step path, `trainer.end_step(trainer.train_step())` (DDP
strategy, default diagnostics on, logging every 10 steps, the preemption agreement: exactly what
`dptrain run` does per step), one by the loop the field's guides teach (dptrain/tools/bench/raw_ddp.py,
shared with `dptrain bench`: DDP, `no_sync` on all but the last micro-step, loss / accum, backward,
clip, step, zero_grad). Steps alternate between the two so both see the same machine noise. Prints
the median step time of each, their ratio and the median ratio of back-to-back step pairs
(target <= 1.02), and whether the final weights are bit-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time

import torch


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    return p.parse_args(argv)


def _sha(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def worker(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from dptrain.config.load import load_config
    from dptrain.distributed.process_group import process_group
    from dptrain.tools.bench.harness import Ratios, run_step
    from dptrain.tools.bench.raw_ddp import RawDDP
    from dptrain.train.trainer import Trainer

    world = int(os.environ["WORLD_SIZE"])
    cfg = load_config(None, [
        f"model.kwargs.dim={a.dim}", f"model.kwargs.n_layers={a.layers}", f"model.kwargs.max_seq_len={a.seq}",
        f"data.kwargs.seq_len={a.seq}", f"train.micro_batch_size={a.micro}", f"train.grad_accum_steps={a.accum}",
        f"train.global_batch_size={a.micro * a.accum * world}", "optim.name=adamw", "optim.weight_decay=0",
        "optim.warmup_steps=0", "optim.schedule=constant", "optim.grad_clip=1.0", "log.progress=false",
        f"train.max_steps={a.steps}", "parallel.strategy=ddp",
    ])
    trainer = Trainer(cfg, out_dir=tempfile.mkdtemp(prefix="dptrain-overhead-"))
    dev = trainer.device  # cpu here; the GPU of this rank where there is one (nccl)
    with process_group(trainer.env, backend=trainer.res.backend, device=dev, timeout_s=300):
        # dptrain as users get it: outputs open, the default diagnostics armed (watchdog, straggler
        # split, drift and memory checks at their default intervals), the preemption handler installed.
        trainer.setup()

        def dptrain_step() -> torch.Tensor:
            return run_step(trainer)  # the same step boundary as `dptrain run`
        rank = dist.get_rank()
        # The raw loop (dptrain/tools/bench/raw_ddp.py, shared with `dptrain bench`): the same initial
        # weights, the same micro-batches, the same optimizer and schedule, plain PyTorch DDP.
        raw_loop = RawDDP(cfg, device=dev, steps=a.steps)
        raw, raw_step = raw_loop.ddp, raw_loop.step

        times: dict[str, list[float]] = {"dptrain": [], "raw": []}
        same_losses = True
        for step in range(a.steps):
            order = [("dptrain", dptrain_step), ("raw", raw_step)]
            if step % 2:
                order.reverse()  # alternate who goes first
            losses = {}
            for name, fn in order:
                dist.barrier()
                t = time.perf_counter()
                losses[name] = fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)  # time the work, not its launch
                times[name].append(time.perf_counter() - t)
            same_losses &= bool(torch.equal(losses["dptrain"], losses["raw"]))
        trainer.close()
        same = _sha(trainer.module) == _sha(raw.module)
        if rank == 0:
            med = {k: statistics.median(v[a.warmup:]) for k, v in times.items()}
            print(f"world size {world}, {a.steps} steps ({a.warmup} warm-up excluded), accum {a.accum}, "
                  f"micro batch {a.micro}, dim {a.dim}, layers {a.layers}, seq {a.seq}")
            print(f"median step time: dptrain {med['dptrain'] * 1e3:.1f} ms, raw DDP loop {med['raw'] * 1e3:.1f} ms")
            paired = Ratios.of(times["dptrain"][a.warmup :], times["raw"][a.warmup :]).median
            print(
                f"ratio dptrain / raw: {med['dptrain'] / med['raw']:.3f} of medians, {paired:.3f} median of "
                "back-to-back pairs  (target <= 1.02)"
            )
            print(
                f"per-step losses identical: {same_losses}; final weights identical: {same} "
                f"(sha256 {_sha(trainer.module)} vs {_sha(raw.module)})"
            )


def main(argv: list[str]) -> int:
    from dptrain.tools.bench.harness import under_torchrun

    a = _args(argv)
    return under_torchrun(lambda: worker(a), script=__file__, argv=argv, nproc=a.nproc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
