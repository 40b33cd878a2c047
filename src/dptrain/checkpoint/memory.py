"""In-memory snapshots: the checkpoint format in host memory, with a copy on another node.

Every `checkpoint.memory_every_steps` each rank copies its share of the checkpoint (`full` format:
rank 0 the model, optimizer and `train.pt` files; `dcp` format: every rank its model and optimizer
shards, rank 0 `train.pt`; every rank its `rank_RRRRR.pt`) at the step boundary into CPU staging
buffers it reuses from one snapshot to the next (`stage`: no allocation, a device-to-host copy on a
GPU); a background thread writes them (memory_format.py: raw tensor bytes and a small skeleton per
checkpoint file; the shards with `torch.distributed.checkpoint` over the snapshots' own gloo group,
as a disk checkpoint's `dcp/` folder) into its node's folder
`<memory_dir>/<run id>/<host>/step_NNNNNN/` (a tmpfs: `/dev/shm/dptrain` by default, which outlives
the worker process), then writes the rank's *part* `parts/step_NNNNNN.rank_RRRRR.json` (every file's
size and CRC-32, and the checkpoint's meta), last: a part names only files fully written. The
SHA-256 of the commit protocol is computed at recovery, from bytes checked against the CRC-32.

Replication: when the run spans nodes, the same thread sends the rank's files and part to its peer
`(rank + local_world_size) % world_size` (a rank of the next node) over a gloo group of its own, and
receives those of `(rank - local_world_size) % world_size`, which it writes into its own node's
folder: every node holds its own ranks' parts and the previous node's.

At most two snapshots exist at a time: before a new one starts, every rank has finished the previous
one (a barrier at the step boundary), so everything older is deleted. Host memory per rank:
2 x (own files + the replica it holds); see `snapshot_bytes`. The default (`memory_every_steps: null`)
checks room and time first (memory_pace.py).

Recovery (`memory_recover.py`) builds a committed checkpoint folder from the parts the new world holds.
The run id is a hash of the run directory's absolute path (shared by every node and every restart).
A node's folder is removed when the run ends normally (`finish`); at a fresh start (no restart) the
run's own stale folder is cleared, and folders of other runs on this host whose owning launcher
process (recorded in `owner.json`) is gone are removed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint import memory_format
from dptrain.checkpoint.memory_pace import Pace, interval_for, room_problem
from dptrain.distributed import collectives
from dptrain.distributed.env import DistEnv

DEFAULT_ROOT = "/dev/shm/dptrain"
PARTS = "parts"
OWNER = "owner.json"


def run_id(run_dir: Path) -> str:
    """The run's folder name under the memory root: the same on every node and after every restart."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def part_name(step: int, rank: int) -> str:
    """`step_000012.rank_00001.json`: the part of `rank` of the snapshot of `step`."""
    return f"{mf.step_dir_name(step)}.rank_{rank:05d}.json"


