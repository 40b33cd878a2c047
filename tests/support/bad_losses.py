"""Losses that only a running worker can find wrong (train.loss=bad_losses:NAME in tests)."""

from __future__ import annotations

import torch


def per_sample_loss(model, batch):
    """One loss per sample: forgot the reduction."""
    x, y = batch
    losses = torch.stack([model((x[i : i + 1], y[i : i + 1])) for i in range(len(x))])
    return losses  # shape (micro_batch,), not a scalar


def nan_loss(model, batch):
    """NaN from the first step on."""
    return model(batch) * float("nan")


def nan_loss_on_rank_1(model, batch):
    """NaN from the first step on, from rank 1's data only (DDP then spreads it to every rank's weights)."""
    import torch.distributed as dist

    loss = model(batch)
    return loss * float("nan") if dist.get_rank() == 1 else loss
