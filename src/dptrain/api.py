"""The small explicit API for people who keep their own training loop.

    runtime = dptrain.init_distributed()                      # process group + device from torchrun's env
    model = dptrain.prepare_model(model, strategy="ddp", device=runtime.device)
    loader = dptrain.prepare_dataloader(dataset, global_batch_size=64, micro_batch_size=16)
    accum = dptrain.grad_accum_steps(loader)
    for step, micro, batch in dptrain.micro_steps(loader, max_steps=1000):
        with dptrain.sync_gradients(model, micro == accum - 1):
            loss = model(batch.to(runtime.device)) / accum
            loss.backward()
        if micro == accum - 1:
            dptrain.clip_grad_norm_(model, 1.0)
            optimizer.step()
            optimizer.zero_grad()

The loop, `loss.backward()` and `optimizer.step()` stay yours; nothing here skips a step.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from dptrain.config import ConfigError, ParallelConfig, TrainConfig, resolve_batch
from dptrain.data import GlobalBatchSampler, build_dataloader
from dptrain.distributed import collectives
from dptrain.distributed.env import DistEnv
from dptrain.distributed.process_group import bind_device, destroy_process_group, init_process_group
from dptrain.parallel import apply_strategy


@dataclass(frozen=True)
class Runtime:
    """What `init_distributed` set up: this process's place in the job and its device."""

    env: DistEnv
    device: torch.device

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.is_main


def init_distributed(*, device: str = "auto", backend: str = "auto", timeout_s: float = 600.0) -> Runtime:
    """Join the job torchrun started (or a world of one without torchrun) and bind this rank's device.
    The process group is destroyed at interpreter exit."""
    env = DistEnv.from_env()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    dev = bind_device(env, device)
    init_process_group(env, backend=backend, device=dev, timeout_s=timeout_s)
    atexit.register(destroy_process_group)
    return Runtime(env=env, device=dev)


def prepare_model(
    model: nn.Module, *, strategy: str = "ddp", device: torch.device | None = None,
    bucket_cap_mb: float = 25.0, cpu_offload: bool = False,
) -> nn.Module:
    """Apply a strategy (single, dp, ddp, zero1, zero2, fsdp) to a plain model and return the module to
    call. For zero1, shard the optimizer with `torch.distributed.optim.ZeroRedundancyOptimizer`."""
    cfg = ParallelConfig(strategy=strategy, bucket_cap_mb=bucket_cap_mb, cpu_offload=cpu_offload)
    return apply_strategy(model, cfg=cfg, device=device or torch.device("cpu"))


def prepare_dataloader(
    dataset: Any, *, global_batch_size: int | None = None, micro_batch_size: int | None = None,
    grad_accum_steps: int | None = None, seed: int = 0, shuffle: bool = True, start_step: int = 0,
    num_workers: int = 0, pin_memory: bool = False, collate_fn: Any = None,
) -> DataLoader:
    """A DataLoader yielding this rank's micro-batches in the world-size-invariant global order
    (reshuffled every epoch, no `set_epoch` needed). It never ends: stop after your max step.
    Batch sizes follow global = micro * accum * world size; any one may be left out."""
    world = collectives.world_size()
    g, m, a = resolve_batch(
        TrainConfig(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps),
        dp_world_size=world,
    )
    try:
        sampler = GlobalBatchSampler(
            dataset_len=len(dataset), global_batch_size=g, micro_batch_size=m, grad_accum_steps=a,
            dp_rank=collectives.rank(), dp_world_size=world, seed=seed, shuffle=shuffle, start_step=start_step,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return build_dataloader(dataset, sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                            collate_fn=collate_fn, seed=seed)


def grad_accum_steps(loader: DataLoader) -> int:
    """Micro-batches per optimizer step of a loader made by `prepare_dataloader`."""
    return loader.batch_sampler.grad_accum_steps  # type: ignore[union-attr]


def micro_steps(loader: DataLoader, *, max_steps: int) -> Iterator[tuple[int, int, Any]]:
    """(step, micro, batch) for `max_steps` optimizer steps, continuing from the loader's start step."""
    sampler: GlobalBatchSampler = loader.batch_sampler  # type: ignore[assignment]
    accum = sampler.grad_accum_steps
    step = sampler.start_step
    it = iter(loader)
    while step < max_steps:
        for micro in range(accum):
            yield step, micro, next(it)
        step += 1
