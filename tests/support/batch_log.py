"""A train.loss that writes down which rows each micro-batch held (`support.batch_log:recording_loss`),
for tests that compare global batches across world sizes and resumes. Each rank appends one JSON line
per micro-batch to `$DPTRAIN_TEST_BATCH_LOG/rank<R>.jsonl`: the SHA-1 of every row's input_ids."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dptrain.train.loss import forward_loss

__all__ = ["ENV", "read_steps", "recording_loss", "row_key"]

ENV = "DPTRAIN_TEST_BATCH_LOG"


def row_key(row: torch.Tensor) -> str:
    return hashlib.sha1(row.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def recording_loss(model: Any, batch: Any, num_items_in_batch: torch.Tensor | None = None) -> torch.Tensor:
    if torch.is_grad_enabled():  # training micro-batches, not evaluation
        rank = dist.get_rank() if dist.is_initialized() else 0
        keys = [row_key(r) for r in batch["input_ids"].cpu()]
        with open(Path(os.environ[ENV]) / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(keys) + "\n")
    return forward_loss(model, batch, num_items_in_batch=num_items_in_batch)


def read_steps(folder: Path, world: int, accum: int) -> list[list[str]]:
    """Each global step's rows (sorted keys), from the ranks' logs of one run of `world` ranks
    accumulating `accum` micro-batches per step."""
    per_rank = [[json.loads(line) for line in (folder / f"rank{r}.jsonl").read_text().splitlines()]
                for r in range(world)]
    steps = len(per_rank[0]) // accum
    return [sorted(k for r in range(world) for mb in per_rank[r][s * accum : (s + 1) * accum] for k in mb)
            for s in range(steps)]
