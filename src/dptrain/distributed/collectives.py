"""Small collective helpers that also work without a process group (then they are no-ops)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def world_size(group: Any = None) -> int:
    """Ranks in `group` (default: every rank); 1 without a process group."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: Any = None) -> int:
    """This rank's index in `group` (default: the global rank); 0 without a process group."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_reduce_mean(values: list[float], *, device: torch.device, group: Any = None) -> list[float]:
    """Mean of each value over the ranks of `group` (default: every rank; the trainer passes the
    data-parallel group), in one collective."""
    return [v / world_size(group) for v in _all_reduce(values, op=dist.ReduceOp.SUM, device=device, group=group)]


def all_reduce_max(values: list[float], *, device: torch.device, group: Any = None) -> list[float]:
    """Max of each value over the ranks of `group` (default: every rank), in one collective."""
    return _all_reduce(values, op=dist.ReduceOp.MAX, device=device, group=group)


def _all_reduce(values: list[float], *, op: Any, device: torch.device, group: Any = None) -> list[float]:
    if world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, *, src: int = 0, group: Any = None) -> Any:
    """Global rank src's object on every rank of `group` (default: every rank)."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_reduce_sum_(tensor: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group` (None: the world) in place, on its own device: no
    host-device sync. Returns it."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
