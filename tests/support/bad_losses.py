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
