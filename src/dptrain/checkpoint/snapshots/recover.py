"""Recovery from in-memory snapshots (see memory.py): which snapshot, who sends what, and the folder to load.

At setup after a restart every rank reports the parts its node holds (`holdings`). All ranks then
decide the same way (`choose`): the newest step, at least as new as the newest valid disk checkpoint,
for which a part of every rank of the world that wrote it exists on some node of the new world.
Nodes that lack parts receive them from a holder (`plan_transfers`: the lowest rank of a holding node
sends to the lowest rank of a lacking node, point to point, in one order on every rank). Each node then
has the whole snapshot; its first rank checks every snapshot file's size and checksum against its part,
rebuilds the checkpoint files from them (rebuild.py) into `step_NNNNNN/checkpoint/` and writes
`manifest.json` (their SHA-256) and `COMMITTED` there, so that folder is an ordinary committed checkpoint and
loads through the same path as a disk one (another world size included). A snapshot that fails
verification anywhere is not used: the run falls back to disk.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint import storage
from dptrain.checkpoint.snapshots import flat, rebuild
from dptrain.checkpoint.snapshots.folder import drop_steps, holdings, pack, read_part_files, store_part, unpack
from dptrain.checkpoint.snapshots.store import MemorySnapshots
from dptrain.distributed import collectives

CHECKPOINT = "checkpoint"  # the rebuilt checkpoint folder inside a snapshot's step folder
Holdings = dict[int, dict[int, dict[str, Any]]]  # step -> writer rank -> part


@dataclass
class MemoryChoice:
    """A snapshot to resume from: this node's folder of it, its meta, and what to tell the user."""

    path: Path
    step: int
    meta: dict[str, Any]
    message: str
    replicas: list[str] = field(default_factory=list)  # "rank R (host A) from host B's replica"


def choose(views: list[tuple[str, Holdings]], *, min_step: int) -> tuple[int, dict[int, dict[str, Any]]] | None:
    """The newest step >= `min_step` whose parts (one per rank of the world that wrote it) are all held by
    the nodes of `views` ((host, holdings) per node), and those parts; None when there is none."""
    steps = sorted({s for _, h in views for s in h}, reverse=True)
    for step in steps:
        if step < min_step:
            break
        parts: dict[int, dict[str, Any]] = {}
        for _, h in views:
            parts.update(h.get(step, {}))
        worlds = {p["world_size"] for p in parts.values()}
        if len(worlds) == 1 and set(parts) == set(range(worlds.pop())):
            return step, parts
    return None


def plan_transfers(ranks: list[tuple[int, str, Holdings]], *, step: int) -> list[tuple[int, int, int]]:
    """(writer rank of the part, sending rank, receiving rank) for every part a node of the new world
    lacks; `ranks` is (rank, host, the node's holdings) for every rank. Same answer on every rank."""
    first: dict[str, int] = {}
    held: dict[str, set[int]] = {}
    for rank, host, h in sorted(ranks):
        first.setdefault(host, rank)
        held[host] = set(h.get(step, {}))
    every = set().union(*held.values())
    out: list[tuple[int, int, int]] = []
    for part in sorted(every):
        src = min(first[h] for h, parts in held.items() if part in parts)
        out.extend((part, src, first[h]) for h in sorted(held, key=first.__getitem__) if part not in held[h])
    return out


def describe(step: int, parts: dict[int, dict[str, Any]], views: list[tuple[str, Holdings]]) -> list[str]:
    """For each part not held by the node that wrote it: 'rank R (host A) from host B's replica'."""
    out = []
    for r, part in sorted(parts.items()):
        holders = [host for host, h in views if r in h.get(step, {})]
        if part["host"] not in holders:
            out.append(f"rank {r} (host {part['host']}) from host {holders[0]}'s replica")
    return out


