"""`ddp` and `zero1`: DistributedDataParallel, one replica per data-parallel rank, gradients
all-reduced in buckets over the data-parallel group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(
    model: nn.Module, *, device: torch.device, bucket_cap_mb: float = 5.0, process_group: Any = None,
    materialize: Callable[[nn.Module], None] | None = None, gradient_as_bucket_view: bool = True,
    static_graph: bool = False,
) -> DDP:
    """Wrap `model` in DDP over `process_group` (default: every rank). By default gradients become
    bucket views (one less copy per step; parallel.gradient_as_bucket_view); `static_graph`: DDP's
    static-graph mode (parallel.static_graph; measured in docs/results/communication.md).
    Meta parameters are materialised first: DDP broadcasts rank 0's parameters at construction, so
    they must exist by then."""
    if any(p.is_meta for p in model.parameters()):
        if materialize is None:
            raise ValueError(
                "the model's parameters are on the meta device: pass materialize= to allocate and initialise them"
            )
        materialize(model)
    model = model.to(device)
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
        process_group=process_group,
    )


def apply_ddp_over_tp(
    model: nn.Module, *, device: torch.device, mesh: Any, materialize: Callable[[nn.Module], None] | None = None
) -> nn.Module:
    """Data-parallel replicas of a tensor-parallel model over the 1-D data-parallel `mesh` (sliced
    from the same root mesh as the tp mesh): PyTorch's FSDP2-based `replicate`
    (torch.distributed._composable.replicate_with_fsdp), which keeps the parameters DTensors on the
    2-D (dp, tp) mesh and all-reduces their gradients over dp, as torchtitan's DDP does. Not the
    DDP class: its `_pre_dp_module_transform` swaps the parameters for new local tensors in every
    forward, so state dicts (DCP) see no parameters. Parameters on meta are materialised after."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and materialize is None:
        raise ValueError(
            "the model's parameters are on the meta device: pass materialize= to allocate and initialise them"
        )
    if not on_meta:
        model = model.to(device)
    replicate(model, mesh=mesh)
    if on_meta:
        assert materialize is not None
        materialize(model)
    return model
