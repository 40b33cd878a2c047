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

`prepare_model` returns only the module, so it serves the strategies whose optimizer is a plain
one (single, dp, ddp, zero2, fsdp). `dptrain.parallelize(model, strategy=...)` returns the whole
`ParallelModel` (any strategy, HSDP layouts, activation checkpointing): call `.module`, build the
optimizer with `.optimizer(torch.optim.AdamW, lr=...)` (sharded under zero1), and pass the plan
itself to `sync_gradients` / `clip_grad_norm_` / `prepare_dataloader(parallel=...)`.

The loop, `loss.backward()` and `optimizer.step()` stay yours; nothing here skips a step.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from dptrain.config import Config, ConfigError, ParallelConfig, TrainConfig, resolve_batch, validate
from dptrain.config.layout import resolve_layout, strategy_mode
from dptrain.data import GlobalBatchSampler, build_dataloader
from dptrain.distributed import collectives
from dptrain.distributed.env import DistEnv
from dptrain.distributed.mesh import ParallelMesh
from dptrain.distributed.process_group import bind_device, destroy_process_group, init_process_group
from dptrain.parallel import ParallelModel, parallelize_model


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


def parallelize(
    model: nn.Module, *, strategy: str = "ddp", device: torch.device | None = None, dp_replicate: int = 1,
    dp_shard: int = 1, activation_checkpointing: str = "none", bucket_cap_mb: float = 5.0, cpu_offload: bool = False,
    fsdp_param_dtype: str | None = None, fsdp_reduce_dtype: str | None = None,
    materialize: Callable[[nn.Module], None] | None = None,
) -> ParallelModel:
    """Parallelise a plain model over the current world (after `init_distributed`) exactly as the
    Trainer does, and return the `ParallelModel`: `.module` to call, `.optimizer(cls, **kw)`,
    `.sync_gradients(sync)`, `.clip_grad_norm_(max_norm)`, `.state_dict()`, `.full_state_dict()`.
    The layout arguments mean what the `parallel.*` config fields of the same names mean."""
    import torch.distributed as dist


    cfg = ParallelConfig(
        strategy=strategy,
        bucket_cap_mb=bucket_cap_mb,
        cpu_offload=cpu_offload,
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        activation_checkpointing=activation_checkpointing,
        fsdp_param_dtype=fsdp_param_dtype,
        fsdp_reduce_dtype=fsdp_reduce_dtype,
    )
    validate(Config(parallel=cfg))
    if not dist.is_initialized():
        raise RuntimeError(
            "dptrain.parallelize needs the process group: call dptrain.init_distributed() first "
            "(without torchrun it makes a world of one)"
        )
    dims, _ = resolve_layout(cfg, world_size=dist.get_world_size())
    device = device or torch.device("cpu")
    mesh = ParallelMesh.build(dims, device_type=device.type)
    return parallelize_model(model, cfg=cfg, mesh=mesh, device=device, materialize=materialize)


def prepare_model(
    model: nn.Module,
    *,
    strategy: str = "ddp",
    device: torch.device | None = None,
    bucket_cap_mb: float = 5.0,
    cpu_offload: bool = False,
) -> nn.Module:
    """Apply a strategy (single, dp, ddp, zero2, fsdp) to a plain model and return the module to call.
    zero1 is refused: its optimizer must be sharded too, which a module alone cannot carry; use
    `dptrain.parallelize(model, strategy="zero1")` and its `.optimizer(...)`."""
    mode = strategy_mode(ParallelConfig(strategy=strategy))
    if mode.shard_optimizer:
        raise ConfigError(
            f"prepare_model(strategy={strategy!r}) cannot shard the optimizer: it returns only the module. Use "
            f"plan = dptrain.parallelize(model, strategy={strategy!r}); optimizer = plan.optimizer(torch.optim.AdamW, "
            "lr=...); call plan.module in the loop"
        )
    return parallelize(
        model, strategy=strategy, device=device, bucket_cap_mb=bucket_cap_mb, cpu_offload=cpu_offload
    ).module


def prepare_dataloader(
    dataset: Any,
    *,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    grad_accum_steps: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    start_step: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Any = None,
    parallel: ParallelModel | None = None,
) -> DataLoader:
    """A DataLoader yielding this rank's micro-batches in the world-size-invariant global order
    (reshuffled every epoch, no `set_epoch` needed). It never ends: stop after your max step.
    Batch sizes follow global = micro * accum * data-parallel size; any one may be left out. The
    data-parallel rank and size come from `parallel`'s mesh when given, else every rank is one."""
    world = parallel.mesh.dp_size if parallel is not None else collectives.world_size()
    dp_rank = parallel.mesh.dp_rank if parallel is not None else collectives.rank()
    g, m, a = resolve_batch(
        TrainConfig(
            global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps
        ),
        dp_world_size=world,
    )
    try:
        sampler = GlobalBatchSampler(
            dataset_len=len(dataset),
            global_batch_size=g,
            micro_batch_size=m,
            grad_accum_steps=a,
            dp_rank=dp_rank,
            dp_world_size=world,
            seed=seed,
            shuffle=shuffle,
            start_step=start_step,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return build_dataloader(
        dataset, sampler=sampler, num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_fn, seed=seed
    )


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
