"""The validation loss of a run (`Trainer.evaluate`): the same fixed samples every time, split evenly
over the data-parallel ranks, one all-reduce of the mean at the end. Each batch's loss comes from
the model's `eval_loss` (parallel/model.py): under tensor parallelism inside its loss context
(vocabulary-sharded logits), under pipeline parallelism the schedule's forward-only path (the loss
on every stage)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from dptrain.distributed import collectives
from dptrain.distributed.mesh import ParallelMesh
from dptrain.parallel import ParallelModel
from dptrain.train.loss import LossFn


@torch.no_grad()
def evaluate(
    plan: ParallelModel, val_ds: Any, *, loss_fn: LossFn, collate: Callable[[list[Any]], Any] | None,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext, eval_batches: int,
    micro_batch_size: int, dp_world_size: int, mesh: ParallelMesh, device: torch.device, phase: Callable[[str], None],
) -> float | None:
    """Mean validation loss over `eval_batches` micro-batches per data-parallel rank (fewer when the
    validation set is smaller), or None without validation data. `context()`: around each forward
    (autocast); `phase`: the diagnostics' heartbeat."""
    if val_ds is None:
        return None
    mb, world = micro_batch_size, dp_world_size
    n_batches = min(eval_batches, len(val_ds) // (mb * world))
    if n_batches == 0:
        return None
    model = plan.module
    model.eval()
    per_rank = n_batches * mb
    first = mesh.dp_rank * per_rank
    total = torch.zeros((), device=device, dtype=torch.float64)
    for b in range(n_batches):
        phase("eval")
        idx = range(first + b * mb, first + (b + 1) * mb)
        batch = (collate or torch.utils.data.default_collate)([val_ds[i] for i in idx])
        total += plan.eval_loss(batch, loss_fn=loss_fn, context=context).double()
    model.train()
    return collectives.all_reduce_mean([total.item() / n_batches], device=device, group=mesh.dp_group)[0]
