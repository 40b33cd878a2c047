"""How an in-memory snapshot stores a checkpoint: raw tensor bytes plus a small skeleton per file, and shards.

While training, a checkpoint file's state tree (e.g. `optim.pt`'s) is two files: `NAME.raw`, every tensor's
bytes (a slot the step boundary copied them into, memory_flat.py), and `NAME.skel`, the tree without its
tensors plus every tensor's dtype, shape and offset. Only at recovery is the checkpoint file itself rebuilt
(`materialize`) and written with `torch.save`, so the recovered folder is an ordinary checkpoint.

The `dcp` format's model and optimizer shards (FSDP2, tensor and pipeline parallelism) are written by
`torch.distributed.checkpoint` itself (`write_shards`) into the snapshot's `dcp/` folder, exactly as a
disk checkpoint's: each rank's `__R_N.distcp` files, and rank 0's `.metadata`. They are kept as they are
(`verbatim`) and linked into the recovered checkpoint, where DCP reshards them to the new world on load.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from dptrain.checkpoint import memory_flat, storage
from dptrain.checkpoint.memory_flat import RAW, SKEL


class SnapshotPlanner(DefaultSavePlanner):
    """DCP's default planner with its plan cache on (the snapshots save the same layout every time: the ranks
    skip sending their plans once they are known). Its own class: DCP keys the cache by the planner's class."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


def write_shards(step_dir: Path, state_dict: dict[str, Any], *, group: Any, rank: int) -> dict[str, dict[str, int]]:
    """Save `state_dict` (staged CPU shards, DCP's keys) with DCP into `step_dir/dcp/` (collective over `group`,
    the snapshots' own); the part entries (size, xxh3) of this rank's files: its `__RANK_N.distcp`, and on
    rank 0 DCP's `.metadata`. The group's ranks are the global ranks (a group of every rank)."""
    out = step_dir / storage.DCP_DIR
    writer = dcp.FileSystemWriter(out, sync_files=False, overwrite=True)  # a tmpfs: nothing to sync
    dcp.save(state_dict, storage_writer=writer, planner=SnapshotPlanner(), process_group=group)
    names = sorted(p.name for p in out.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        names.append(".metadata")
    entries = {}
    for name in names:
        data = (out / name).read_bytes()
        entries[f"{storage.DCP_DIR}/{name}"] = {"size": len(data), "xxh3": memory_flat.digest(data)}
    return entries


def verbatim(name: str) -> bool:
    """A snapshot file that is itself a checkpoint file (a DCP shard or DCP's metadata), not raw + skeleton."""
    return name.startswith(f"{storage.DCP_DIR}/")


def logical_names(files: dict[str, Any]) -> list[str]:
    """The checkpoint files a part's snapshot files stand for (`model.pt` for `model.pt.raw` + `.skel`; a DCP
    file for itself)."""
    return sorted({n if verbatim(n) else n.removesuffix(RAW).removesuffix(SKEL) for n in files})


def materialize(step_dir: Path, name: str, dest: Path) -> None:
    """Rebuild checkpoint file `name` from its snapshot files in `step_dir` and `torch.save` it to `dest` (a
    verbatim file is hard-linked, or copied where it cannot be)."""
    if verbatim(name):
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(step_dir / name, dest)
        except OSError:
            shutil.copyfile(step_dir / name, dest)
        return
    storage.save_torch(dest, memory_flat.materialize_raw(step_dir, name))
