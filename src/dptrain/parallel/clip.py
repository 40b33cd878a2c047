"""Clipping that is correct on any parallelised module (plain, DDP, DataParallel, FSDP2, tensor
parallel): the global gradient norm over every shard and mesh, then one scale per mesh."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def clip_grad_norm_(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """Clip to the global norm over all ranks' shards and return that norm (a plain tensor).

    Gradients may be plain tensors (full replicas), and DTensors on several meshes at once (FSDP2
    on dp_shard, tensor parallelism on tp, both on the 2-D (dp_shard, tp) mesh: a norm parameter
    left out of the tp plan sits on the dp mesh only). torch's norm helpers need one mesh per
    call, so the norm is taken per mesh, made whole by DTensor (`full_tensor`: the reduction over
    that mesh's shards), and combined; every rank then clips by the same factor. max_norm=None
    only measures the norm.
    """
    norm, groups = grad_norm(model)
    if max_norm is not None:
        clip_grads_with_norm_(groups, max_norm, norm)
    return norm


GradGroups = dict[object, list[nn.Parameter]]
"""Parameters with a gradient, by the gradient's mesh (None: plain tensors)."""


def grad_norm(model: nn.Module) -> tuple[torch.Tensor, GradGroups]:
    """(this model's gradient norm over all ranks' shards, as a plain tensor; its parameters by
    gradient mesh, for `clip_grads_with_norm_`). Collective over each DTensor mesh."""
    groups: GradGroups = {}
    for p in model.parameters():
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(()), groups
    return (torch.nn.utils.get_total_norm(norms) if len(norms) != 1 else norms[0]), groups


def clip_grads_with_norm_(groups: GradGroups, max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient by max_norm / norm (when above), one call per mesh."""
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
