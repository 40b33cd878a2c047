"""An own loop under `dptrain launch` that saves on rank 0 only, at step $FAULT_STEP (nanoGPT's `if master_process:
torch.save(...)`, written with dptrain's collective `Checkpointer.save`): the other ranks go on into the next
step's gradient all-reduce.

    dptrain launch --nproc-per-node 2 benchmarks/acceptance/faults/own_loop.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/acceptance/: `faults` importable as a script

import dptrain  # noqa: E402
from dptrain.models import build_mlp, build_regression_data  # noqa: E402
from faults.inject import fault_step, mark, rank  # noqa: E402


def main(out_dir: str) -> None:
    runtime = dptrain.init_distributed()
    torch.manual_seed(0)
    model = dptrain.parallelize(build_mlp(), strategy="ddp", device=runtime.device).module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = dptrain.prepare_dataloader(build_regression_data(n=4096), global_batch_size=12,
                                        micro_batch_size=12 // runtime.world_size)
    ckpt = dptrain.Checkpointer(out_dir, model, optimizer, loader=loader)
    for step, _micro, (x, y) in dptrain.micro_steps(loader, max_steps=200):
        loss = model((x.to(runtime.device), y.to(runtime.device)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == fault_step() and rank() == 0:  # the bug: a collective save behind a rank-0-only branch
            mark()
            ckpt.save(step + 1)
    ckpt.close()


if __name__ == "__main__":
    main(sys.argv[1])
