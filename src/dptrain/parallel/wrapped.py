"""What is inside a parallelised module (plain, DDP, DataParallel, FSDP2, tensor parallel): the user's
module within a wrapper, whether its parameters are sharded, and its consolidated state dict."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP/DataParallel wrapper (FSDP2 shards in place: the module itself)."""
    return model.module if isinstance(model, DDP | nn.DataParallel) else model


def is_sharded(model: nn.Module) -> bool:
    """True when parameters are sharded across ranks: FSDP2, or tensor parallelism (DTensor parameters).
    Such a model's state goes through DCP shards."""
    module = unwrap(model)
    return isinstance(module, FSDPModule) or has_dtensor_params(module)


def has_dtensor_params(model: nn.Module) -> bool:
    """Any parameter is a DTensor (tensor parallelism, FSDP2)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The consolidated, unsharded state dict of the user's module on CPU, under the plain module's
    names. Collective under FSDP (call on every rank); the result is complete on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = unwrap(model)
    if is_sharded(module):
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}
