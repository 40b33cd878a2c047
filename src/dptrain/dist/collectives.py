"""Small collective helpers that also work without a process group (then they are no-ops)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_reduce_mean(values: list[float], *, device: torch.device) -> list[float]:
    """Mean of each value over ranks, in one collective."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / world_size()).tolist()


def all_reduce_sum(values: list[float], *, device: torch.device) -> list[float]:
    """Sum of each value over ranks, in one collective."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def broadcast_object(obj: Any, *, src: int = 0) -> Any:
    """rank src's object on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
