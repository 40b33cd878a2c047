"""Load pretrained weights into a materialized (sharded or whole) model: each rank reads only its own part.

Called by the meta-device init (`dptrain.parallel.materialize`) once the model is laid out and allocated,
for a model that carries a `PretrainedSource` (dptrain/models/pretrained.py). For every parameter the files
hold:

- a piece that is one contiguous run of the file's bytes (FSDP2's dim-0 shards, a replicated or whole tensor, a
  column-parallel weight's rows) is read with `pread` straight into the parameter's own storage (a cast, when
  the dtypes differ, goes through one buffer of the piece's size): the file is never mapped, so its pages stay in
  the page cache and out of the rank's resident memory;
- another piece of a DTensor sharded with plain `Shard`/`Replicate` placements (a row-parallel weight's
  columns): the rank's chunk, cut as `distribute_tensor` cuts it, is read with safetensors' slice API
  (`get_slice(key)[a:b, c:d]`) from the mapped file; nothing else of the tensor is copied out of the file;
- any other placement (FSDP2 over a tensor-parallel dim 0 uses a strided shard): the full tensor is read
  and the rank's piece cut from it (`distribute_tensor` without a collective, as materialize's `local_chunk`);
- a plain tensor (ddp, zero1, single: every rank holds the whole model): read tensor by tensor as above, so the
  files' pages are shared by the ranks (page cache) and no rank holds a second private copy of the model.

`bytes_read` counts the bytes each rank copied out of the files.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from dptrain.models.pretrained import PretrainedSource, load_names

__all__ = ["LoadReport", "load_pretrained", "local_slices"]


@dataclass
class LoadReport:
    """What one rank read: the folder, its files, the bytes it copied out of them, and their total size."""

    folder: Path
    files: int
    tensors: int
    bytes_read: int
    total_bytes: int

    def line(self) -> str:
        return (
            f"dptrain: loaded pretrained weights from {self.folder} ({self.files} safetensors file(s), "
            f"{self.tensors} tensors): this rank read {_size(self.bytes_read)} of {_size(self.total_bytes)}"
        )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def local_slices(shape: Sequence[int], mesh: Any, placements: Sequence[Placement]) -> list[slice] | None:
    """The index ranges of this rank's piece of a tensor of `shape` under plain Shard/Replicate `placements`,
    cut as `torch.chunk` (and so `distribute_tensor`) cuts, left to right over the mesh dims; None for any
    other placement."""
    if not all(type(p) in (Shard, Replicate) for p in placements):
        return None
    ranges = [[0, n] for n in shape]  # [start, length] per dim
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            start, length = ranges[p.dim]
            n, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
            size = -(-length // n) if length else 0
            lo = min(rank * size, length)
            ranges[p.dim] = [start + lo, min(size, length - lo)]
    return [slice(s, s + n) for s, n in ranges]


@torch.no_grad()
def load_pretrained(model: nn.Module, carrier: str, source: PretrainedSource) -> LoadReport:
    """Copy every tensor of `model` the files hold (skipping those still on meta: another pipeline stage's)
    from `source` into its local storage; returns what this rank read."""
    todo = [(t, key) for t, _, key in load_names(model, carrier, source) if not _local(t).is_meta]
    read = 0
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for t, key in todo:
            info = source.index[key]
            if info.file not in handles:
                handles[info.file] = stack.enter_context(safe_open(str(info.file), framework="pt"))
            f = handles[info.file]
            dst = _local(t)
            slices = local_slices(info.shape, t.device_mesh, t.placements) if isinstance(t, DTensor) else None
            run = _contiguous_run(info.shape, slices if isinstance(t, DTensor) else None)
            if run is not None and dst.is_contiguous() and dst.numel() == run[1]:
                read += _pread_into(dst, info.file, info.offset + run[0] * _itemsize(info.dtype), info.dtype)
                continue
            if isinstance(t, DTensor) and slices is None:
                full = f.get_tensor(key)
                read += full.numel() * full.element_size()
                piece = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local()
            elif slices is not None:
                piece = f.get_slice(key)[tuple(slices)] if dst.numel() else dst.new_empty(dst.shape)
                read += piece.numel() * piece.element_size()
            else:
                piece = f.get_tensor(key)
                read += piece.numel() * piece.element_size()
            if piece.shape != dst.shape:
                raise RuntimeError(f"pretrained {key!r}: read a piece of shape {tuple(piece.shape)} for a local "
                                   f"shard of shape {tuple(dst.shape)}")
            dst.copy_(piece)  # converts the dtype when the source allows it (checked by load_names)
    return LoadReport(source.folder, len(source.files), len(todo), read, source.total_bytes)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _contiguous_run(shape: Sequence[int], slices: Sequence[slice] | None) -> tuple[int, int] | None:
    """(first element, element count) of a piece of a row-major tensor of `shape` that is one contiguous run
    (`slices` None: the whole tensor): every dim after the first cut one is whole, and the dims before it are
    cut to one index. None otherwise."""
    if slices is None:
        return 0, int(torch.Size(shape).numel())
    cut = next((d for d, (s, n) in enumerate(zip(slices, shape, strict=True)) if (s.start, s.stop) != (0, n)), None)
    if cut is None:
        return 0, int(torch.Size(shape).numel())
    if any(slices[d].stop - slices[d].start != 1 for d in range(cut)):
        return None
    if any((slices[d].start, slices[d].stop) != (0, shape[d]) for d in range(cut + 1, len(shape))):
        return None
    inner = int(torch.Size(shape[cut + 1:]).numel())
    outer = sum(slices[d].start * int(torch.Size(shape[d + 1:]).numel()) for d in range(cut))
    return outer + slices[cut].start * inner, (slices[cut].stop - slices[cut].start) * inner


def _pread_into(dst: torch.Tensor, file: Path, offset: int, dtype: torch.dtype) -> int:
    """Fill the contiguous CPU tensor `dst` from `file`'s bytes at `offset`, stored as `dtype` (cast into `dst`'s
    dtype through one buffer when they differ). Returns the bytes read."""
    buf = dst if dst.dtype == dtype else torch.empty(dst.shape, dtype=dtype)
    nbytes = buf.numel() * buf.element_size()
    view = memoryview((ctypes.c_char * nbytes).from_address(buf.data_ptr())).cast("B") if nbytes else None
    fd = os.open(file, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            assert view is not None
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise RuntimeError(f"{file}: the file ended {nbytes - done} bytes early at offset {offset + done}")
            done += n
    finally:
        os.close(fd)
    if buf is not dst:
        dst.copy_(buf)
    return nbytes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
