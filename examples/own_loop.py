"""Your own training loop, made data-parallel with dptrain's small API.

    dptrain launch examples/own_loop.py            # 2 CPU workers (or every GPU)
    dptrain launch --nproc-per-node 1 examples/own_loop.py
"""

import torch

import dptrain
from dptrain.models import build_mlp, build_regression_data


def main() -> None:
    runtime = dptrain.init_distributed()
    torch.manual_seed(0)
    model = dptrain.parallelize(build_mlp(), strategy="ddp", device=runtime.device).module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    loader = dptrain.prepare_dataloader(build_regression_data(n=1024), global_batch_size=64, micro_batch_size=16)
    accum = dptrain.grad_accum_steps(loader)

    for step, micro, (x, y) in dptrain.micro_steps(loader, max_steps=100):
        last = micro == accum - 1
        with dptrain.sync_gradients(model, last):  # all-reduce only on the last micro-step
            loss = model((x.to(runtime.device), y.to(runtime.device))) / accum
            loss.backward()
        if last:
            dptrain.clip_grad_norm_(model, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if runtime.is_main and step % 20 == 0:
                print(f"step {step} loss {loss.item() * accum:.4f}")
    if runtime.is_main:
        print("done")


if __name__ == "__main__":
    main()
