"""Process-group lifetime and device binding; backend chosen by device."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import torch
import torch.distributed as dist

from dptrain.dist.env import DistEnv


def bind_device(env: DistEnv, device: str) -> torch.device:
    """The device this rank computes on: cuda:<local_rank> on GPUs (set as current), else cpu."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
        if env.local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"local rank {env.local_rank} has no GPU: this node has {torch.cuda.device_count()} GPU(s); "
                "use --nproc-per-node <= the GPU count"
            )
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_process_group(env: DistEnv, *, backend: str, device: torch.device, timeout_s: float) -> None:
    """Join the job's process group. Without a launcher, make a world of one over an in-memory store
    so that DDP/FSDP code paths run unchanged in a single process."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if env.launched:
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(env: DistEnv, *, backend: str, device: torch.device, timeout_s: float) -> Iterator[None]:
    """init on enter, destroy on exit (also on error, so no process group leaks into the next run)."""
    init_process_group(env, backend=backend, device=device, timeout_s=timeout_s)
    try:
        yield
    finally:
        destroy_process_group()
