"""In-memory snapshots (checkpoint/snapshots/store.py, recover.py): selection, transfer plan, wire format,
the folder's life cycle, recovery on one process and replication + recovery across two fake hosts."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint import storage
from dptrain.checkpoint.snapshots import flat, rebuild, store
from dptrain.checkpoint.snapshots.folder import holdings, pack, remove_dead_runs, run_id, unpack
from dptrain.checkpoint.snapshots.live_state import LiveState, same_tree
from dptrain.checkpoint.snapshots.recover import choose, describe, plan_transfers, recover
from dptrain.checkpoint.snapshots.store import MemorySnapshots, snapshot_bytes
from dptrain.checkpoint.state import CheckpointState, ModelState, OptimizerState
from dptrain.config import ConfigError, validate
from dptrain.config.load import load_config
from dptrain.config.resolve import snapshot_every
from dptrain.distributed.env import DistEnv
from support.mp import in_group, run_ranks


def part(step: int, rank: int, world: int, host: str) -> dict:
    return {"step": step, "rank": rank, "world_size": world, "host": host, "files": {}, "meta": {"step": step}}


def hold(host: str, *pairs: tuple[int, int], world: int = 2) -> dict:
    """A node's holdings: (step, rank) parts, written by rank r on host "abc"[r]."""
    out: dict = {}
    for step, rank in pairs:
        out.setdefault(step, {})[rank] = part(step, rank, world, "abc"[rank])
    return out


@pytest.mark.fast
def test_choose_takes_the_newest_step_every_rank_of_its_world_can_be_built_from():
    a = hold("a", (4, 0), (5, 0), (6, 0), (5, 1))  # node a: its rank 0, and rank 1's replica of step 5
    b = hold("b", (4, 1), (5, 1), (6, 1), (4, 0))
    assert choose([("a", a), ("b", b)], min_step=0)[0] == 6  # both nodes alive
    step, parts = choose([("a", a)], min_step=0)  # node b lost: step 6 lacks rank 1, step 5 has its replica
    assert step == 5 and sorted(parts) == [0, 1]
    assert choose([("a", a)], min_step=6) is None  # the disk is newer than every complete snapshot
    assert choose([("b", hold("b", (3, 1), world=3))], min_step=0) is None  # a world of 3: ranks 0, 2 missing
    assert describe(5, parts, [("a", a)]) == ["rank 1 (host b) from host a's replica"]


@pytest.mark.fast
def test_plan_transfers_sends_each_missing_part_once_per_lacking_node_from_the_lowest_holder():
    a = hold("a", (5, 0), (5, 1))
    c = hold("c")  # a node that joined (or lost its memory): holds nothing
    ranks = [(0, "a", a), (1, "a", a), (2, "c", c), (3, "c", c)]
    assert plan_transfers(ranks, step=5) == [(0, 0, 2), (1, 0, 2)]
    assert plan_transfers([(0, "a", a), (1, "b", hold("b", (5, 1), (5, 0)))], step=5) == []


@pytest.mark.fast
def test_pack_unpack_round_trip():
    files = {"model.pt": b"\x00" * 10, "rank_00001.pt": b"abc", "empty": b""}
    got_part, got = unpack(pack({"rank": 1, "step": 3}, files))
    assert got_part == {"rank": 1, "step": 3} and got == files


@pytest.mark.fast
def test_memory_every_steps_is_checked_and_accepted_for_every_format():
    with pytest.raises(ConfigError, match=r"checkpoint.snapshot_every_steps=-1"):
        validate(load_config(None, ["checkpoint.snapshot_every_steps=-1"]))
    for strategy in ("zero1", "fsdp", "zero2"):
        validate(load_config(None, ["checkpoint.snapshot_every_steps=1", f"parallel.strategy={strategy}"]))


