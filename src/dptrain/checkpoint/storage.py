"""Writing and reading the tensors of a checkpoint: full state or DCP shards.

Two formats, chosen by the model, never by the strategy name:

- `full` (plain module, DDP, ZeRO-1): rank 0 writes `model.pt` (the model parts' full state
  dicts, plain module names) and `optim.pt` (the optimizer's, keyed by parameter name; ZeRO-1
  first consolidates its shards on rank 0; `optim_1.pt`... for further optimizers). Any world
  size loads them: DDP replicas load the same file, ZeRO-1 re-partitions the full state.
  Format version 1 keyed `optim.pt` by parameter index (torch's own layout); it still loads.
- `dcp` (FSDP2: zero2/fsdp): every rank writes its shards under `dcp/` with
  `torch.distributed.checkpoint`, keys `model` and `optim` (`optim_1`, ...), from the parts'
  state dicts (DCP's `get_*_state_dict`, names of the plain module); loading reshards to the
  current world size and the parts' `load_state_dict` (`set_*_state_dict`) puts the values in place.
  Pipeline stages always use it (each rank writes its stages' names). A `dcp` checkpoint also loads
  into an unsharded model (single, ddp: not zero1), so a pipeline run resumes at dp or single.

Every file is read with `torch.load(weights_only=True)` (DCP through `safe_dcp`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.optim import ZeroRedundancyOptimizer

from dptrain.checkpoint.manifest import CheckpointError
from dptrain.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner
from dptrain.checkpoint.state import CheckpointState, ModelState, OptimizerState

FULL = "full"
SHARDED = "dcp"
DCP_DIR = "dcp"


def format_of(state: CheckpointState) -> str:
    """The on-disk format of `state`: `full` or `dcp`."""
    return FULL if state.full else SHARDED


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


def optim_name(i: int) -> str:
    """The key (DCP) or file stem (full) of optimizer `i`: `optim`, `optim_1`, ..."""
    return "optim" if i == 0 else f"optim_{i}"


def _model_dict(parts: list[Stateful]) -> dict[str, Any]:
    """The model parts' state dicts as one (pipeline stages hold disjoint names)."""
    if len(parts) == 1:
        return parts[0].state_dict()
    merged: dict[str, Any] = {}
    for i, part in enumerate(parts):
        sd = part.state_dict()
        clash = sorted(set(sd) & set(merged))
        if clash:
            raise CheckpointError(f"model part {i} repeats names of an earlier part: {clash[:3]}")
        merged.update(sd)
    return merged


def _load_model_dict(parts: list[Stateful], merged: dict[str, Any]) -> None:
    if len(parts) == 1:
        parts[0].load_state_dict(merged)
        return
    for part in parts:
        part.load_state_dict({k: merged[k] for k in part.state_dict()})


def dcp_state(state: CheckpointState) -> dict[str, Any]:
    """The `dcp` format's state dict: `model` (the parts' names merged) and `optim`, `optim_1`, ... (live)."""
    out = {"model": _model_dict(state.model_parts)}
    out.update({optim_name(i): o.state_dict() for i, o in enumerate(state.optimizers)})
    return out


def save_model_optim(ckpt_dir: Path, *, state: CheckpointState, rank: int) -> None:
    """Write model and optimizer state in the state's format. Collective: call on every rank."""
    if not state.full:
        import torch.distributed.checkpoint as dcp

        dcp.save(dcp_state(state), storage_writer=dcp.FileSystemWriter(ckpt_dir / DCP_DIR, sync_files=True))
        return
    model_sd = _model_dict(state.model_parts)  # collective where a part is sharded or ZeRO-1 consolidates
    optim_sds = [o.state_dict() for o in state.optimizers]
    if rank == 0:
        save_torch(ckpt_dir / "model.pt", model_sd)
        for i, sd in enumerate(optim_sds):
            save_torch(ckpt_dir / f"{optim_name(i)}.pt", sd)


def async_save_model_optim(
    ckpt_dir: Path, *, state: CheckpointState, rank: int, process_group: Any, executor: ThreadPoolExecutor,
) -> Future:
    """Like `save_model_optim`, but only the snapshot is taken now (collective); the files are written
    in the background. The Future is done when this rank's files are on disk (fsynced).

    DCP: `dcp.async_save` stages the shards to CPU memory, then writes them in its own thread,
    coordinating over `process_group` (a dedicated gloo group, so the training's collectives never
    interleave with the checkpoint's). Full: rank 0 copies model and optimizer state, a thread writes."""
    if not state.full:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(ckpt_dir / DCP_DIR, sync_files=True)
        # AsyncSaveResponse is returned only with an async_stager's staging future, which is not asked for.
        return cast(Future, dcp.async_save(dcp_state(state), storage_writer=writer, process_group=process_group))
    copies = full_state_copies(state, rank=rank)
    done: Future = Future()
    if rank != 0:
        done.set_result(None)
        return done

    def write() -> None:
        for name, sd in copies.items():
            save_torch(ckpt_dir / name, sd)

    return executor.submit(write)


def full_state_dicts(state: CheckpointState, *, rank: int) -> dict[str, Any]:
    """The `full` format's model and optimizer files by file name (`model.pt`, `optim.pt`, ...), as the
    live state dicts (their tensors keep changing: copy before the next step): on rank 0 only (empty
    elsewhere). Collective (ZeRO-1 consolidates on rank 0)."""
    model_sd = _model_dict(state.model_parts)
    optim_sds = [o.state_dict() for o in state.optimizers]
    if rank != 0:
        return {}
    return {"model.pt": model_sd, **{f"{optim_name(i)}.pt": sd for i, sd in enumerate(optim_sds)}}