def stage(obj: Any, cached: Any = None) -> Any:
    """A CPU copy of a state tree (dicts, lists, tuples, tensors, DTensors, plain values), copied into the
    tensors of `cached` (an earlier copy) where they match in shape and dtype: no allocation from the
    second snapshot on. A DTensor's copy is a DTensor of the same mesh and placements holding a CPU copy of
    this rank's shard (as DCP's own asynchronous save stages)."""
    if isinstance(obj, DTensor):
        return _stage_dtensor(obj, cached)
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if isinstance(cached, torch.Tensor) and cached.shape == src.shape and cached.dtype == src.dtype:
            return cached.copy_(src)
        return src.to("cpu", copy=True).contiguous()
    if isinstance(obj, dict):
        before: dict[Any, Any] = cached if isinstance(cached, dict) else {}
        return {k: stage(v, before.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        same = isinstance(cached, type(obj)) and len(cached) == len(obj)
        olds: list[Any] = list(cached) if same else [None] * len(obj)
        return type(obj)(stage(v, o) for v, o in zip(obj, olds, strict=True))
    return copy.deepcopy(obj)


def _stage_dtensor(obj: DTensor, cached: Any) -> DTensor:
    with torch.no_grad():  # to_local() is then the shard itself, not an autograd view
        src: DTensor = obj.detach()  # type: ignore[assignment]
        if (isinstance(cached, DTensor) and cached.shape == src.shape and cached.dtype == src.dtype
                and cached.placements == src.placements and cached.to_local().shape == src.to_local().shape):
            cached.to_local().copy_(src.to_local())
            return cached
        return src.to("cpu") if src.device.type != "cpu" else src.clone()  # type: ignore[return-value]


def write_file(path: Path, data: bytes) -> None:
    """Write-temp + rename (no fsync: the folder is in memory)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def pack(part: dict[str, Any], files: dict[str, bytes]) -> bytes:
    """One message: a JSON header (the part and the file names with sizes), then the files' bytes."""
    header = json.dumps({"part": part, "files": [[name, len(data)] for name, data in files.items()]}).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(files.values())


def unpack(blob: bytes | memoryview) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The inverse of `pack`."""
    view = memoryview(blob)
    n = int.from_bytes(view[:8], "little")
    header = json.loads(bytes(view[8 : 8 + n]))
    files, at = {}, 8 + n
    for name, size in header["files"]:
        files[name] = bytes(view[at : at + size])
        at += size
    return header["part"], files


def store_part(node_dir: Path, part: dict[str, Any], files: dict[str, bytes]) -> None:
    """Write a part's files into the node's step folder, then the part itself (last)."""
    step_dir = node_dir / mf.step_dir_name(part["step"])
    step_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
        write_file(step_dir / name, data)
    (node_dir / PARTS).mkdir(exist_ok=True)
    write_file(node_dir / PARTS / part_name(part["step"], part["rank"]), json.dumps(part).encode())


def read_part_files(node_dir: Path, part: dict[str, Any]) -> dict[str, bytes]:
    """The bytes of a part's files, from the node's step folder."""
    step_dir = node_dir / mf.step_dir_name(part["step"])
    return {name: (step_dir / name).read_bytes() for name in part["files"]}


def holdings(node_dir: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """The parts this node holds: step -> rank -> part (its own ranks' and the replicas)."""
    out: dict[int, dict[int, dict[str, Any]]] = {}
    parts = node_dir / PARTS
    if not parts.is_dir():
        return out
    for p in sorted(parts.glob("step_*.rank_*.json")):
        try:
            part = json.loads(p.read_text())
            out.setdefault(int(part["step"]), {})[int(part["rank"])] = part
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: as if absent (parts are written by rename, so only a foreign file)
    return out


def drop_steps(node_dir: Path, *, keep: set[int]) -> None:
    """Delete every snapshot of the node except the steps in `keep` (parts first, then the files); with some kept,
    the deleted snapshots' raw files go to the pool the next snapshot overwrites (`memory_format.recycle`)."""
    parts = node_dir / PARTS
    if parts.is_dir():
        for p in parts.glob("step_*.rank_*.json"):
            if mf.step_of(Path(p.name.split(".")[0])) not in keep:
                p.unlink(missing_ok=True)
    for d in mf.step_dirs(node_dir):
        if mf.step_of(d) not in keep:
            if keep:  # snapshots go on: their files are overwritten next time (memory_format.FREE)
                memory_format.recycle(d)
            shutil.rmtree(d, ignore_errors=True)
    if not keep:
        shutil.rmtree(node_dir / memory_format.FREE, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_runs(root: Path, *, host: str, own: str) -> list[Path]:
    """Remove `root/<other run>/<host>` folders whose owner process (owner.json) is gone; the removed ones."""
    removed = []
    for run in root.iterdir() if root.is_dir() else []:
        node = run / host
        if run.name == own or not node.is_dir():
            continue
        try:
            pid = int(json.loads((node / OWNER).read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            pid = -1
        if pid <= 0 or not pid_alive(pid):
            shutil.rmtree(node, ignore_errors=True)
            removed.append(node)
            with_other_nodes = any(run.iterdir()) if run.is_dir() else True
            if not with_other_nodes:
                run.rmdir()
    return removed


def snapshot_bytes(*, param_bytes: int, optim_bytes: int, rank_file_bytes: int, world: int, local_world: int,
                   sharded: bool = False) -> int:
    """Host memory (bytes) the fullest node's snapshot folder needs at most: two snapshots (the newest
    complete one and the one being written), each with the node's own files plus the replica of the previous
    node's. `full` format: a rank's share is rank_file_bytes, and rank 0 also holds the model and optimizer
    (param_bytes + optim_bytes), so node 0 (own) and node 1 (replica) carry them once more. `sharded` (dcp):
    every rank holds 1/world of the model and optimizer besides its rank file."""
    nodes = max(1, world // max(1, local_world))
    model = param_bytes + optim_bytes
    if sharded:
        per_rank = rank_file_bytes + model / world
        return int(2 * local_world * per_rank * (2 if nodes > 1 else 1))
    own = local_world * rank_file_bytes
    replica = local_world * rank_file_bytes if nodes > 1 else 0
    return 2 * (own + replica + model)


class MemorySnapshots:
    """One rank's side of the in-memory snapshots (see the module docstring)."""

    def __init__(self, *, every_steps: int, root: str | None, run_dir: Path, env: DistEnv, auto: bool = False) -> None:
        self.every_steps = every_steps
        self.auto = auto  # on by default (checkpoint.memory_every_steps: null): turned off, not failing, when it cannot
        self.base = Path(root or DEFAULT_ROOT)
        self.run = run_id(run_dir)
        self.node_dir = self.base / self.run / (env.hostname or "localhost")
        self.env = env
        cross = env.world_size > env.local_world_size
        self.peer = (env.rank + env.local_world_size) % env.world_size if cross else None
        self.source = (env.rank - env.local_world_size) % env.world_size if cross else None
        self._group: Any = None  # the snapshots' own gloo group (replication, DCP's planning)
        self._pace = Pace()
        self._pending: tuple[int, Future] | None = None
        self.last_complete: int | None = None  # the newest snapshot every rank has finished
        self._staged: dict[str, Any] = {}  # the CPU buffers of the last snapshot, reused
        self._staged_shards: Any = None
        self.sharded = False  # the run's state is DCP shards (set by the first snapshot)

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0

    @property
    def node_main(self) -> bool:
        """This rank looks after its node's folder (deletions, the owner file)."""
        return self.env.local_rank == 0

    def due(self, step: int) -> bool:
        """Whether to snapshot at the boundary of `step` (called at every boundary). The default's probe
        (memory_pace.py) snapshots every other step until it has chosen the interval."""
        if not self.enabled:
            return False
        if self.auto and self._pace.probing:
            self._pace.tick()
            return step % 2 == 1
        return step % self.every_steps == 0

    def start(self, *, fresh: bool) -> None:
        """At setup, before recovery: own the node's folder; a `fresh` start (no restart) clears the run's
        own stale snapshots. Every node's first local rank does the work; then a barrier."""
        if self.node_main:
            self.node_dir.mkdir(parents=True, exist_ok=True)
            if fresh:
                drop_steps(self.node_dir, keep=set())
            remove_dead_runs(self.base, host=self.node_dir.name, own=self.run)
            owner = os.getppid() if self.env.launched else os.getpid()  # torchrun's agent outlives restarts
            write_file(self.node_dir / OWNER, json.dumps({"pid": owner}).encode())
        collectives.barrier()

    def snapshot(self, *, step: int, files: dict[str, Any], meta: dict[str, Any],
                 shards: dict[str, Any] | None = None) -> None:
        """Snapshot `files` (name -> state tree, live: copied here) and `shards` (the `dcp` format's model and
        optimizer state dict, DCP's keys: copied here, written by DCP) of step `step`: written and replicated in
        the background. Waits for the previous snapshot first. Collective."""
        self._pace.begin()
        self.sharded = shards is not None
        if self._group is None and (self.peer is not None or shards is not None) and torch.distributed.is_initialized():
            self._group = torch.distributed.new_group(backend="gloo")  # the snapshots' own group
        if self.auto:  # every rank finished the previous snapshot (as the barrier would say) and can go on
            if not self._go_on(files, shards):
                return
        else:
            self.wait()
            collectives.barrier()  # every rank finished the previous snapshot: it is complete, older ones can go
        keep = {self.last_complete} if self.last_complete is not None else set()
        self._staged = {name: stage(obj, self._staged.get(name)) for name, obj in files.items()}
        staged_shards = stage(shards, self._staged_shards) if shards is not None else None
        self._staged_shards = staged_shards
        part = {"rank": self.env.rank, "world_size": self.env.world_size, "step": step,
                "host": self.node_dir.name, "meta": meta}
        self._pending = (step, in_background(self._write, part, self._staged, staged_shards, keep))
        self._pace.end()

    def _go_on(self, files: dict[str, Any], shards: dict[str, Any] | None) -> bool:
        """The default's checks (memory_pace.py), every rank alike: the previous write succeeded, two snapshots fit
        the tmpfs (before the first), and the interval that keeps the time within budget (after the probe). False:
        turned off for the run."""
        waited = self._wait_or_why()
        room = self._room(files, shards)  # every rank: collective on the first snapshot
        why = waited or room
        if why is not None:
            print(f"dptrain: warning: rank {self.env.rank}: {why}", file=sys.stderr, flush=True)
        share = self._pace.share()
        agreed = collectives.all_reduce_mean([float(why is not None), share or 0.0], device=torch.device("cpu"))
        if agreed[0] > 0:
            self.every_steps = 0  # on every rank alike
            if self.env.is_main:
                print("dptrain: warning: in-memory snapshots turned off for this run (set checkpoint.memory_dir to "
                      "a larger tmpfs, or checkpoint.memory_every_steps=0 to silence this)", file=sys.stderr,
                      flush=True)
            return False
        if share is not None and interval_for(agreed[1]) > 1:
            self.every_steps = interval_for(agreed[1])
            if self.env.is_main:
                print(f"dptrain: in-memory snapshots every {self.every_steps} steps: one takes {agreed[1]:.1%} of a "
                      "step's time (the default keeps them within 3%; set checkpoint.memory_every_steps to choose)",
                      file=sys.stderr, flush=True)
        return True

    def _wait_or_why(self) -> str | None:
        """`wait`, with a failed write (a full tmpfs) as the reason to stop snapshotting instead of an error."""
        try:
            self.wait()
        except OSError as e:
            return f"writing to {self.base} failed ({e})"
        return None

    def _room(self, files: dict[str, Any], shards: dict[str, Any] | None) -> str | None:
        """Before the first snapshot: why two of them would not fit the tmpfs (None: they fit; memory_pace.py).
        Collective on the first snapshot."""
        if self.last_complete is not None or self._staged:
            return None
        world = self.env.world_size
        mine = [0.0] * world
        mine[self.env.rank] = float(tree_bytes(files) + tree_bytes(shards))
        every = [v * world for v in collectives.all_reduce_mean(mine, device=torch.device("cpu"))]
        return room_problem(every, local_world=self.env.local_world_size, free=shutil.disk_usage(self.node_dir).free,
                            where=str(self.base))

    def wait(self) -> None:
        """Wait for the snapshot in flight (re-raising its error)."""
        if self._pending is None:
            return
        step, fut = self._pending
        self._pending = None
        fut.result()
        self.last_complete = step

    def _write(self, part: dict[str, Any], objs: dict[str, Any], shards: dict[str, Any] | None, keep: set[int]) -> None:
        if self.node_main:
            drop_steps(self.node_dir, keep=keep | {part["step"]})
        step_dir = self.node_dir / mf.step_dir_name(part["step"])
        step_dir.mkdir(parents=True, exist_ok=True)
        part["files"] = {}
        if shards is not None:
            part["files"].update(memory_format.write_shards(step_dir, shards, group=self._group, rank=self.env.rank))
        for name, obj in objs.items():
            part["files"].update(memory_format.write(step_dir, name, obj))
        store_part(self.node_dir, part, {})
        if self.peer is None:
            return
        data = read_part_files(self.node_dir, part)
        assert self.source is not None  # set with peer
        got = exchange(pack(part, data), peer=self.peer, source=self.source, group=self._group)
        store_part(self.node_dir, *unpack(got))

    def finish(self, *, remove: bool) -> None:
        """Wait for the snapshot in flight; with `remove` (the run ended normally, collective), delete the
        node's folder."""
        self.wait()
        if not remove:
            return
        collectives.barrier()  # nobody is still writing a replica into a folder about to go
        if self.node_main:
            shutil.rmtree(self.node_dir, ignore_errors=True)
            try:
                self.node_dir.parent.rmdir()  # the run's folder, once no node of it is left
            except OSError:
                pass


def tree_bytes(obj: Any) -> int:
    """Bytes of the tensors in a state tree (dicts, lists, tuples); a DTensor's: this rank's shard."""
    if isinstance(obj, DTensor):
        return tree_bytes(obj.to_local())
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tree_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tree_bytes(v) for v in obj)
    return 0


def in_background(fn: Any, *args: Any) -> Future:
    """Run `fn(*args)` in a daemon thread: a snapshot blocked on a dead peer never holds up the exit of a
    failing worker (an executor's threads are joined at exit)."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            fut.set_exception(e)

    threading.Thread(target=run, name="dptrain-memsnap", daemon=True).start()
    return fut


def exchange(blob: bytes, *, peer: int, source: int, group: Any) -> bytes:
    """Send `blob` to `peer` and receive one from `source` (a ring: every rank does both)."""
    dist = torch.distributed
    n_out, n_in = torch.tensor([len(blob)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    both(dist.isend(n_out, peer, group=group), dist.irecv(n_in, source, group=group))
    out = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    got = torch.empty(int(n_in.item()), dtype=torch.uint8)
    both(dist.isend(out, peer, group=group), dist.irecv(got, source, group=group))
    return got.numpy().tobytes()


def both(*works: Any) -> None:
    """Wait for point-to-point works (a send and a receive posted together, so neither side blocks first)."""
    for w in works:
        w.wait()