@pytest.mark.fast
def test_by_default_snapshots_are_on_every_step_when_the_run_can_restart():
    def every(*over: str, restarts: int) -> int:
        return snapshot_every(load_config(None, list(over)), max_restarts=restarts)

    assert load_config(None, []).checkpoint.snapshot_every_steps is None
    assert DistEnv.from_env({"TORCHELASTIC_MAX_RESTARTS": "2"}).max_restarts == 2  # torchrun's budget, per worker
    assert DistEnv.from_env({}).max_restarts == 0
    assert every("parallel.strategy=ddp", restarts=1) == 1
    assert every("parallel.strategy=zero1", restarts=3) == 1
    assert every("parallel.strategy=ddp", restarts=0) == 0  # no restart: nothing would read them
    assert every("parallel.strategy=fsdp", restarts=1) == 1  # DCP shards
    assert every("parallel.strategy=fsdp", restarts=0) == 0
    assert every("parallel.strategy=ddp", "checkpoint.snapshot_every_steps=0", restarts=1) == 0
    assert every("parallel.strategy=ddp", "checkpoint.snapshot_every_steps=5", restarts=0) == 5


@pytest.mark.fast
@pytest.mark.parametrize("failure", ["no room", "write fails"])
def test_default_snapshots_turn_off_with_a_warning_when_the_tmpfs_cannot_hold_them(tmp_path, monkeypatch, capsys,
                                                                                   failure):
    """A small /dev/shm (a container's 64 MiB) or a write that fails: the default turns itself off, training goes on;
    an explicit checkpoint.snapshot_every_steps still fails loudly."""
    env = DistEnv(hostname="h")
    snap = MemorySnapshots(every_steps=1, root=str(tmp_path), run_dir=tmp_path / "run", env=env, auto=True)
    snap.start(fresh=True)
    if failure == "no room":
        monkeypatch.setattr(store.shutil, "disk_usage", lambda _: type("U", (), {"free": 1 << 10})())
    else:
        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(flat, "commit", full)
    snap.snapshot(step=1, files=snapshot_files(1, 0), meta={"step": 1, "world_size": 1})
    snap.snapshot(step=2, files=snapshot_files(2, 0), meta={"step": 2, "world_size": 1})
    assert not snap.enabled and not snap.due(3)
    err = capsys.readouterr().err
    assert "in-memory snapshots turned off" in err
    assert ("MiB free" if failure == "no room" else "No space left on device") in err
    if failure == "write fails":
        loud = MemorySnapshots(every_steps=1, root=str(tmp_path), run_dir=tmp_path / "run2", env=env)
        loud.start(fresh=True)
        loud.snapshot(step=1, files=snapshot_files(1, 0), meta={"step": 1, "world_size": 1})
        with pytest.raises(OSError, match="No space left"):
            loud.wait()


