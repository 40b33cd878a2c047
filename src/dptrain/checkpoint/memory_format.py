"""How an in-memory snapshot stores a checkpoint: raw tensor bytes plus a small skeleton per file, and shards.

While training, a checkpoint file's state tree (e.g. `optim.pt`'s) is written as two files: `NAME.raw`,
every tensor's bytes one after the other (written straight from the staged CPU tensors, with their
CRC-32 computed on the way: no serialisation copy), and `NAME.skel`, the tree with each tensor replaced
by `(TENSOR, index)` plus every tensor's dtype and shape (`torch.save`, small). Only at recovery is the
checkpoint file itself rebuilt (`materialize`) and written with `torch.save`, so the recovered folder is
an ordinary checkpoint. Both files are read back with the weights-only loader.

The `dcp` format's model and optimizer shards (FSDP2, tensor and pipeline parallelism) are written by
`torch.distributed.checkpoint` itself (`write_shards`) into the snapshot's `dcp/` folder, exactly as a
disk checkpoint's: each rank's `__R_N.distcp` files, and rank 0's `.metadata`. They are kept as they are
(`verbatim`) and linked into the recovered checkpoint, where DCP reshards them to the new world on load.
"""

from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from dptrain.checkpoint import storage

TENSOR = "__dptrain_tensor__"
RAW, SKEL = ".raw", ".skel"
FREE = ".free"
"""The node folder's pool of `.raw` files of dropped snapshots: the next snapshot of the same file overwrites one
in place instead of writing a new file (a tmpfs allocates and zeroes every page of a new file: 5.8 ms for 10 MB
here, against 1.3 ms to overwrite)."""


def split(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """`tree` with each tensor replaced by (TENSOR, its index in `tensors`), appended there in order."""
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return (TENSOR, len(tensors) - 1)
    if isinstance(tree, dict):
        return {k: split(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(split(v, tensors) for v in tree)
    return tree


def join(skel: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of `split`."""
    if isinstance(skel, tuple) and len(skel) == 2 and skel[0] == TENSOR:
        return tensors[skel[1]]
    if isinstance(skel, dict):
        return {k: join(v, tensors) for k, v in skel.items()}
    if isinstance(skel, (list, tuple)):
        return type(skel)(join(v, tensors) for v in skel)
    return skel


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def write(step_dir: Path, name: str, tree: Any) -> dict[str, dict[str, int]]:
    """Write `tree` (CPU, contiguous tensors) as `name.raw` + `name.skel` in `step_dir` (temp + rename each);
    their part entries (size, CRC-32)."""
    tensors: list[torch.Tensor] = []
    skel = split(tree, tensors)
    entries = {}
    raw, crc, size = step_dir / (name + RAW), 0, 0
    tmp = raw.with_name(f".{raw.name}.tmp{os.getpid()}")
    try:
        os.replace(step_dir.parent / FREE / raw.name, tmp)  # a dropped snapshot's file: overwritten in place
        mode = "r+b"
    except FileNotFoundError:
        mode = "wb"
    with open(tmp, mode) as f:
        for t in tensors:
            if t.numel():
                mv = _bytes_of(t)
                f.write(mv)
                crc, size = zlib.crc32(mv, crc), size + mv.nbytes
        f.truncate()
    os.replace(tmp, raw)
    entries[raw.name] = {"size": size, "crc32": crc}
    skel_path = step_dir / (name + SKEL)
    tmp = skel_path.with_name(f".{skel_path.name}.tmp{os.getpid()}")
    torch.save({"skeleton": skel, "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]},
               tmp)
    data = tmp.read_bytes()
    os.replace(tmp, skel_path)
    entries[skel_path.name] = {"size": len(data), "crc32": zlib.crc32(data)}
    return entries


class SnapshotPlanner(DefaultSavePlanner):
    """DCP's default planner with its plan cache on (the snapshots save the same layout every time: the ranks
    skip sending their plans once they are known). Its own class: DCP keys the cache by the planner's class."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


def write_shards(step_dir: Path, state_dict: dict[str, Any], *, group: Any, rank: int) -> dict[str, dict[str, int]]:
    """Save `state_dict` (staged CPU shards, DCP's keys) with DCP into `step_dir/dcp/` (collective over `group`,
    the snapshots' own); the part entries (size, CRC-32) of this rank's files: its `__RANK_N.distcp`, and on
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
        entries[f"{storage.DCP_DIR}/{name}"] = {"size": len(data), "crc32": zlib.crc32(data)}
    return entries


def verbatim(name: str) -> bool:
    """A snapshot file that is itself a checkpoint file (a DCP shard or DCP's metadata), not raw + skeleton."""
    return name.startswith(f"{storage.DCP_DIR}/")


def recycle(step_dir: Path) -> None:
    """Keep the `.raw` files of a snapshot folder about to be deleted in the node's pool (one per name: the
    newest), for `write` to overwrite."""
    pool = step_dir.parent / FREE
    for raw in step_dir.glob(f"*{RAW}"):
        pool.mkdir(exist_ok=True)
        try:
            os.replace(raw, pool / raw.name)
        except OSError:
            pass  # another rank took or replaced it: the folder is deleted anyway


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
    head = storage.load_torch(step_dir / (name + SKEL))
    raw = bytearray((step_dir / (name + RAW)).read_bytes())
    tensors, at = [], 0
    for dtype_name, shape in head["tensors"]:
        dtype = getattr(torch, dtype_name)
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        chunk = torch.frombuffer(raw, dtype=torch.uint8, offset=at, count=n) if n else torch.empty(0, dtype=torch.uint8)
        tensors.append(chunk.view(dtype).reshape(shape).clone())
        at += n
    storage.save_torch(dest, join(head["skeleton"], tensors))
