"""A loss for end-to-end tests that makes steps slow enough to signal a worker mid-run."""

from __future__ import annotations

import time

SLEEP_S = 0.02


def slow_loss(model, batch):
    """The model's own loss, after a short sleep."""
    time.sleep(SLEEP_S)
    return model(batch)