def snapshot_files(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(step * 10 + rank)
    files = {f"rank_{rank:05d}.pt": {"rng": torch.rand(4, generator=g)}}
    if rank == 0:
        files["model.pt"] = {"w": torch.rand(64, 64, generator=g)}
        files["optim.pt"] = {"state": {"w": {"exp_avg": torch.rand(64, 64, generator=g)}}}
    return files


@pytest.mark.fast
def test_one_process_keeps_two_snapshots_recovers_the_newest_and_falls_back_on_corruption(tmp_path):
    env = DistEnv(hostname="h")
    snap = MemorySnapshots(every_steps=1, root=str(tmp_path), run_dir=tmp_path / "run", env=env)
    snap.start(fresh=True)
    for step in (1, 2, 3):
        snap.snapshot(step=step, files=snapshot_files(step, 0), meta={"step": step, "world_size": 1})
    snap.wait()
    assert sorted(holdings(snap.node_dir)) == [2, 3]  # the newest complete one and the one written after it
    assert [mf.step_of(d) for d in mf.step_dirs(snap.node_dir)] == [2, 3]
    again = MemorySnapshots(every_steps=1, root=str(tmp_path), run_dir=tmp_path / "run", env=env)
    choice, _ = recover(again, min_step=0)
    assert choice is not None and choice.step == 3 and choice.replicas == []
    assert mf.verify(choice.path) == {"step": 3, "world_size": 1}  # a committed checkpoint folder
    model = storage.load_torch(choice.path / "model.pt")
    torch.testing.assert_close(model, snapshot_files(3, 0)["model.pt"], rtol=0, atol=0)
    assert sorted(holdings(snap.node_dir)) == [3]  # only the chosen snapshot stays
    raw = choice.path.parent / "model.pt.raw"  # the snapshot's own file (the checkpoint is rebuilt from it)
    data = bytearray(raw.read_bytes())
    data[-10] ^= 0xFF
    raw.write_bytes(bytes(data))
    choice, messages = recover(again, min_step=0)
    assert choice is None and "xxh3" in " ".join(messages) and "from disk" in messages[-1]
    assert holdings(snap.node_dir) == {}
    snap.finish(remove=True)
    assert not snap.node_dir.exists()


@pytest.mark.fast
def test_dead_runs_folders_are_removed_live_ones_kept(tmp_path):
    for name, pid in (("dead", 2**22 + 12345), ("live", os.getpid()), ("mine", 2**22 + 12345)):
        (tmp_path / name / "h").mkdir(parents=True)
        (tmp_path / name / "h" / "owner.json").write_text(json.dumps({"pid": pid}))
    (tmp_path / "dead" / "other-host").mkdir()  # another node's folder of the dead run is not this host's to judge
    assert remove_dead_runs(tmp_path, host="h", own="mine") == [tmp_path / "dead" / "h"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dead", "live", "mine"]
    assert run_id(tmp_path / "x") == run_id(tmp_path / "." / "x") != run_id(tmp_path / "y")


def two_hosts(rank: int, root: str, run_dir: str) -> tuple:
    """Two ranks on two fake hosts: snapshots replicate to each other; host b then loses its memory and
    recovery sends it rank 0's and rank 1's parts from host a's copies."""

    def body() -> tuple:
        env = DistEnv(rank=rank, world_size=2, local_world_size=1, hostname="ab"[rank])
        snap = MemorySnapshots(every_steps=1, root=root, run_dir=Path(run_dir), env=env)
        snap.start(fresh=True)
        for step in (1, 2):
            snap.snapshot(step=step, files=snapshot_files(step, rank), meta={"step": step, "world_size": 2})
        snap.wait()
        held = {s: sorted(p) for s, p in holdings(snap.node_dir).items()}
        torch.distributed.barrier()
        if rank == 1:  # host b's memory is gone (a replaced node)
            import shutil

            shutil.rmtree(snap.node_dir)
        torch.distributed.barrier()
        choice, _ = recover(snap, min_step=0)
        assert choice is not None
        rank_file = storage.load_torch(choice.path / f"rank_{rank:05d}.pt")
        model = storage.load_torch(choice.path / "model.pt")
        snap.finish(remove=True)
        return held, choice.step, choice.replicas, rank_file["rng"], model["w"]

    return in_group(body)


@pytest.mark.timeout(60)
def test_snapshots_replicate_to_the_other_host_and_a_host_without_memory_is_sent_them(tmp_path):
    results = run_ranks(two_hosts, 2, str(tmp_path / "mem"), str(tmp_path / "run"), timeout=50)
    for rank, (held, step, _, rng, model) in enumerate(results):
        assert held == {1: [0, 1], 2: [0, 1]}  # its own part and the other host's replica
        assert step == 2
        torch.testing.assert_close(rng, snapshot_files(2, rank)[f"rank_{rank:05d}.pt"]["rng"], rtol=0, atol=0)
        torch.testing.assert_close(model, snapshot_files(2, 0)["model.pt"]["w"], rtol=0, atol=0)
    assert results[0][2] == ["rank 1 (host b) from host a's replica"]
    assert not (tmp_path / "mem" / run_id(tmp_path / "run")).exists()


@pytest.mark.fast
def test_the_memory_formula_for_two_nodes_of_two_ranks():
    got = snapshot_bytes(param_bytes=100, optim_bytes=200, rank_file_bytes=10, world=4, local_world=2)
    assert got == 2 * (2 * 10 + 2 * 10 + 300)


@pytest.mark.fast
@pytest.mark.parametrize("extra", [None, torch.Size([2, 3])], ids=["plain data", "torch.Size (torch.save skeleton)"])
def test_the_raw_snapshot_format_rebuilds_the_file_torch_save_would_write(tmp_path, extra):
    tree = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 2)},
                  1: {"m": torch.ones(2, dtype=torch.bool)}},
        "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.99)}],
        "half": torch.randn(3, dtype=torch.bfloat16), "empty": torch.empty(0, 4), "n": None, "odd": torch.arange(3,
                                                                                                      dtype=torch.uint8),
        "wide": torch.arange(5, dtype=torch.float64), "rng": (3, tuple(range(625)), None), "extra": extra,
    }
    torch.save(tree, tmp_path / "want.pt")
    pair = flat.Pair(tmp_path / "slots" / "optim.pt.raw")
    staged = flat.stage(pair, tree, step=1, avoid=None, release=lambda step: None)
    assert staged.plain is (extra is None)
    tree["state"][0]["exp_avg"].add_(1.0)  # the live state moves on: the snapshot holds the copy taken at stage()
    step_dir = tmp_path / "step_000001"
    step_dir.mkdir()
    entries, _ = flat.commit(step_dir, "optim.pt", staged)
    assert sorted(entries) == ["optim.pt.raw", "optim.pt.skel"]
    assert os.path.samefile(step_dir / "optim.pt.raw", staged.slot.path)  # the slot is the file: linked, not copied
    assert rebuild.logical_names(entries) == ["optim.pt"]
    rebuild.materialize(step_dir, "optim.pt", tmp_path / "optim.pt")
    got = storage.load_torch(tmp_path / "optim.pt")
    want = storage.load_torch(tmp_path / "want.pt")
    assert got["param_groups"] == want["param_groups"] and got["n"] is None and got["rng"] == want["rng"]
    assert got["extra"] == want["extra"] and type(got["extra"]) is type(want["extra"])
    for key in ("half", "empty", "odd", "wide"):
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key])
    got_state, want_state = got["state"], want["state"]
    for a, b in ((got_state[0]["exp_avg"], want_state[0]["exp_avg"]), (got_state[1]["m"], want_state[1]["m"]),
                 (got_state[0]["step"], want_state[0]["step"])):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.fast
