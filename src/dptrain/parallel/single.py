"""`single`: one process, one device, the model as it is. The parity reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def apply_single(
    model: nn.Module, *, device: torch.device, materialize: Callable[[nn.Module], None] | None = None
) -> nn.Module:
    if any(p.is_meta for p in model.parameters()):
        if materialize is None:
            raise ValueError(
                "the model's parameters are on the meta device: pass materialize= to allocate and initialise them"
            )
        materialize(model)
    return model.to(device)
