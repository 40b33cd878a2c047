"""`single`: one process, one device, the model as it is. The parity reference."""

from __future__ import annotations

import torch
from torch import nn


def apply_single(model: nn.Module, *, device: torch.device) -> nn.Module:
    return model.to(device)
