"""`ddp`: DistributedDataParallel, one replica per rank, gradients all-reduced in buckets."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(model: nn.Module, *, device: torch.device, bucket_cap_mb: float = 25.0) -> nn.Module:
    """Wrap `model` in DDP. Gradients become bucket views (one less copy per step)."""
    model = model.to(device)
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,
    )
