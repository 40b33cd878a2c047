"""Replication of a snapshot to the next node: each rank sends its part and files to its peer and receives its
source's, over the snapshots' own gloo group (a ring: every rank does both).

The raw files go as they are, from the sender's slots (flat.py) to the receiver's: the receiver maps a
pair of slots per source file and receives straight into one, so a replica costs no copy on either side besides
the wire. The small files (skeletons, DCP shard files) travel together in one message. Every message has its
own tag, so the order in which gloo matches them does not matter; all sends are posted before the first receive,
so neither side waits on the other.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint.snapshots import flat
from dptrain.checkpoint.snapshots.flat import Pair, Slot

HEADER_SIZE, HEADER, SMALL, FIRST_BIG = 0, 1, 2, 3  # message tags


def send(part: dict[str, Any], small: dict[str, bytes], big: dict[str, torch.Tensor], *, peer: int,
         group: Any) -> list[Any]:
    """Post the sends of a part: its header (the part, the files' names and sizes), the small files in one message,
    then each big file (a uint8 tensor: a slot's bytes). The works to wait for."""
    header = json.dumps({"part": part, "small": [[n, len(b)] for n, b in small.items()],
                         "big": [[n, int(t.numel())] for n, t in big.items()]}).encode()
    messages = [(HEADER_SIZE, torch.tensor([len(header)], dtype=torch.int64)),
                (HEADER, torch.frombuffer(bytearray(header), dtype=torch.uint8))]
    blob = b"".join(small.values())
    if blob:
        messages.append((SMALL, torch.frombuffer(bytearray(blob), dtype=torch.uint8)))
    messages.extend((FIRST_BIG + i, t) for i, t in enumerate(big.values()) if t.numel())
    return [torch.distributed.isend(t, peer, group=group, tag=tag) for tag, t in messages]


def receive(node_dir: Path, pairs: dict[str, Pair], *, source: int, group: Any, avoid: int | None,
            release: Any, arrived: list[float] | None = None
            ) -> tuple[dict[str, Any], dict[str, memoryview]] | None:
    """Receive `source`'s part: its big files straight into slots of `pairs` (one pair per file name, made here under
    the node's slots folder), then linked into the step folder. Returns the part and its small files, for the
    caller to store (`store_part`: the part last) (None: the source's write failed, its part lists nothing).
    `release(step)` is called with the step a slot held, before it changes. A slot that cannot be made (a full
    tmpfs) still receives every message, into memory, before the error is raised: the sender must not wait
    forever. `arrived` gets the time the source's header came (its own write done: from then on the time is the
    transfer's)."""
    dist = torch.distributed
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, source, group=group, tag=HEADER_SIZE)
    if arrived is not None:
        arrived.append(time.perf_counter())
    raw_header = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(raw_header, source, group=group, tag=HEADER)
    header = json.loads(raw_header.numpy().tobytes())
    part = header["part"]
    total = sum(size for _, size in header["small"])
    blob = torch.empty(total, dtype=torch.uint8)
    if total:
        dist.recv(blob, source, group=group, tag=SMALL)
    slots: dict[str, Slot] = {}
    error: OSError | None = None
    for i, (name, size) in enumerate(header["big"]):
        into = torch.empty(size, dtype=torch.uint8)
        if error is None:
            try:
                if name not in pairs:
                    pairs[name] = Pair(node_dir / flat.SLOTS / f"from_{source:05d}" / name)
                slot, held = pairs[name].take(size, avoid=avoid)
                if held is not None:
                    release(held)
                slots[name], into = slot, slot.data
            except OSError as e:
                error = e
        if size:
            dist.recv(into, source, group=group, tag=FIRST_BIG + i)
    if error is not None:
        raise error
    if part.get("failed"):
        return None
    for slot in slots.values():
        slot.step = part["step"]
    step_dir = node_dir / mf.step_dir_name(part["step"])
    step_dir.mkdir(parents=True, exist_ok=True)
    for name, slot in slots.items():
        flat.link(slot.path, step_dir / name)
    view, at, small = memoryview(blob.numpy()), 0, {}  # type: ignore[arg-type]
    for name, size in header["small"]:
        small[name], at = view[at : at + size], at + size
    part.pop("failed", None)
    return part, small


def wait_all(works: list[Any]) -> None:
    for w in works:
        w.wait()