def test_slots_alternate_never_overwrite_the_newest_complete_snapshot_and_release_the_old_part(tmp_path):
    """Two slots per file: a snapshot writes into the one not holding the newest complete snapshot, tells which
    step that slot held (its part is deleted before the bytes change), and a slot a step folder still links keeps
    its bytes when the pair is remade (a new file, as after a restart)."""
    pair = flat.Pair(tmp_path / "slots" / "m.pt.raw")
    released = []
    live = {"w": torch.zeros(4)}
    held = {}
    for step in (1, 2, 3, 4):
        live["w"].fill_(step)
        staged = flat.stage(pair, live, step=step, avoid=step - 1 if step > 1 else None, release=released.append)
        held[step] = staged.slot
    assert released == [1, 2]  # step 3 overwrote step 1's slot, step 4 step 2's; never the newest complete
    assert held[1] is held[3] and held[2] is held[4] and held[3] is not held[4]
    assert held[4].views[0].tolist() == [4.0] * 4 and held[3].views[0].tolist() == [3.0] * 4
    step_dir = tmp_path / "step_000004"
    step_dir.mkdir()
    flat.commit(step_dir, "m.pt", flat.Staged(held[4], {"w": (flat.TENSOR, 0)}, [0], True))
    pair.close()
    again = flat.Pair(tmp_path / "slots" / "m.pt.raw")  # a new process: new files under the same names
    live["w"].fill_(9)
    flat.stage(again, live, step=5, avoid=4, release=released.append)
    flat.stage(again, live, step=6, avoid=5, release=released.append)
    assert flat.materialize_raw(step_dir, "m.pt")["w"].tolist() == [4.0] * 4


