"""A user's own tensor-parallel plan (`parallel.tp_plan=support.tp_plans:mlp_plan`) for the toy MLP of the tests."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def mlp_plan(model: nn.Module, tp_mesh) -> None:
    """The first hidden layer column-wise, the second row-wise (one all-reduce after it); the head replicated."""
    parallelize_module(model, tp_mesh, {"layers.0.fc": ColwiseParallel(), "layers.1.fc": RowwiseParallel()})


not_callable = 3
