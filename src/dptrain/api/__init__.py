"""The small explicit API for people who keep their own training loop.

    runtime = dptrain.init_distributed()                      # process group + device from torchrun's env
    model = dptrain.parallelize(model, strategy="ddp", device=runtime.device).module  # or keep the ParallelModel
    loader = dptrain.prepare_dataloader(dataset, global_batch_size=64, micro_batch_size=64)
    ckpt = dptrain.Checkpointer("runs/x", model, optimizer, scheduler, loader)
    step = ckpt.resume()                                      # 0, or where the last run was saved
    for epoch in dptrain.epochs(loader, 10):                  # a resumed run finishes its epoch first
        for x, y in loader:                                   # ends at the end of the epoch
            loss = loss_fn(model(x.to(runtime.device)), y.to(runtime.device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
        scheduler.step()
        ckpt.save(step)

Modules: `setup` (process group, `parallelize`: the one way to parallelise a model, its `.module` passing
your attributes through),
`loaders` (training loader with epochs and exact resume, sharded evaluation loader, `micro_steps`,
`epochs`, `check_loader`), `checkpointer` (`Checkpointer`, `rng_state`), `runtime` (`print0`, `barrier`, `broadcast`,
`all_reduce_mean`, `gather_for_metrics`, `mixed_precision`, `save_model`), `loop_monitor` (hang watchdog and
metrics.jsonl). The loop, `loss.backward()` and `optimizer.step()` stay yours; nothing here skips a step.
"""

from dptrain.api.checkpointer import Checkpointer, rng_state
from dptrain.api.loaders import (
    check_loader,
    epochs,
    grad_accum_steps,
    micro_steps,
    prepare_dataloader,
    prepare_eval_dataloader,
)
from dptrain.api.loop_monitor import LoopMonitor, monitor
from dptrain.api.runtime import (
    MixedPrecision,
    all_reduce_mean,
    barrier,
    broadcast,
    gather_for_metrics,
    mixed_precision,
    print0,
    save_model,
)
from dptrain.api.setup import Runtime, init_distributed, parallel_model_of, parallelize

__all__ = [
    "Checkpointer",
    "LoopMonitor",
    "MixedPrecision",
    "Runtime",
    "all_reduce_mean",
    "barrier",
    "broadcast",
    "check_loader",
    "epochs",
    "gather_for_metrics",
    "grad_accum_steps",
    "init_distributed",
    "micro_steps",
    "mixed_precision",
    "monitor",
    "parallelize",
    "parallel_model_of",
    "prepare_dataloader",
    "prepare_eval_dataloader",
    "print0",
    "rng_state",
    "save_model",
]
