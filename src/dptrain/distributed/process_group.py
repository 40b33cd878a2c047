"""Process-group lifetime and device binding; backend chosen by device."""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from dptrain.distributed.env import DistEnv
from dptrain.distributed.flight_recorder import enable_by_default


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
    so that DDP/FSDP code paths run unchanged in a single process. torch's flight recorder gets dptrain's
    default ring size first (distributed/flight_recorder.py)."""
    if dist.is_initialized():
        return
    enable_by_default()  # the collective ring the desync watchdog compares (a small one, unless the user set one)
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    if env.launched:
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs
        )


# How long teardown yields the GIL before the process group goes (see destroy_process_group).
_SETTLE_S = 0.05


def destroy_process_group() -> None:
    """Leave the process group. First sleep briefly with the GIL released: a gloo worker thread may
    still be freeing the last finished collective, which needs the GIL when the work holds tensors
    Python has seen (DDP's gradient buckets). If the caller then frees the last reference to the
    group (e.g. a DDP model going out of scope), ProcessGroupGloo's destructor joins that thread
    while holding the GIL, and both wait forever (observed on a loaded 2-core machine)."""
    if dist.is_initialized():
        time.sleep(_SETTLE_S)
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(env: DistEnv, *, backend: str, device: torch.device, timeout_s: float) -> Iterator[None]:
    """init on enter, destroy on exit (also on error, so no process group leaks into the next run)."""
    init_process_group(env, backend=backend, device=device, timeout_s=timeout_s)
    try:
        yield
    finally:
        destroy_process_group()
