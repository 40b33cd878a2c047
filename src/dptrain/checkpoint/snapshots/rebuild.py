"""How an in-memory snapshot stores a checkpoint: raw tensor bytes plus a small skeleton per file, and shards.

While training, a checkpoint file's state tree (e.g. `optim.pt`'s) is two files: `NAME.raw`, every tensor's
bytes (a slot the step boundary copied them into, flat.py), and `NAME.skel`, the tree without its
tensors plus every tensor's dtype, shape and offset. Only at recovery is the checkpoint file itself rebuilt
(`materialize`) and written with `torch.save`, so the recovered folder is an ordinary checkpoint.

The `dcp` format's model and optimizer shards (FSDP2, tensor and pipeline parallelism) are one such file per rank
(`shards_RRRRR`): each DTensor as this rank's shard with its place in the whole tensor. At recovery the shards of
every rank are put together into whole tensors and written with DCP in one process (`materialize_shards`) as the
checkpoint's `dcp/` folder, which DCP reshards to the new world on load, as it does a disk checkpoint's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dptrain.checkpoint import storage
from dptrain.checkpoint.manifest import CheckpointError
from dptrain.checkpoint.snapshots import flat
from dptrain.checkpoint.snapshots.flat import RAW, SKEL

SHARDS = "shards_"


def shards_name(rank: int) -> str:
    """The snapshot file of rank `rank`'s model and optimizer shards (the `dcp` format)."""
    return f"{SHARDS}{rank:05d}"


def logical_names(files: dict[str, Any]) -> list[str]:
    """The snapshot files a part's files stand for (`model.pt` for `model.pt.raw` + `.skel`)."""
    return sorted({n.removesuffix(RAW).removesuffix(SKEL) for n in files})


def materialize(step_dir: Path, name: str, dest: Path) -> None:
    """Rebuild checkpoint file `name` from its snapshot files in `step_dir` and `torch.save` it to `dest`."""
    storage.save_torch(dest, flat.materialize_raw(step_dir, name))


def materialize_shards(step_dir: Path, names: list[str], dest: Path) -> list[str]:
    """Put every rank's shards (`names`: their snapshot files in `step_dir`) together into whole tensors and save
    them with DCP, in one process, as the checkpoint's `dcp/` folder `dest` (DCP reshards it to any world on load);
    the files written, relative to dest's parent. CheckpointError when the shards do not cover a tensor."""
    trees = [flat.materialize_raw(step_dir, name) for name in sorted(names)]
    whole = merge(trees, where=[])
    dcp.save(whole, storage_writer=dcp.FileSystemWriter(dest, sync_files=True), no_dist=True)
    return sorted(p.relative_to(dest.parent).as_posix() for p in dest.rglob("*") if p.is_file())


def merge(trees: list[Any], *, where: list[str]) -> Any:
    """One tree from every rank's: dict keys united (pipeline stages hold different ones), shards (`Chunk`s) put
    together into the whole tensor, anything else (replicated) taken from the first rank that has it."""
    first = trees[0]
    if isinstance(first, flat.Chunk):
        return assemble(trees, where=".".join(where))
    if isinstance(first, dict):
        keys = list(dict.fromkeys(k for t in trees if isinstance(t, dict) for k in t))
        return {k: merge([t[k] for t in trees if isinstance(t, dict) and k in t], where=[*where, str(k)]) for k in keys}
    return first


def assemble(chunks: list[Any], *, where: str) -> torch.Tensor:
    """The whole tensor from its shards (a replicated shard counted once)."""
    first = chunks[0]
    out = torch.empty(first.shape, dtype=first.tensor.dtype)
    seen, covered = set(), 0
    for c in chunks:
        key = tuple(c.offsets)
        if key in seen:
            continue
        seen.add(key)
        out[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.tensor.shape, strict=True))] = c.tensor
        covered += c.tensor.numel()
    if covered != out.numel():
        raise CheckpointError(f"{where}: the snapshot's shards cover {covered} of its {out.numel()} elements")
    return out
