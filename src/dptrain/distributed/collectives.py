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
    return [v / world_size() for v in _all_reduce(values, op=dist.ReduceOp.SUM, device=device)]


def all_reduce_max(values: list[float], *, device: torch.device) -> list[float]:
    """Maximum of each value over ranks, in one collective (flags: any rank set it)."""
    return _all_reduce(values, op=dist.ReduceOp.MAX, device=device)


def _all_reduce(values: list[float], *, op: Any, device: torch.device) -> list[float]:
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, *, src: int = 0) -> Any:
    """rank src's object on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum_(tensor: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group` (None: the world) in place, on its own device: no
    host-device sync. Returns it."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
