"""Writing and reading the tensors of a checkpoint: full state or DCP shards.

Two formats, chosen by the model, never by the strategy name:

- `full` (plain module, DDP, ZeRO-1): rank 0 writes `model.pt` (the plain module's state dict)
  and `optim.pt` (the optimizer's; ZeRO-1 first consolidates its shards on rank 0). Any world
  size loads them: DDP replicas load the same file, ZeRO-1 re-partitions the full state.
- `dcp` (FSDP2: zero2/fsdp): every rank writes its shards under `dcp/` with
  `torch.distributed.checkpoint`, from `get_state_dict` (names of the plain module); loading
  reshards to the current world size and `set_state_dict` puts the values in place.

Every file is read with `torch.load(weights_only=True)` (DCP through `safe_dcp`).
"""

from __future__ import annotations

import copy
import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from dptrain.checkpoint.manifest import CheckpointError
from dptrain.parallel import is_sharded, unwrap

FULL = "full"
SHARDED = "dcp"
DCP_DIR = "dcp"


def state_format(model: nn.Module) -> str:
    """`dcp` for a sharded (FSDP2) model, `full` otherwise."""
    return SHARDED if is_sharded(unwrap(model)) else FULL


def save_torch(path: Path, obj: Any) -> None:
    """torch.save to `path`, flushed and fsynced (the manifest is written only after this)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def load_torch(path: Path) -> Any:
    """torch.load with the weights-only unpickler, always; onto the CPU."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # the weights-only unpickler refuses anything but tensors and plain data
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True): {e}") from None


def save_model_optim(ckpt_dir: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    """Write model and optimizer state in the model's format. Collective: call on every rank."""
    if state_format(model) == SHARDED:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(ckpt_dir / DCP_DIR, sync_files=True))
        return
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)  # collective: every rank sends its shard to rank 0
    if rank == 0:
        save_torch(ckpt_dir / "model.pt", {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()})
        save_torch(ckpt_dir / "optim.pt", optimizer.state_dict())


def async_save_model_optim(
    ckpt_dir: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, process_group: Any,
    executor: ThreadPoolExecutor,
) -> Future:
    """Like `save_model_optim`, but only the snapshot is taken now (collective); the files are written
    in the background. The Future is done when this rank's files are on disk (fsynced).

    DCP: `dcp.async_save` stages the shards to CPU memory, then writes them in its own thread,
    coordinating over `process_group` (a dedicated gloo group, so the training's collectives never
    interleave with the checkpoint's). Full: rank 0 clones model and optimizer state, a thread writes."""
    if state_format(model) == SHARDED:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizer)
        writer = dcp.FileSystemWriter(ckpt_dir / DCP_DIR, sync_files=True)
        # AsyncSaveResponse is returned only with an async_stager's staging future, which is not asked for.
        return cast(Future, dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer,
                                           process_group=process_group))
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
    done: Future = Future()
    if rank != 0:
        done.set_result(None)
        return done
    model_sd = {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}
    optim_sd = copy.deepcopy(optimizer.state_dict())  # the live state keeps changing while we write

    def write() -> None:
        save_torch(ckpt_dir / "model.pt", model_sd)
        save_torch(ckpt_dir / "optim.pt", optim_sd)

    return executor.submit(write)


def load_model_optim(ckpt_dir: Path, *, fmt: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model and optimizer state written by `save_model_optim` (possibly at another world size)."""
    here = state_format(model)
    if fmt != here:
        raise CheckpointError(
            f"{ckpt_dir}: written in the {fmt!r} format but this strategy reads {here!r}; resume with a strategy "
            f"of the same kind (full: single/ddp/zero1; dcp: zero2/fsdp), or export the weights with `dptrain ckpt export`"
        )
    if fmt == SHARDED:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from dptrain.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

        msd, osd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt_dir / DCP_DIR), planner=SafeLoadPlanner())
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return
    unwrap(model).load_state_dict(load_torch(ckpt_dir / "model.pt"))
    optimizer.load_state_dict(load_torch(ckpt_dir / "optim.pt"))


def load_full_model_state(ckpt_dir: Path, *, fmt: str) -> dict[str, torch.Tensor]:
    """The consolidated model state dict of a checkpoint of either format, without a process group
    (for export). DCP shards are assembled by reading every tensor in full."""
    if fmt == FULL:
        return load_torch(ckpt_dir / "model.pt")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dptrain.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    reader = SafeFileSystemReader(ckpt_dir / DCP_DIR)
    meta = reader.read_metadata()
    state: dict[str, Any] = {"model": {}}
    for key, item in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            state["model"][key[len("model."):]] = torch.empty(item.size, dtype=item.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return state["model"]
