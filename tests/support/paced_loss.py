"""A loss for the elastic tests: the model's own loss, slowed down while the file named by
DPTRAIN_TEST_PACE_FILE exists (so a test decides how long a run lasts without changing its math)."""

from __future__ import annotations

import os
import time

SLEEP_S = 0.25


def paced_loss(model, batch):
    pace = os.environ.get("DPTRAIN_TEST_PACE_FILE")
    if pace and os.path.exists(pace):
        time.sleep(SLEEP_S)
    return model(batch)
