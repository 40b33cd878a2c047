"""The state dicts the in-memory snapshots copy at every step, taken cheaply.

DCP's state-dict helpers (what a checkpoint on disk holds: `storage.full_state_dicts`, `storage.dcp_state`) walk
the whole module and optimizer at each call: 3-5 ms for the built-in recipe, at every step a snapshot is due. The
module's and the optimizer's own `state_dict` (the optimizer's re-keyed by parameter name) hold the same tensors
for a fraction of a millisecond. `LiveState` takes those once they have agreed with DCP's, checked at the first
call on every rank (one collective), and DCP's otherwise. ZeRO-1's optimizer (its state is consolidated by a
collective), model parts (pipeline stages) and DCP's flattened optimizer layout always take DCP's.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from dptrain.checkpoint.state import CheckpointState, ModelState, OptimizerState, RngState
from dptrain.checkpoint.storage import dcp_state, full_state_dicts, optim_name, optimizer_layout
from dptrain.distributed import collectives


def live_state(state: CheckpointState, *, rank: int) -> dict[str, Any] | None:
    """What `reference_state` returns, from the module's and optimizers' own state dicts (not collective), or None
    where that does not apply."""
    models, optims = state.model_parts, state.optimizers
    plain = len(models) == 1 and isinstance(models[0], ModelState) and all(
        isinstance(o, OptimizerState) and not isinstance(o.optimizer, ZeroRedundancyOptimizer)
        and (state.full or not o.flat) for o in optims)
    if not plain:
        return None
    model = cast(ModelState, models[0])
    named = [(optim_name(i), cast(OptimizerState, o)) for i, o in enumerate(optims)]
    if not state.full:
        return {"model": model.live_state_dict(), **{name: o.live_state_dict() for name, o in named}}
    if rank != 0:
        return {}
    return {"model.pt": model.live_state_dict(), **{f"{name}.pt": o.live_state_dict() for name, o in named}}


def reference_state(state: CheckpointState, *, rank: int) -> dict[str, Any]:
    """DCP's: the `full` format's files (rank 0's; collective for ZeRO-1) or the `dcp` format's state dict."""
    return full_state_dicts(state, rank=rank) if state.full else dcp_state(state)


class LiveState:
    """`live_state` once every rank found it equal to `reference_state` (at the first call), else the reference."""

    def __init__(self) -> None:
        self.agreed: bool | None = None

    def __call__(self, state: CheckpointState, *, rank: int) -> dict[str, Any]:
        if self.agreed:
            return cast(dict[str, Any], live_state(state, rank=rank))
        reference = reference_state(state, rank=rank)
        if self.agreed is None:
            live = live_state(state, rank=rank)
            mine = float(live is not None and same_tree(live, reference))
            self.agreed = collectives.all_reduce_mean([mine], device=torch.device("cpu"))[0] == 1.0
        return reference


def same_tree(a: Any, b: Any) -> bool:
    """Whether two state trees hold the same keys, values and tensors (dtype, shape and values; a DTensor's mesh,
    placements and this rank's shard: no collective)."""
    if isinstance(a, DTensor) or isinstance(b, DTensor):
        return (isinstance(a, DTensor) and isinstance(b, DTensor) and a.device_mesh == b.device_mesh
                and a.placements == b.placements and a.shape == b.shape and same_tree(a.to_local(), b.to_local()))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def snapshot_files(state: CheckpointState, live: LiveState, *, rank: int, version: int,
                   pipeline: bool) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
    """This rank's share of a checkpoint, as live state (the in-memory snapshot copies it): its files (full
    format: rank 0's model and optimizer files; rank 0's train.pt; its rank file), the `dcp` format's model
    and optimizer shards (None in the full format), and the format version they are in (`version`: the
    manager's current one). The state dicts are the module's and optimizer's own once they have matched DCP's
    (`live`). Shards of ranks that all hold the same parameters use DCP's nested optimizer layout (format
    version 2), which those own state dicts have; pipeline stages need the flattened one (version 3), from DCP's
    helpers."""
    files = live(state, rank=rank) if state.full else {}
    shards = None
    if not state.full:
        version = version if pipeline else 2
        with optimizer_layout(state, flat=version >= 3):
            shards = live(state, rank=rank)
    if rank == 0:
        scaler = state.scaler.state_dict() if state.scaler is not None else None
        files["train.pt"] = {"scheduler": state.schedule.state_dict(), "scaler": scaler or None}
        files.update(state.extra_files)
    own = {"rng": RngState().state_dict(), **{name: obj.state_dict() for name, obj in state.per_rank.items()}}
    files[f"rank_{rank:05d}.pt"] = own
    return files, shards, version
