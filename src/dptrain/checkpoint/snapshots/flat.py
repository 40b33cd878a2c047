"""Snapshot files staged in place: the step boundary's copy of a checkpoint file's tensors is its write.

Each rank keeps, per checkpoint file it snapshots (`model.pt`, `optim.pt`, ... of the `full` format, its
`rank_RRRRR.pt`, and in the `dcp` format `shards_RRRRR`: its shards of the model and optimizer), two files in its
node's memory folder (`.slots/rank_RRRRR/NAME.raw.0` and `.1`), mapped into the process. A snapshot copies the live
tensors straight into one of them (`Slot.views`: one view per tensor, ALIGN-aligned, made once), the one that does
not hold the newest complete snapshot; the background thread then only hard-links that file into the snapshot's
step folder as `NAME.raw`, hashes it (xxh3-64) and writes the small skeleton (`NAME.skel`: the tree without its
tensors, and each tensor's dtype, shape and offset). No staging copy in process memory, no second copy into the
file, no allocation after the first snapshot: the node's folder holds the two snapshots and nothing else does.

A DTensor is stored as this rank's shard plus the whole tensor's shape and the shard's offsets in it (DTensor's
own `__create_chunk_list__`, which DCP plans with); recovery puts the shards of every rank together and writes
them with DCP (rebuild.py), which reshards them to the new world on load.

A peer's replica is received the same way: straight into a mapped pair of its own (`.slots/from_RRRRR/`).

A slot is overwritten only after every rank finished the newer snapshot (the snapshots' barrier), and the part
that lists its previous content is deleted first, so no part ever names bytes that changed under it. Deleting a
step folder removes only its links; a slot file of a process that is gone lives on as long as a step folder links
it (recovery after a restart reads those), and every slot is created as a new file (temp + rename), so a new
process never writes into a file an old snapshot still names.

The skeleton is pickled by the C pickler, and read back by an unpickler that resolves no global at all; a tree
whose plain values are not all of Python's built-in scalar types (or whose lists and tuples are subclasses) is
written with `torch.save` instead and read with the weights-only loader.
"""

from __future__ import annotations

import copy
import io
import mmap
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.tensor import DTensor

from dptrain.checkpoint.snapshots.folder import write_file

ALIGN = 64
"""Byte alignment of each tensor in a slot (any dtype's view of the bytes needs its element size at least)."""
SLOTS = ".slots"
TENSOR = "__dptrain_tensor__"
SHARD = "__dptrain_shard__"
RAW, SKEL = ".raw", ".skel"
PLAIN = frozenset({int, float, str, bytes, bool, complex, type(None)})


def digest(data: Any) -> int:
    """The snapshot files' checksum: xxh3-64 of a bytes-like object (about 14 GB/s here; zlib's CRC-32: 2.7 GB/s)."""
    return xxhash.xxh3_64_intdigest(data)


def split(tree: Any, tensors: list[torch.Tensor], plain: list[bool]) -> Any:
    """`tree` with each tensor replaced by (TENSOR, its index in `tensors`), appended there in order; its other
    values copied (containers rebuilt, anything but a built-in scalar deep-copied and `plain[0]` set False)."""
    if isinstance(tree, DTensor):  # this rank's shard, and where it lies in the whole tensor
        local = tree.to_local()
        tensors.append(local)
        return (SHARD, len(tensors) - 1, list(tree.shape), chunk_offsets(tree, local))
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return (TENSOR, len(tensors) - 1)
    if isinstance(tree, dict):
        if not all(type(k) in PLAIN for k in tree):
            plain[0] = False
        return {k: split(v, tensors, plain) for k, v in tree.items()}
    if type(tree) in (list, tuple) and set(map(type, tree)) <= PLAIN:  # e.g. Python's RNG state: 625 ints
        return tree if type(tree) is tuple else list(tree)
    if isinstance(tree, (list, tuple)):
        items = [split(v, tensors, plain) for v in tree]
        if type(tree) not in (list, tuple):  # a namedtuple, torch.Size, ...: pickled by torch.save
            plain[0] = False
        return rebuild(tree, items)
    if type(tree) in PLAIN:
        return tree
    plain[0] = False
    return copy.deepcopy(tree)


