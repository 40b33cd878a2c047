"""The validation loss of a run (`Trainer.evaluate`): the same fixed samples every time, split evenly
over the data-parallel ranks, one all-reduce of the mean at the end. Under pipeline parallelism the
schedule's forward-only path computes it (loss on every stage); under tensor parallelism the loss
runs inside the plan's `loss_context` (vocabulary-sharded logits)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dptrain.config import PrecisionConfig
from dptrain.distributed import collectives
from dptrain.distributed.mesh import ParallelMesh
from dptrain.parallel import ParallelModel
from dptrain.parallel.pipeline import PipelineModel
from dptrain.train.build import to_device
from dptrain.train.loss import LossFn
from dptrain.train.precision import autocast


@torch.no_grad()
def evaluate(
    plan: ParallelModel, val_ds: Any, *, loss_fn: LossFn, collate: Callable[[list[Any]], Any] | None,
    precision: PrecisionConfig, eval_batches: int, micro_batch_size: int, dp_world_size: int, mesh: ParallelMesh,
    device: torch.device, phase: Callable[[str], None],
) -> float | None:
    """Mean validation loss over `eval_batches` micro-batches per data-parallel rank (fewer when the
    validation set is smaller), or None without validation data. `phase`: the diagnostics' heartbeat."""
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
        batch = to_device(batch, device)
        if isinstance(plan, PipelineModel):  # the schedule's forward-only path; loss on every stage
            total += plan.eval_loss(batch, context=lambda: autocast(precision, device)).double()
            continue
        with autocast(precision, device), plan.loss_context():  # loss parallelism (tp)
            total += loss_fn(model, batch).double()
    model.train()
    return collectives.all_reduce_mean([total.item() / n_batches], device=device, group=mesh.dp_group)[0]
