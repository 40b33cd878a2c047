"""The evaluation of a run (`Trainer.evaluate`): the validation loss and `train.eval_fn`'s metrics over the
same fixed samples every time. Each batch's loss comes from the model's `eval_loss` (parallel/model.py):
under tensor parallelism inside its loss context (vocabulary-sharded logits), under pipeline parallelism
the schedule's forward-only path (the loss on every stage).

Which samples: `train.eval_batches` micro-batches per data-parallel rank, split evenly (the default;
the set depends on the world size), or with `train.eval_samples` the first N samples of the validation
set in contiguous shards, one per data-parallel rank, of sizes that differ by at most one. Every value
is summed weighted by its batch's sample count and reduced once over the ranks (one all-reduce of
[count, loss sum, metric sums]), so no sample counts twice or not at all and the result is the same at
any world size. Every rank runs the same number of forwards (FSDP2 gathers parameters in each one): a
rank whose shard ran out repeats a batch with weight 0."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from dptrain.config import ConfigError
from dptrain.distributed import collectives
from dptrain.distributed.mesh import ParallelMesh
from dptrain.parallel import ParallelModel
from dptrain.train.loss import LossFn

EvalFn = Callable[[torch.nn.Module, Any], Mapping[str, Any]]


@dataclass
class Evaluation:
    """One evaluation: the mean loss and each metric's sample-weighted mean (names as eval_fn returns them)."""

    loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    samples: int = 0


def shard_indices(n: int, *, dp_rank: int, dp_size: int, micro_batch_size: int) -> tuple[list[range], int]:
    """This rank's micro-batches of the first `n` samples (contiguous shard [r*n//W, (r+1)*n//W)) and the number of
    forwards every rank runs (the longest shard's batch count)."""
    lo, hi = dp_rank * n // dp_size, (dp_rank + 1) * n // dp_size
    per_rank = math.ceil(n / dp_size)
    n_batches = math.ceil(per_rank / micro_batch_size)
    return [range(s, min(s + micro_batch_size, hi)) for s in range(lo, hi, micro_batch_size)], n_batches


@torch.no_grad()
def evaluate(
    pmodel: ParallelModel, val_ds: Any, *, loss_fn: LossFn, collate: Callable[[list[Any]], Any] | None,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext, eval_batches: int,
    micro_batch_size: int, dp_world_size: int, mesh: ParallelMesh, device: torch.device, phase: Callable[[str], None],
    eval_fn: EvalFn | None = None, eval_samples: int | None = None,
) -> Evaluation | None:
    """The validation loss and `eval_fn`'s metrics over the evaluation samples (see the module docstring), or None
    without validation data. `context()`: around each forward (autocast); `phase`: the diagnostics' heartbeat."""
    if val_ds is None:
        return None
    mb, world = micro_batch_size, dp_world_size
    if eval_samples is None:  # eval_batches micro-batches per rank, all ranks equal (the set depends on the world)
        n_batches = min(eval_batches, len(val_ds) // (mb * world))
        first = mesh.dp_rank * n_batches * mb
        batches = [range(first + b * mb, first + (b + 1) * mb) for b in range(n_batches)]
    else:
        n = len(val_ds) if eval_samples == -1 else min(eval_samples, len(val_ds))
        batches, n_batches = shard_indices(n, dp_rank=mesh.dp_rank, dp_size=world, micro_batch_size=mb)
    if n_batches == 0:
        return None
    model = pmodel.module
    model.eval()
    count = torch.zeros((), device=device, dtype=torch.float64)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    sums: dict[str, torch.Tensor] = {}
    make = collate or torch.utils.data.default_collate
    for b in range(n_batches):
        phase("eval")
        idx = batches[b] if b < len(batches) else None
        weight = len(idx) if idx else 0  # 0: this rank's shard ran out; its forward keeps FSDP's collectives aligned
        batch = make([val_ds[i] for i in (idx or (batches[-1] if batches else range(1)))])
        count += weight
        loss_sum += pmodel.eval_loss(batch, loss_fn=loss_fn, context=context).double() * weight
        if eval_fn is not None:
            out = pmodel.eval_loss(batch, loss_fn=cast(LossFn, eval_fn), context=context)
            for name, value in _metrics(out).items():
                sums[name] = sums.get(name, torch.zeros((), device=device, dtype=torch.float64)) + value * weight
    model.train()
    names = sorted(sums)
    totals = torch.stack([count, loss_sum, *(sums[k] for k in names)])
    collectives.all_reduce_sum_(totals, group=mesh.dp_group)  # one collective, on the device
    values = totals.tolist()
    n_seen = values[0]
    return Evaluation(loss=values[1] / n_seen, metrics={k: v / n_seen for k, v in zip(names, values[2:], strict=True)},
                      samples=int(n_seen))


def summarize(fn: Callable[[dict[str, float]], Mapping[str, Any]], metrics: dict[str, float]) -> dict[str, float]:
    """`train.eval_summary(metrics)`: more metrics computed from the aggregated means, as floats."""
    out = fn(dict(metrics))
    if not isinstance(out, Mapping):
        raise ConfigError(f"train.eval_summary returned {type(out).__name__}; it must return {{name: number}}")
    try:
        return {str(k): float(v) for k, v in out.items()}
    except (TypeError, ValueError) as e:
        raise ConfigError(f"train.eval_summary returned a value that is not a number: {e}") from None


def _metrics(out: Any) -> dict[str, torch.Tensor]:
    """eval_fn's {name: batch mean} as float64 scalars on their device; anything else is a ConfigError."""
    if not isinstance(out, Mapping) or not out:
        raise ConfigError(f"train.eval_fn returned {type(out).__name__}; it must return a non-empty mapping {{name: "
                          "the batch's mean of a per-sample value}, e.g. {'accuracy': (pred == y).float().mean()}")
    metrics = {}
    for name, value in out.items():
        t = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value)
        if not isinstance(name, str) or t.numel() != 1:
            raise ConfigError(f"train.eval_fn returned {name!r}: {tuple(t.shape)} values; each metric must be one "
                              "number (the batch's mean), keyed by a name")
        metrics[name] = t.reshape(()).double()
    return metrics
