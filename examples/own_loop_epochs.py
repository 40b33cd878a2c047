"""An epoch-based script (MNIST-style) on dptrain's own-loop API: epochs, evaluation with a metric,
checkpoints that resume (at any world size) and the hang watchdog.

    dptrain launch examples/own_loop_epochs.py runs/epochs          # 2 CPU workers (or every GPU)
    dptrain launch --nproc-per-node 1 examples/own_loop_epochs.py runs/epochs   # resumes where it stopped
    dptrain ckpt ls runs/epochs
"""

import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import dptrain


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())  # a two-class problem


def main(out: str = "runs/epochs", epochs: int = 4) -> int:
    runtime = dptrain.init_distributed()
    device = runtime.device
    torch.manual_seed(0)
    model = dptrain.parallelize(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2)), device=device).module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    loader = dptrain.prepare_dataloader(data(1000, 0), global_batch_size=64, micro_batch_size=64 // runtime.world_size)
    test_loader = dptrain.prepare_eval_dataloader(data(203, 1), 50)  # uneven: nothing dropped, nothing twice

    ckpt = dptrain.Checkpointer(out, model, optimizer, scheduler, loader)
    step = ckpt.resume()  # 0, or the saved step: model, optimizer, scheduler, RNG and data position restored
    with dptrain.monitor(out, loader=loader, optimizer=optimizer) as mon:  # hang watchdog + metrics.jsonl
        for epoch in dptrain.epochs(loader, epochs):  # a resumed run finishes its epoch first
            model.train()
            for x, y in loader:  # ends at the end of the epoch; len(loader) batches per epoch
                loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                mon.step(step, loss)
                if ckpt.step(step):  # SIGTERM / Ctrl-C on any rank: this step is saved, stop
                    return ckpt.exit_code
            scheduler.step()

            mon.phase("eval")
            model.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y in test_loader:
                    pred = model(x.to(device)).argmax(1)
                    pred, target = dptrain.gather_for_metrics((pred, y.to(device)), test_loader)
                    correct += int((pred == target).sum())
                    total += len(target)
            dptrain.print0(f"epoch {epoch}: step {step}, test accuracy {correct}/{total} = {correct / total:.3f}")
            mon.log(step, accuracy=correct / total)
            ckpt.save(step)
    ckpt.close()
    dptrain.save_model(model, f"{out}/model.safetensors")  # your module's names, no wrapper
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