def recover(
    snap: MemorySnapshots, *, min_step: int, keep_if_none: bool = False
) -> tuple[MemoryChoice | None, list[str]]:
    """Collective: find, gather, assemble and verify the newest usable snapshot on every node (see the module
    docstring); (the choice or None, messages for the user). Leaves only the chosen snapshot in memory, or none;
    with `keep_if_none`, a search that finds no snapshot new enough keeps them all and says nothing (the caller
    asks again with a lower `min_step`)."""
    mine = holdings(snap.node_dir)
    everyone = collectives.all_gather_object((snap.env.rank, snap.node_dir.name, mine))
    views = list({host: h for _, host, h in everyone}.items())
    found = choose(views, min_step=min_step)
    messages: list[str] = []
    if found is None and keep_if_none:
        return None, messages
    if found is None:
        newest = max((s for _, h in views for s in h), default=None)
        if newest is not None:
            messages.append(
                f"dptrain: no usable memory snapshot (newest held: step {newest}; needed: every rank's part, at "
                f"least step {min_step}): resuming from disk"
            )
        _keep_only(snap, keep=set())
        return None, messages
    step, parts = found
    for part, src, dst in plan_transfers(everyone, step=step):
        _transfer(snap, parts[part], src=src, dst=dst)
    ok, reason = True, ""
    snapshot = snap.node_dir / mf.step_dir_name(step)
    path = snapshot / CHECKPOINT
    if snap.node_main:
        try:
            for p in parts.values():
                for name, entry in p["files"].items():
                    check(snapshot / name, entry)
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            names = [n for p in parts.values() for n in rebuild.logical_names(p["files"])]
            shards = [n for n in names if n.startswith(rebuild.SHARDS)]
            files = [n for n in names if n not in shards]
            for name in files:
                rebuild.materialize(snapshot, name, path / name)
            if shards:
                files += rebuild.materialize_shards(snapshot, shards, path / storage.DCP_DIR)
            digest = mf.write_manifest(path, files={n: mf.file_entry(path / n) for n in files}, meta=parts[0]["meta"])
            mf.commit(path, manifest_sha256=digest)
        except (OSError, mf.CheckpointError) as e:
            ok, reason = False, str(e)
    verdicts = collectives.all_gather_object((ok, reason, snap.node_dir.name))
    bad = [(r, host) for good, r, host in verdicts if not good]
    if bad:
        messages.extend(f"dptrain: memory snapshot step {step} on host {host} is not usable: {r}" for r, host in bad)
        messages.append("dptrain: resuming from disk instead")
        _keep_only(snap, keep=set())
        return None, messages
    _keep_only(snap, keep={step})
    snap.last_complete = step
    replicas = describe(step, parts, views)
    how = f"with {'; '.join(replicas)}" if replicas else "every rank's files from its own node's memory"
    message = f"dptrain: resumed from memory snapshot step {step} ({how}); the disk was not read"
    return MemoryChoice(path=path, step=step, meta=parts[0]["meta"], message=message, replicas=replicas), messages


def check(path: Path, entry: dict[str, Any]) -> None:
    """CheckpointError naming the snapshot file unless its size and xxh3-64 match its part's `entry`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise mf.CheckpointError(f"{path}: missing (listed in its rank's part)") from None
    got, want = flat.digest(data), entry.get("xxh3")
    if len(data) != entry["size"] or got != want:
        raise mf.CheckpointError(
            f"{path}: {len(data)} bytes with xxh3 {got:016x}, its part says {entry['size']} bytes with xxh3 "
            f"{want if want is None else format(want, '016x')}"
        )


def _transfer(snap: MemorySnapshots, part: dict[str, Any], *, src: int, dst: int) -> None:
    """Send one part (its files and itself) from rank `src` to rank `dst` (point to point on the default group)."""
    dist = torch.distributed
    if snap.env.rank == src:
        blob = pack(part, read_part_files(snap.node_dir, part))
        dist.send(torch.tensor([len(blob)], dtype=torch.int64), dst)
        dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst)
    elif snap.env.rank == dst:
        n = torch.zeros(1, dtype=torch.int64)
        dist.recv(n, src)
        got = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.recv(got, src)
        store_part(snap.node_dir, *unpack(got.numpy().tobytes()))


def _keep_only(snap: MemorySnapshots, *, keep: set[int]) -> None:
    """Every node drops the snapshots not in `keep` (stale ones of the attempt that died), after everyone is done
    reading them."""
    collectives.barrier()
    if snap.node_main:
        drop_steps(snap.node_dir, keep=keep)