def full_state_copies(state: CheckpointState, *, rank: int) -> dict[str, Any]:
    """`full_state_dicts` as copies taken now."""
    return {
        name: {k: v.detach().clone() for k, v in sd.items()} if name == "model.pt" else copy.deepcopy(sd)
        for name, sd in full_state_dicts(state, rank=rank).items()
    }


def load_model_optim(ckpt_dir: Path, *, fmt: str, state: CheckpointState, version: int = 3) -> None:
    """Load model and optimizer state written by `save_model_optim` (possibly at another world size;
    a format-version-1 `optim.pt`, keyed by parameter index, is read too, and a version-1/2 `dcp/`
    with its optimizer state in DCP's nested layout)."""
    here = FULL if state.full else SHARDED
    if fmt == SHARDED and here == FULL and not _zero1(state):
        # DCP shards (pipeline stages, FSDP2, tensor parallelism) into an unsharded model (single, ddp):
        # DCP reads into the live tensors of every rank, consolidating the shards, under the plain names.
        with _live_tensors(state), optimizer_layout(state, flat=version >= 3):
            _load_dcp(ckpt_dir, state)
        return
    if fmt == FULL and here == SHARDED and _splits_full_files(state):
        _load_full_into_shards(ckpt_dir, state)
        return
    if fmt != here:
        raise CheckpointError(
            f"{ckpt_dir}: written in the {fmt!r} format but this strategy reads {here!r}; resume with a strategy "
            "of the same kind (full: single/ddp/zero1; dcp: zero2/fsdp), or export the weights with "
            "`dptrain ckpt export`"
        )
    if not state.full:
        with optimizer_layout(state, flat=version >= 3):
            _load_dcp(ckpt_dir, state)
        return
    _load_model_dict(state.model_parts, load_torch(ckpt_dir / "model.pt"))
    for i, o in enumerate(state.optimizers):
        o.load_state_dict(load_torch(ckpt_dir / f"{optim_name(i)}.pt"))


def _load_dcp(ckpt_dir: Path, state: CheckpointState) -> None:
    import torch.distributed.checkpoint as dcp

    sd = dcp_state(state)  # the current (sharded) tensors: DCP reads into them, resharding
    dcp.load(sd, storage_reader=SafeFileSystemReader(ckpt_dir / DCP_DIR), planner=SafeLoadPlanner())
    _load_model_dict(state.model_parts, sd["model"])
    for i, o in enumerate(state.optimizers):
        o.load_state_dict(sd[optim_name(i)])


def _zero1(state: CheckpointState) -> bool:
    return any(isinstance(getattr(o, "optimizer", None), ZeroRedundancyOptimizer) for o in state.optimizers)


@contextlib.contextmanager
def _live_tensors(state: CheckpointState) -> Iterator[None]:
    """Parts and optimizers of the `full` format give their live tensors on every rank (not whole
    copies on rank 0 only) while the body runs: what loading DCP shards into them needs."""
    objs = [o for o in (*state.model_parts, *state.optimizers) if getattr(o, "full", False)]
    for o in objs:
        o.full = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for o in objs:
            o.full = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def optimizer_layout(state: CheckpointState, *, flat: bool) -> Iterator[None]:
    """The optimizers' sharded state dicts in DCP's flattened layout (format version 3) or the nested one
    (versions 1 and 2) while the body runs: the keys DCP then reads from the checkpoint."""
    objs = [o for o in state.optimizers if hasattr(o, "flat")]
    before = [o.flat for o in objs]
    for o in objs:
        o.flat = flat
    try:
        yield
    finally:
        for o, b in zip(objs, before, strict=True):
            o.flat = b


def _splits_full_files(state: CheckpointState) -> bool:
    """The state's model and optimizers are DCP's own state-dict helpers (not ZeRO-1's, not a
    pipeline's stage objects), which can distribute whole tensors into their shards."""
    return all(type(p) in (ModelState, OptimizerState) for p in (*state.model_parts, *state.optimizers))


def _load_full_into_shards(ckpt_dir: Path, state: CheckpointState) -> None:
    """A `full` checkpoint (single/ddp) resumed by a sharded run (FSDP2, tensor parallelism): every
    rank reads the whole files and keeps its own shards (DCP's full_state_dict loading). Collective."""
    model_sd = load_torch(ckpt_dir / "model.pt")
    for part in state.model_parts:
        part.load_full_state_dict(model_sd)  # type: ignore[attr-defined]
    for i, o in enumerate(state.optimizers):
        o.load_full_state_dict(load_torch(ckpt_dir / f"{optim_name(i)}.pt"))  # type: ignore[attr-defined]


def load_full_model_state(ckpt_dir: Path, *, fmt: str) -> dict[str, torch.Tensor]:
    """The consolidated model state dict of a checkpoint of either format, without a process group
    (for export). DCP shards are assembled by reading every tensor in full."""
    if fmt == FULL:
        return load_torch(ckpt_dir / "model.pt")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = SafeFileSystemReader(ckpt_dir / DCP_DIR)
    meta = reader.read_metadata()
    state: dict[str, Any] = {"model": {}}
    for key, item in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            state["model"][key[len("model.") :]] = torch.empty(item.size, dtype=item.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return state["model"]


def save_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    """Whole weights as one safetensors file (final/model.safetensors, `ckpt export`). Cloned:
    safetensors refuses tensors that share storage (tied embeddings)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(path))