_CHUNKS: dict[tuple[Any, ...], tuple[list[int], tuple[int, ...]]] = {}


def chunk_offsets(t: DTensor, local: torch.Tensor) -> list[int]:
    """The offsets of this rank's shard of `t` in the whole tensor (DTensor's own `__create_chunk_list__`, the
    protocol DCP plans with), kept per global shape, placements and mesh: they depend on nothing else."""
    key = (tuple(t.shape), tuple(t.placements), t.device_mesh, torch.distributed.get_rank())
    if key not in _CHUNKS:
        chunks = t.__create_chunk_list__()
        if len(chunks) != 1:
            raise TypeError(f"a DTensor of shape {tuple(t.shape)} holds {len(chunks)} chunks on this rank; "
                            "in-memory snapshots take one")
        _CHUNKS[key] = (list(chunks[0].offsets), tuple(chunks[0].sizes))
    offsets, sizes = _CHUNKS[key]
    if tuple(local.shape) != sizes:
        raise TypeError(f"a DTensor's shard has shape {tuple(local.shape)}, its chunk {sizes}")
    return offsets


@dataclass
class Chunk:
    """A shard read back from a snapshot: the whole tensor's shape, and where this piece of it lies."""

    shape: list[int]
    offsets: list[int]
    tensor: torch.Tensor


def join(skel: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of `split` (a shard comes back as a `Chunk`)."""
    if isinstance(skel, tuple) and len(skel) == 2 and skel[0] == TENSOR:
        return tensors[skel[1]]
    if isinstance(skel, tuple) and len(skel) == 4 and skel[0] == SHARD:
        return Chunk(shape=skel[2], offsets=skel[3], tensor=tensors[skel[1]])
    if isinstance(skel, dict):
        return {k: join(v, tensors) for k, v in skel.items()}
    if isinstance(skel, (list, tuple)):
        return rebuild(skel, [join(v, tensors) for v in skel])
    return skel


def rebuild(like: list | tuple, items: list[Any]) -> Any:
    """A list or tuple of `like`'s type (a namedtuple's too) holding `items`."""
    return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a snapshot skeleton names {module}.{name}; it may hold only plain data")


def dump_skeleton(head: dict[str, Any], *, plain: bool) -> bytes:
    """The skeleton file's bytes: the C pickler's for plain data, else `torch.save`'s."""
    if plain:
        return pickle.dumps(head, protocol=5)
    buf = io.BytesIO()
    torch.save(head, buf)
    return buf.getvalue()


