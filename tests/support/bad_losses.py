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


_TRAINING_CALLS = [0]


def nan_loss_on_rank_1_from_step_2(model, batch):
    """NaN from rank 1's data at its second training micro-batch (step 2 without accumulation) and after: DDP's
    averaged gradients then spread it to every rank's weights, so rank 0's loss follows a step later."""
    import torch.distributed as dist

    loss = model(batch)
    if torch.is_grad_enabled():
        _TRAINING_CALLS[0] += 1
        if dist.get_rank() == 1 and _TRAINING_CALLS[0] >= 2:
            return loss * float("nan")
    return loss
