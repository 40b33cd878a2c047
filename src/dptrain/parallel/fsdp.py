"""`zero2` and `fsdp`: FSDP2 `fully_shard` on every repeated block, then on the root.

`fsdp` (ZeRO-3) frees the gathered parameters after forward; `zero2` keeps them until
backward (`reshard_after_forward=False`): gradients and optimizer state stay sharded,
parameters are gathered once per step. `cpu_offload` keeps the shards on the host. A model on
the meta device is sharded there; `dptrain.parallel.materialize` then allocates and fills the shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the members of every nn.ModuleList in the model."""
    units: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            units.extend(module)
    return units


def apply_fsdp(
    model: nn.Module, *, device: torch.device, reshard_after_forward: bool = True, cpu_offload: bool = False
) -> nn.Module:
    """Shard `model` over all ranks in place and return it (now also an FSDPModule)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        # pinned host memory only helps (and only exists) with an accelerator to copy to
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    elif not any(p.is_meta for p in model.parameters()):  # a meta model is materialized after sharding
        model = model.to(device)
    for unit in shard_units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model