def load_skeleton(data: bytes) -> Any:
    """Read what `dump_skeleton` wrote: no global is resolved (plain pickle), or the weights-only loader."""
    if data[:2] == b"PK":  # torch.save's zip
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return _NoGlobals(io.BytesIO(data)).load()


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's byte offset in a slot (ALIGN-aligned) and the slot's size."""
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return offsets, at


class Slot:
    """One mapped file of a pair: its bytes as a uint8 tensor, the views of its current layout, the step it holds."""

    def __init__(self, path: Path, size: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if size:  # every page now (OSError ENOSPC on a full tmpfs), so a write through the map never meets SIGBUS
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, 0)
            self._map = mmap.mmap(fd, size) if size else None
        except OSError:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, path)  # a new file: a snapshot that links the old one keeps its bytes
        self.path, self.size = path, size
        self.data = torch.frombuffer(self._map, dtype=torch.uint8) if self._map else torch.empty(0, dtype=torch.uint8)
        self.step: int | None = None
        self.signature: list[tuple[torch.dtype, torch.Size]] = []
        self.views: list[torch.Tensor] = []

    def close(self) -> None:
        """Unmap (the file stays while a snapshot links it)."""
        self.views, self.signature = [], []
        self.data = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a tensor over it is still alive somewhere: unmapped when that goes
                pass
            self._map = None

    def memory(self) -> memoryview:
        return memoryview(self._map) if self._map is not None else memoryview(b"")

    def shape_views(self, tensors: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
        """One view per tensor of `tensors` (its dtype and shape at its offset), made once per layout."""
        signature = [(t.dtype, t.shape) for t in tensors]
        if signature != self.signature:
            self.views = [_view(self.data, off, dt, shape) for off, (dt, shape) in zip(offsets, signature, strict=True)]
            self.signature = signature
        return self.views


def _view(data: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    n = shape.numel() * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return data[offset : offset + n].view(dtype).view(shape)


@dataclass
class Pair:
    """The two slots of one file (own or a replica): `take` the one that does not hold `avoid`."""

    base: Path
    slots: list[Slot | None] = field(default_factory=lambda: [None, None])

    def close(self) -> None:
        for slot in self.slots:
            if slot is not None:
                slot.close()
        self.slots = [None, None]

    def take(self, size: int, *, avoid: int | None) -> tuple[Slot, int | None]:
        """A slot of `size` bytes not holding step `avoid` (the newest complete snapshot), and the step it held
        before (None: none), whose part the caller deletes before writing into it."""
        i = next((i for i, s in enumerate(self.slots) if s is None or s.step is None), None)
        if i is None:
            i = 0 if self.slots[0] is not None and self.slots[0].step != avoid else 1
        old = self.slots[i]
        if old is None or old.size != size:
            self.slots[i] = Slot(self.base.with_name(f"{self.base.name}.{i}"), size)
        slot = self.slots[i]
        assert slot is not None
        held = old.step if old is not None else None
        slot.step = None
        return slot, held


@dataclass
class Staged:
    """A checkpoint file staged into a slot: the slot, the tree without its tensors (`split`), the tensors' offsets
    in the slot, and whether the skeleton pickles plainly."""

    slot: Slot
    skeleton: Any
    offsets: list[int]
    plain: bool

    def head(self) -> dict[str, Any]:
        """The skeleton file's content: the tree, and each tensor's dtype, shape and offset."""
        described = [[str(dtype).removeprefix("torch."), list(shape), off]
                     for (dtype, shape), off in zip(self.slot.signature, self.offsets, strict=True)]
        return {"skeleton": self.skeleton, "tensors": described}


def stage(pair: Pair, tree: Any, *, step: int, avoid: int | None, release: Any) -> Staged:
    """Copy `tree`'s tensors into a slot of `pair` (the step boundary's only copy); `release(step)` is called with
    the step the slot held before, before its bytes change."""
    tensors: list[torch.Tensor] = []
    plain = [True]
    with torch.no_grad():  # a DTensor's to_local() is then the shard itself, not an autograd view; copies untracked
        skel = split(tree, tensors, plain)
        offsets, size = layout(tensors)
        slot, held = pair.take(size, avoid=avoid)
        if held is not None:
            release(held)
        for view, t in zip(slot.shape_views(tensors, offsets), tensors, strict=True):
            view.copy_(t)
    slot.step = step
    return Staged(slot=slot, skeleton=skel, offsets=offsets, plain=plain[0])


def link(src: Path, dest: Path) -> None:
    """Hard-link `src` as `dest` (replacing it)."""
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.link(src, tmp)
    os.replace(tmp, dest)


def commit(step_dir: Path, name: str, staged: Staged) -> tuple[dict[str, dict[str, int]], bytes]:
    """Link a staged file's slot into `step_dir` as `name.raw` and write its `name.skel`; their part entries
    (size, xxh3) and the skeleton's bytes."""
    raw = step_dir / (name + RAW)
    link(staged.slot.path, raw)
    skel = dump_skeleton(staged.head(), plain=staged.plain)
    write_file(step_dir / (name + SKEL), skel)
    return {raw.name: {"size": staged.slot.size, "xxh3": digest(staged.slot.memory())},
            name + SKEL: {"size": len(skel), "xxh3": digest(skel)}}, skel


def materialize_raw(step_dir: Path, name: str) -> Any:
    """The checkpoint file `name`'s tree, rebuilt from its `.raw` and `.skel` in `step_dir` (tensors copied out)."""
    head = load_skeleton((step_dir / (name + SKEL)).read_bytes())
    raw = bytearray((step_dir / (name + RAW)).read_bytes())
    data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    tensors = [_view(data, int(off), getattr(torch, dtype), torch.Size(shape)).clone()
               for dtype, shape, off in head["tensors"]]
    return join(head["skeleton"], tensors)
