"""`zero1`: ZeRO stage 1 folded into DDP. The optimizer state is partitioned over the
data-parallel ranks with `ZeroRedundancyOptimizer`; each rank updates its slice of the
parameters and broadcasts it. Gradients are still all-reduced in full by DDP."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer


def zero_redundancy_optimizer(
    groups: list[dict[str, Any]], *, optimizer_class: type[torch.optim.Optimizer], process_group: Any = None,
    **defaults: Any,
) -> ZeroRedundancyOptimizer:
    """`optimizer_class` over the param `groups`, its state sharded over `process_group` (default: every rank).
    ZeroRedundancyOptimizer takes one group at construction; the rest are added after it."""
    first = groups[0]
    extra = {k: v for k, v in first.items() if k != "params"}
    opt = ZeroRedundancyOptimizer(first["params"], optimizer_class=optimizer_class, process_group=process_group,
                                  **{**defaults, **extra})
    for g in groups[1:]:
        opt.add_param_group(g)
    return opt