@pytest.mark.fast
def test_a_skeleton_names_no_global_unless_torch_save_wrote_it():
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="posix.system|nt.system"):
        flat.load_skeleton(pickle.dumps({"skeleton": Evil()}))
    plain = {"a": (1, 2.5, "x"), 3: [None, True]}
    assert flat.load_skeleton(flat.dump_skeleton(plain, plain=True)) == plain


def sharded_two_hosts(rank: int, root: str, run_dir: str) -> tuple:
    """Two ranks on two fake hosts with an FSDP2 model: the snapshots' shards replicate to each other;
    host b then loses its memory and recovery sends it every part. The recovered checkpoint's model, read in
    full without a process group, must be the full model at the snapshot's step."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def body() -> tuple:
        env = DistEnv(rank=rank, world_size=2, local_world_size=1, hostname="ab"[rank])
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Linear(5, 3))  # uneven shards: 3 + 2, 2 + 1 rows
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        snap = MemorySnapshots(every_steps=1, root=root, run_dir=Path(run_dir), env=env)
        snap.start(fresh=True)
        full = {}
        for step in (1, 2):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step + rank))).sum().backward()
            opt.step()
            opt.zero_grad()
            shards = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            full = {k: v.full_tensor().clone() for k, v in shards["model"].items()}
            snap.snapshot(step=step, files={f"rank_{rank:05d}.pt": {"rng": torch.tensor([rank])}},
                          meta={"step": step, "world_size": 2, "format": "dcp"}, shards=shards)
        snap.wait()
        held = {s: sorted(p) for s, p in holdings(snap.node_dir).items()}
        torch.distributed.barrier()
        if rank == 1:
            import shutil

            shutil.rmtree(snap.node_dir)
        torch.distributed.barrier()
        choice, _ = recover(snap, min_step=0)
        assert choice is not None
        loaded = storage.load_full_model_state(choice.path, fmt="dcp")
        files = sorted(p.relative_to(choice.path).as_posix() for p in choice.path.rglob("*") if p.is_file())
        snap.finish(remove=True)
        return held, choice.step, choice.replicas, files, full, loaded

    return in_group(body)


@pytest.mark.timeout(60)
def test_sharded_snapshots_replicate_dcp_shards_and_recover_the_full_model(tmp_path):
    results = run_ranks(sharded_two_hosts, 2, str(tmp_path / "mem"), str(tmp_path / "run"), timeout=50)
    for held, step, _, files, full, loaded in results:
        assert held == {1: [0, 1], 2: [0, 1]} and step == 2
        assert {"dcp/.metadata", "dcp/__0_0.distcp", "manifest.json", "COMMITTED", "rank_00000.pt",
                "rank_00001.pt"} <= set(files)  # the shards put together, written by DCP in one process
        assert sorted(loaded) == sorted(full)
        for name, tensor in full.items():
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)
    assert results[0][2] == ["rank 1 (host b) from host a's replica"]


@pytest.mark.fast
def test_the_sharded_memory_formula_and_the_room_rule():
    from dptrain.checkpoint.snapshots.pace import interval_for, room_needed, room_problem

    got = snapshot_bytes(param_bytes=400, optim_bytes=800, rank_file_bytes=10, world=4, local_world=2, sharded=True)
    assert got == 2 * 2 * (10 + 1200 / 4) * 2  # 2 snapshots x 2 local ranks x (rank file + 1/4 of state) x replica
    assert room_needed([300.0, 10.0, 10.0, 10.0], local_world=2) == 2 * (20 + 310)  # node 1 holds node 0's replica
    assert room_needed([300.0, 10.0], local_world=2) == 2 * 310  # one node: no replica
    assert room_problem([300.0, 10.0], local_world=2, free=1240, where="/x") is None
    assert "about 0 MiB" in (room_problem([300.0, 10.0], local_world=2, free=1238, where="/x") or "")
    assert [interval_for(s) for s in (0.0, 0.03, 0.031, 0.09, 0.5)] == [1, 1, 2, 3, 17]


@pytest.mark.fast
def test_the_default_widens_the_interval_when_a_snapshot_costs_more_than_its_budget(tmp_path, monkeypatch, capsys):
    """A fake clock: a step takes 100 ms, each snapshot holds the loop 10 ms and its background write spends 20 ms of
    CPU: 30% of a step. The default probes at every step, then snapshots every 10 steps (30% / 3%); an explicit
    interval is never changed, and a cheap snapshot stays at every step."""
    from dptrain.checkpoint.snapshots import pace

    now, cpu = [0.0], [0.0]
    monkeypatch.setattr(pace.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(pace.time, "thread_time", lambda: cpu[0])
    real_start, real_write = store.in_background, MemorySnapshots._write
    costs = {"hold": 0.01, "write": 0.02}

    def slow_start(*args):
        now[0] += costs["hold"]  # what the snapshot holds the loop for
        return real_start(*args)

    def slow_write(self, *args):
        cpu[0] += costs["write"]  # the background write's CPU time
        return real_write(self, *args)

    monkeypatch.setattr(store, "in_background", slow_start)
    monkeypatch.setattr(MemorySnapshots, "_write", slow_write)
    env = DistEnv(hostname="h")
    for auto, hold, want in ((True, 0.01, 10), (False, 0.01, 1), (True, 0.001, 1)):
        costs["hold"], costs["write"] = hold, 2 * hold
        snap = MemorySnapshots(every_steps=1, root=str(tmp_path / f"{auto}{hold}"), run_dir=tmp_path / "run", env=env,
                               auto=auto)
        snap.start(fresh=True)
        taken = []
        for step in range(1, 41):
            now[0] += 0.1  # the step
            if snap.due(step):
                taken.append(step)
                snap.snapshot(step=step, files={"rank_00000.pt": {"rng": torch.ones(2)}, "train.pt": {"x": 1}},
                              meta={"step": step, "world_size": 1})
        snap.finish(remove=True)
        assert snap.every_steps == want
        assert taken == ([*range(1, 12), 20, 30, 40] if want == 10 else list(range(1, 41)))
    assert "in-memory snapshots every 10 steps: one takes 30.0% of a step's time" in capsys.readouterr().err



def failing_write(rank: int, root: str, run_dir: str, auto: bool, where: str) -> tuple:
    """Rank 1's write of step 2 fails: its tmpfs is full when it links a file (`commit`) or when it makes a slot
    (`slot`: a layout change that needs a new file). The ranks sit on two fake hosts, so they also trade replicas:
    the failing rank still sends its peer a (failed) part, so nobody waits forever. The ranks agree on the failure
    in the background; at the next snapshot the default turns itself off on both, an explicit interval fails on
    both (rank 1 with its own error)."""

    def body() -> tuple:
        env = DistEnv(rank=rank, world_size=2, local_world_size=1, hostname="ab"[rank])
        snap = MemorySnapshots(every_steps=1, root=root, run_dir=Path(run_dir), env=env, auto=auto)
        snap.start(fresh=True)
        real_commit, real_fallocate = flat.commit, flat.os.posix_fallocate
        full = OSError(28, "No space left on device")

        def commit(step_dir, name, staged):
            if rank == 1 and step_dir.name == "step_000002":
                raise full
            return real_commit(step_dir, name, staged)

        def fallocate(fd, offset, size):  # the step loop's staging of step 2 (not the replica thread's)
            if where == "slot" and rank == 1 and step[0] == 2 and threading.current_thread() is threading.main_thread():
                raise full
            return real_fallocate(fd, offset, size)

        flat.commit = commit
        flat.os.posix_fallocate = fallocate
        step, error = [0], None
        try:
            for step[0] in (1, 2, 3, 4):
                if snap.enabled:  # (the step loop asks `due`, which says no once the default is off)
                    files = snapshot_files(step[0], rank)
                    if where == "slot" and step[0] == 2:
                        files[f"rank_{rank:05d}.pt"]["rng"] = torch.rand(8)  # another layout: new slots
                    snap.snapshot(step=step[0], files=files, meta={"step": step[0], "world_size": 2})
            snap.wait()
        except (OSError, RuntimeError) as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            flat.commit, flat.os.posix_fallocate = real_commit, real_fallocate
        return snap.enabled, snap.last_complete, error

    return in_group(body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["commit", "slot"])
@pytest.mark.parametrize("auto", [True, False], ids=["default", "explicit"])
def test_a_rank_whose_write_fails_stops_every_ranks_snapshots_alike(tmp_path, auto, where):
    results = run_ranks(failing_write, 2, str(tmp_path / "mem"), str(tmp_path / "run"), auto, where, timeout=50)
    if auto:
        assert results == [(False, 1, None), (False, 1, None)]  # off on both; step 1 stays the newest complete one
    else:
        (_, done0, err0), (_, done1, err1) = results
        assert done0 == done1 == 1
        assert err1 == "OSError: [Errno 28] No space left on device"
        assert err0 is not None and "failed on another rank" in err0


class Counter:
    """A minimal Stateful."""

    def state_dict(self) -> dict:
        return {"n": 1}

    def load_state_dict(self, sd: dict) -> None:
        pass


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.weight.requires_grad_(False)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.head(self.frozen(self.emb(x)))


@pytest.mark.fast
@pytest.mark.parametrize("case", ["untied", "tied embedding and head", "live differs"])
def test_the_snapshots_live_state_dicts_equal_dcps_or_dcps_are_used(case, monkeypatch):
    """The snapshots take the full format's state dicts from the module's and optimizer's own state_dict (30x
    cheaper) once they equal DCP's helpers' (what a disk checkpoint holds: the reference), with a frozen parameter, a
    buffer and a tied one too; where they do not, DCP's are used. Either way every call equals DCP's at its step."""
    tied = case == "tied embedding and head"
    if case == "live differs":
        real = ModelState.live_state_dict
        monkeypatch.setattr(ModelState, "live_state_dict", lambda self: {k: v for k, v in real(self).items()
                                                                         if k != "seen"})
    torch.manual_seed(0)
    model = Tied()
    if tied:
        model.head.weight = model.emb.weight  # (10, 4) both
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    state = CheckpointState(model_parts=[ModelState(model, full=True)],
                            optimizers=[OptimizerState(model, opt, full=True)], schedule=Counter(), scaler=None,
                            data=Counter(), train=Counter(), full=True)
    live = LiveState()
    for _ in range(3):
        model(torch.tensor([1, 2, 3])).sum().backward()
        opt.step()
        opt.zero_grad()
        got = live(state, rank=0)
        assert same_tree(got, storage.full_state_dicts(state, rank=0))
    assert live.agreed is (case != "live differs")
    assert live(state, rank=1) == {}


@pytest.mark.fast
def test_shards_are_put_together_across_ranks_and_a_gap_is_refused():
    """Recovery's merge: pipeline stages' different keys are united, a shard held by two ranks (a replicated mesh
    dimension) counts once, plain values come from the first rank; shards that leave a gap are refused, named."""
    w = torch.arange(12.0).reshape(4, 3)
    piece = lambda rows, at: flat.Chunk(shape=[4, 3], offsets=[at, 0], tensor=w[rows].clone())  # noqa: E731
    rank0 = {"model": {"a.w": piece(slice(0, 2), 0)}, "optim": {"lr": 0.1}}
    rank1 = {"model": {"a.w": piece(slice(2, 4), 2), "b.w": torch.ones(2)}, "optim": {"lr": 0.2}}
    replica = {"model": {"a.w": piece(slice(0, 2), 0)}}
    whole = rebuild.merge([rank0, rank1, replica], where=[])
    assert torch.equal(whole["model"]["a.w"], w) and torch.equal(whole["model"]["b.w"], torch.ones(2))
    assert whole["optim"] == {"lr": 0.1}
    with pytest.raises(mf.CheckpointError, match=r"model.a.w: the snapshot's shards cover 6 of its 12 elements"):
        rebuild.merge([rank0, replica], where=[])
