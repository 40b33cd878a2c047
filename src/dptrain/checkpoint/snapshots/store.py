"""In-memory snapshots: the checkpoint format in host memory, with a copy on another node.

Every `checkpoint.snapshot_every_steps` each rank copies its share of the checkpoint (`full` format:
rank 0 the model, optimizer and `train.pt` files; `dcp` format: every rank its model and optimizer
shards, rank 0 `train.pt`; every rank its `rank_RRRRR.pt`) at the step boundary straight into files of
its node's folder `<snapshot_dir>/<run id>/<host>/` (a tmpfs: `/dev/shm/dptrain` by default, which outlives
the worker process), mapped into the process (flat.py: the copy is the write, a device-to-host
copy on a GPU). A background thread links them into the snapshot's folder `step_NNNNNN/`, with a small
skeleton per file, then writes the rank's *part* `parts/step_NNNNNN.rank_RRRRR.json` (every file's size
and xxh3-64, and the checkpoint's meta), last: a part names only files fully written. The SHA-256 of the
commit protocol is computed at recovery, from bytes checked against the part.

Replication: when the run spans nodes, the same thread sends the rank's files and part to its peer
`(rank + local_world_size) % world_size` (a rank of the next node) over a gloo group of its own, and
receives those of `(rank - local_world_size) % world_size` straight into files of its own node's folder
(replica.py): every node holds its own ranks' parts and the previous node's.

At most two snapshots exist at a time: the thread ends each snapshot with an all-reduce over the
snapshots' group (did any rank fail; the pace's share), so when the step loop starts the next one, every
rank has finished the previous one, and everything older is deleted, with no collective on the step's
path. Host memory per rank: 2 x (own files + the replica it holds); see `snapshot_bytes`. The default
(`snapshot_every_steps: null`) checks room and time first (pace.py).

Recovery (`recover.py`) builds a committed checkpoint folder from the parts the new world holds.
The run id is a hash of the run directory's absolute path (shared by every node and every restart).
A node's folder is removed when the run ends normally (`finish`); at a fresh start (no restart) the
run's own stale folder is cleared, and folders of other runs on this host whose owning launcher
process (recorded in `owner.json`) is gone are removed.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint.snapshots import flat, rebuild, replica
from dptrain.checkpoint.snapshots.flat import Pair
from dptrain.checkpoint.snapshots.folder import (
    OWNER,
    PARTS,
    drop_steps,
    part_name,
    remove_dead_runs,
    run_id,
    store_part,
    write_file,
)
from dptrain.checkpoint.snapshots.pace import Pace, cpu_clock, interval_for, room_problem
from dptrain.distributed import collectives
from dptrain.distributed.env import DistEnv

DEFAULT_ROOT = "/dev/shm/dptrain"


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
    replica_bytes = local_world * rank_file_bytes if nodes > 1 else 0
    return 2 * (own + replica_bytes + model)


class MemorySnapshots:
    """One rank's side of the in-memory snapshots (see the module docstring)."""

    def __init__(self, *, every_steps: int, root: str | None, run_dir: Path, env: DistEnv, auto: bool = False) -> None:
        self.every_steps = every_steps
        self.auto = auto  # on by default (checkpoint.snapshot_every_steps: null): turned off, not failing, if it cannot
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
        self._pairs: dict[str, Pair] = {}  # this rank's slots, per file (flat.py)
        self._replica_pairs: dict[str, Pair] = {}  # the source's, per file
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
        (pace.py) snapshots every step until it has chosen the interval."""
        if not self.enabled:
            return False
        if self.auto and self._pace.probing:
            self._pace.tick()
            return True
        return step % self.every_steps == 0

    def next_due(self, step: int) -> int:
        """The first boundary after `step` at which `due` can be true (the manager asks `due` only then)."""
        if not self.enabled:
            return sys.maxsize
        if self.auto and self._pace.probing:
            return step + 1
        return (step // self.every_steps + 1) * self.every_steps

    def start(self, *, fresh: bool) -> None:
        """At setup, before recovery: own the node's folder; a `fresh` start (no restart) clears the run's
        own stale snapshots; the slots of the node's earlier processes are let go (flat.py: the snapshots
        that link them keep them). Every node's first local rank does the work; then a barrier."""
        if self.node_main:
            self.node_dir.mkdir(parents=True, exist_ok=True)
            if fresh:
                drop_steps(self.node_dir, keep=set())
            shutil.rmtree(self.node_dir / flat.SLOTS, ignore_errors=True)  # the names, not what snapshots link
            remove_dead_runs(self.base, host=self.node_dir.name, own=self.run)
            owner = os.getppid() if self.env.launched else os.getpid()  # torchrun's agent outlives restarts
            write_file(self.node_dir / OWNER, json.dumps({"pid": owner}).encode())
        collectives.barrier()

    def snapshot(self, *, step: int, files: dict[str, Any], meta: dict[str, Any],
                 shards: dict[str, Any] | None = None) -> None:
        """Snapshot `files` (name -> state tree, live: copied here) and `shards` (the `dcp` format's model and
        optimizer state dict, DCP's keys: copied here, written by DCP) of step `step`: written and replicated in
        the background. Waits for the previous snapshot first (whose end every rank agreed on in the background:
        no collective here but on the first snapshot)."""
        self._pace.begin()
        self.sharded = shards is not None
        if self._group is None and self.env.world_size > 1 and torch.distributed.is_initialized():
            self._group = torch.distributed.new_group(backend="gloo")  # the snapshots' own group
        if not self._go_on(files, shards):
            return
        if shards is not None:  # the dcp format: this rank's shards are one more file (rebuild.py)
            files = {**files, rebuild.shards_name(self.env.rank): shards}
        slots = self.node_dir / flat.SLOTS / f"rank_{self.env.rank:05d}"
        staged: dict[str, flat.Staged] | None = {}
        staging: BaseException | None = None
        try:
            staged = {name: flat.stage(self._pairs.setdefault(name, Pair(slots / (name + flat.RAW))),
                                              obj, step=step, avoid=self.last_complete,
                                              release=self._release(self.env.rank))
                      for name, obj in files.items()}
        except OSError as e:  # no room for a slot: reported like a failed write, every rank still agrees
            staged, staging = None, e
        part = {"rank": self.env.rank, "world_size": self.env.world_size, "step": step,
                "host": self.node_dir.name, "meta": meta}
        share = self._pace.share() if self.auto else None
        self._pending = (step, in_background(self._write_and_agree, part, staged, self.last_complete, share, staging))
        self._pace.end()

    def _go_on(self, files: dict[str, Any], shards: dict[str, Any] | None) -> bool:
        """Wait for the previous snapshot; an explicit interval re-raises a failure (any rank's), the default
        (pace.py) turns itself off instead, or when two snapshots would not fit the tmpfs (checked before
        the first), and takes the interval the ranks agreed on after its probe. False: off for the run."""
        own, failed, share = self._collect()
        if not self.auto:
            _raise_failure(own, failed)
            return True
        why = f"writing to {self.base} failed ({own})" if own is not None else None
        if self.last_complete is None and not self._pairs:  # the first snapshot
            why = self._room(files, shards)
            failed = collectives.all_reduce_mean([float(why is not None)], device=torch.device("cpu"))[0] > 0
        if why is not None:
            print(f"dptrain: warning: rank {self.env.rank}: {why}", file=sys.stderr, flush=True)
        if failed:
            self.every_steps = 0  # on every rank alike
            if self.env.is_main:
                print("dptrain: warning: in-memory snapshots turned off for this run (set checkpoint.snapshot_dir to "
                      "a larger tmpfs, or checkpoint.snapshot_every_steps=0 to silence this)", file=sys.stderr,
                      flush=True)
            return False
        if share is not None and interval_for(share) > 1:
            self.every_steps = interval_for(share)
            if self.env.is_main:
                print(f"dptrain: in-memory snapshots every {self.every_steps} steps: one takes {share:.1%} of a "
                      "step's time (the default keeps them within 3%; set checkpoint.snapshot_every_steps to choose)",
                      file=sys.stderr, flush=True)
        return True

    def _room(self, files: dict[str, Any], shards: dict[str, Any] | None) -> str | None:
        """Before the first snapshot: why two of them would not fit the tmpfs (None: they fit; pace.py).
        Collective."""
        world = self.env.world_size
        mine = [0.0] * world
        mine[self.env.rank] = float(tree_bytes(files) + tree_bytes(shards))
        every = [v * world for v in collectives.all_reduce_mean(mine, device=torch.device("cpu"))]
        return room_problem(every, local_world=self.env.local_world_size, free=shutil.disk_usage(self.node_dir).free,
                            where=str(self.base))

    def _collect(self) -> tuple[BaseException | None, bool, float | None]:
        """Wait for the snapshot in flight: this rank's error, whether any rank failed, and the ranks' largest
        probe share (None: not measured); the snapshot is the newest complete one unless a rank failed."""
        if self._pending is None:
            return None, False, None
        step, fut = self._pending
        self._pending = None
        own, failed, share, cpu = fut.result()
        self._pace.background(cpu)
        if not failed:
            self.last_complete = step
        return own, failed, share

    def wait(self) -> None:
        """Wait for the snapshot in flight (re-raising its error, or saying that another rank's failed)."""
        own, failed, _ = self._collect()
        _raise_failure(own, failed)

    def _write_and_agree(self, part: dict[str, Any], staged: dict[str, flat.Staged] | None,
                         newest: int | None, share: float | None, staging: BaseException | None = None
                         ) -> tuple[BaseException | None, bool, float | None, float]:
        """`_write`, then every rank's agreement (one all-reduce on the snapshots' group, in the background): whether
        any failed, and the largest `share`; and what the write cost here (its CPU time, plus its replication's wall
        time). `staging`: the error that stopped
        this rank's staging (its write then only tells its peer). Never raises: a rank that failed still takes part in
        the agreement."""
        own: BaseException | None = None
        cpu, replicated = cpu_clock(), 0.0
        try:
            replicated = self._write(part, staged, newest)
        except Exception as e:  # noqa: BLE001 - reported to the step loop by _collect
            own = staging or e
        cpu = cpu_clock() - cpu + replicated  # an upper bound of what the write costs the machine
        if self._group is None:
            return own, own is not None, share, cpu
        failed, most = collectives.all_reduce_max([float(own is not None), -1.0 if share is None else share],
                                                  device=torch.device("cpu"), group=self._group)
        return own, failed > 0, None if most < 0 else most, cpu

    def _release(self, rank: int) -> Any:
        """What a slot calls before it is overwritten: delete the part of `rank` that names its old bytes."""
        return lambda step: (self.node_dir / PARTS / part_name(step, rank)).unlink(missing_ok=True)

    def _write(self, part: dict[str, Any], staged: dict[str, flat.Staged] | None, newest: int | None) -> float:
        """Write this rank's files and part (`staged` None: its staging failed; `newest`: the newest complete
        snapshot, kept with this one, older ones deleted), then trade replicas with the
        peers; a failure here still sends the peer a part (an empty, failed one) and receives the source's, so that
        no rank waits for a message that will never come. Raises this rank's first error; returns the seconds the
        transfer took once the source's write was done (wall time: gloo's own threads copy the bytes, which this
        thread's CPU time misses)."""
        error: BaseException | None = None
        small: dict[str, bytes] = {}
        big: dict[str, torch.Tensor] = {}
        try:
            if staged is None:
                raise RuntimeError("staging failed")  # (the error itself is reported by the step loop)
            if self.node_main:
                drop_steps(self.node_dir, keep={part["step"]} | ({newest} if newest is not None else set()))
            step_dir = self.node_dir / mf.step_dir_name(part["step"])
            step_dir.mkdir(parents=True, exist_ok=True)
            part["files"] = {}
            for name, st in staged.items():
                entries, skel = flat.commit(step_dir, name, st)
                part["files"].update(entries)
                big[name + flat.RAW], small[name + flat.SKEL] = st.slot.data, skel
            store_part(self.node_dir, part, {})
        except Exception as e:  # noqa: BLE001 - raised below, once the peers have their messages
            error, small, big = e, {}, {}
        arrived: list[float] = []
        if self.peer is not None:
            assert self.source is not None  # set with peer
            sends = replica.send({**part, "failed": error is not None}, small, big, peer=self.peer,
                                        group=self._group)
            try:
                got = replica.receive(self.node_dir, self._replica_pairs, source=self.source,
                                             group=self._group, avoid=newest,
                                             release=self._release(self.source), arrived=arrived)
            finally:
                replica.wait_all(sends)
            if got is not None and error is None:
                store_part(self.node_dir, *got)
        if error is not None:
            raise error
        return time.perf_counter() - arrived[0] if arrived else 0.0

    def finish(self, *, remove: bool) -> None:
        """Wait for the snapshot in flight and unmap the slots; with `remove` (the run ended normally, collective),
        delete the node's folder."""
        try:
            self.wait()
        finally:
            for pair in [*self._pairs.values(), *self._replica_pairs.values()]:
                pair.close()
            self._pairs, self._replica_pairs = {}, {}
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
    """Run `fn(*args)` on the snapshots' thread (one per process, started at the first call; calls run in order). A
    daemon thread: a snapshot blocked on a dead peer never holds up the exit of a failing worker (an executor's
    threads are joined at exit)."""
    fut: Future = Future()
    if _WORKER.get("pid") != os.getpid():  # none yet, or a forked child (which has its parent's queue, not its thread)
        _WORKER.update(pid=os.getpid(), queue=queue.SimpleQueue())
        threading.Thread(target=_work, args=(_WORKER["queue"],), name="dptrain-memsnap", daemon=True).start()
    _WORKER["queue"].put((fut, fn, args))
    return fut


_WORKER: dict[str, Any] = {}


def _work(jobs: queue.SimpleQueue) -> None:
    while True:
        fut, fn, args = jobs.get()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            fut.set_exception(e)


def _raise_failure(own: BaseException | None, failed: bool) -> None:
    """Re-raise this rank's snapshot error; or say that another rank's snapshot failed."""
    if own is not None:
        raise own
    if failed:
        raise RuntimeError("dptrain: an in-memory snapshot failed on another rank (its error is in that rank's log)")
