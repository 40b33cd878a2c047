"""In-memory snapshots (`checkpoint.snapshot_every_steps`): their cost per step, their host memory, and recovery
from them after a worker SIGKILL and after a node loss.

    python benchmarks/perf/memory_snapshots.py overhead [--rounds 60]   # 2 ranks under torchrun, built-in recipe
    python benchmarks/perf/memory_snapshots.py overhead --strategy fsdp # the same, sharded state (DCP shards)
    python benchmarks/perf/memory_snapshots.py overhead --nodes 2       # each rank its own node: replicated every step
    python benchmarks/perf/memory_snapshots.py kill                     # 2 ranks, --max-restarts 1, rank 1 SIGKILLed
    python benchmarks/perf/memory_snapshots.py nodeloss                 # two-host netns cluster (root), node 1 killed

`overhead`: three Trainers of the built-in recipe (`dptrain run` defaults) on one process group take turns
in blocks of BLOCK steps (slow drift of the machine hits all alike; a block's first step is not timed, so the
background write of a snapshot slows the steps of its own run, as in a real run, not the next variant's):
`off`, `memory every step`, `off again` (the noise). Rank 0 prints the median step time of each and the
difference to `off`; then the bytes of the node's snapshot folder (measured: the sum of its files' sizes)
against `snapshot_bytes` from the model's parameter and optimizer-state bytes.

`kill` and `nodeloss`: the disk checkpoint interval (1000) is longer than the run, so a resume at a step
above 0 comes from memory; seconds from the kill to the first finished step of the new worker group, steps
lost (last finished step before the kill - resumed step). `nodeloss` then trains the reference (2 ranks to
the resumed step, then `--resume` at world size 1) and compares the final weights and the loss records.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from dptrain.tools.bench.harness import dptrain_run, read_jsonl  # noqa: E402

MEMORY = ["checkpoint.every_steps=1000", "checkpoint.snapshot_every_steps=1"]


BLOCK = 4
"""Steps each variant runs in a row; all but the first are timed, so a snapshot's background write is charged to the
steps of its own run (it overlaps the next step), as in a real run."""


def env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


# ------------------------------------------------------------------ overhead (inside torchrun)
def overhead_worker(rounds: int, strategy: str | None = None, nodes: int = 1) -> None:
    import torch
    import torch.distributed as dist

    from dptrain.checkpoint.snapshots.store import snapshot_bytes
    from dptrain.config.load import load_config
    from dptrain.tools.bench.harness import run_step
    from dptrain.train.trainer import Trainer

    dist.init_process_group("gloo")
    base = Path(tempfile.gettempdir()) / f"dptrain-memsnap-bench-{os.environ['MASTER_PORT']}"  # the same on both ranks
    variants = {"off": [], "memory every step": MEMORY, "default (paced)": MEMORY, "off (again)": []}  # in /dev/shm
    trainers = {}
    layout = [f"parallel.strategy={strategy}"] if strategy else []
    for name, items in variants.items():
        cfg = load_config(None, ["log.progress=false", f"train.max_steps={rounds + 10}", *layout, *items])
        trainers[name] = Trainer(cfg, out_dir=base / name.replace(" ", "-"))
        trainers[name].setup()
    for name in ("memory every step", "default (paced)"):  # the default as a restartable run has it (auto)
        own_snapshots(trainers[name], nodes=nodes, auto=name.startswith("default"))
    times: dict[str, list[float]] = {name: [] for name in variants}
    phases: dict[str, list[float]] = {"snapshot() on the step's path": [], "background write (+ replication)": []}
    for name, tr in trainers.items():
        phases[f"{name}: checkpoint boundary"] = []
        tr.ckpt.maybe_save = timed(tr.ckpt.maybe_save, phases[f"{name}: checkpoint boundary"])
    snap = trainers["memory every step"].ckpt.memory
    for attr, key in (("snapshot", "snapshot() on the step's path"), ("_write", "background write (+ replication)")):
        setattr(snap, attr, timed(getattr(snap, attr), phases[key]))
    for tr in trainers.values():
        for _ in range(3):
            run_step(tr)
    for _ in range(max(1, rounds // (BLOCK - 1))):
        for name, tr in trainers.items():
            for i in range(BLOCK):  # the block's first step absorbs the previous variant's background write
                dist.barrier()
                t0 = time.perf_counter()
                run_step(tr)
                if i > 0:
                    times[name].append(time.perf_counter() - t0)
    on = trainers["memory every step"]
    paced = trainers["default (paced)"].ckpt.memory.every_steps  # the interval the default chose
    on.ckpt.memory.wait()
    inodes = {(st.st_dev, st.st_ino): st.st_size  # a slot and its step folder's link are one file
              for st in (p.stat() for p in on.ckpt.memory.node_dir.rglob("*") if p.is_file())}
    measured = sum(inodes.values())
    params = sum(p.numel() * p.element_size() for p in on.model.parameters())  # a DTensor's numel: the whole
    optim = sum(
        v.numel() * v.element_size()
        for st in on.optimizer.state_dict()["state"].values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    step_dir = next(on.ckpt.memory.node_dir.glob("step_*"))
    rank_file = sum(p.stat().st_size for p in step_dir.glob("rank_00001.pt.*"))  # its .raw + .skel
    world, local = dist.get_world_size(), 1 if nodes == 2 else int(os.environ["LOCAL_WORLD_SIZE"])
    sharded = on.ckpt.memory.sharded  # the run snapshotted DCP shards
    live = on.ckpt._live.agreed  # the snapshots took the module's and optimizer's own state dicts (live_state.py)
    formula = snapshot_bytes(param_bytes=params, optim_bytes=optim, rank_file_bytes=rank_file, world=world,
                             local_world=local, sharded=sharded)
    for tr in trainers.values():
        tr.close()
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {k: statistics.median(v) * 1e3 for k, v in phases.items()})
    if dist.get_rank() == 0:
        base = statistics.median(times["off"])
        print(f"built-in recipe{f' with parallel.strategy={strategy}' if strategy else ''}, world size {world}, "
              f"{rounds} interleaved steps per variant"
              f"{', each rank its own node: every snapshot replicated to the other rank' if nodes == 2 else ''}")
        mean_base = statistics.fmean(times["off"])  # the mean counts a paced run's snapshot steps in full
        print("| variant | median step (ms) | vs off (ms) | vs off (%) | mean step (ms) | mean vs off (%) |\n"
              "|---|---|---|---|---|---|")
        for name, ts in times.items():
            med, mean = statistics.median(ts), statistics.fmean(ts)
            print(f"| {name} | {med * 1e3:.2f} | {(med - base) * 1e3:+.2f} | {(med / base - 1) * 100:+.1f}% | "
                  f"{mean * 1e3:.2f} | {(mean / mean_base - 1) * 100:+.1f}% |")
        for r, ph in enumerate(per_rank):
            print(f"rank {r}: " + ", ".join(f"{k} {v:.1f} ms (median)" for k, v in ph.items()))
        which = "the module's and optimizer's own (equal to DCP's)" if live else "DCP's helpers'"
        print(f"\nstate dicts snapshotted: {which}; the default (paced) chose every {paced} step(s)")
        print(f"parameters {params} B, optimizer state {optim} B, rank file {rank_file} B")
        print(f"snapshot folder of the node (2 snapshots kept at most; measured with 2 present): {measured} B; "
              f"formula ({WHAT[sharded]}) = {formula} B ({measured / formula:.3f} of it)")
    dist.destroy_process_group()


WHAT = {False: "2 x (model + optimizer + rank files)",
        True: "sharded: 2 x local ranks x ((model + optimizer) / world + rank file)"}


def timed(fn, into: list[float]):
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return run


def own_snapshots(tr, *, nodes: int, auto: bool) -> None:
    """Give a Trainer snapshots at every step (`auto`: the default's, which probes and paces itself, as in a run that
    can restart); with `nodes` 2 each rank is a node of its own (local world 1, its own host folder), so that each
    snapshot is also sent to the other rank and its snapshot received, over loopback: the replication's cost."""
    import dataclasses

    from dptrain.checkpoint.snapshots.store import MemorySnapshots

    old = tr.ckpt.memory
    env = old.env if nodes == 1 else dataclasses.replace(old.env, local_world_size=1, local_rank=0,
                                                         hostname=f"bench-node{old.env.rank}")
    tr.ckpt.memory = MemorySnapshots(every_steps=1, root=str(old.base), run_dir=tr.run_dir, env=env, auto=auto)
    tr.ckpt.memory.start(fresh=True)
    assert (tr.ckpt.memory.peer is not None) == (nodes == 2)


def overhead(a: argparse.Namespace) -> None:
    from dptrain.tools.bench.harness import under_torchrun

    extra = ["--strategy", a.strategy] if a.strategy else []
    extra += ["--nodes", str(a.nodes)]
    raise SystemExit(under_torchrun(lambda: overhead_worker(a.rounds, a.strategy, a.nodes), script=__file__,
                                    argv=["overhead", "--rounds", str(a.rounds), *extra], nproc=2))


# ------------------------------------------------------------------ kill / node loss (outside)
def metrics_steps(out: Path) -> list[int]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(s)["step"] for s in lines if '"loss"' in s and s.endswith("}")]


def progress(out: Path) -> list[dict]:
    out_ = []
    for p in (out / "attempts").glob("rank*.json"):
        try:
            out_.append(json.loads(p.read_text()))
        except ValueError:
            pass
    return out_


def wait(what: str, cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not reached in {timeout}s")
        time.sleep(0.005)


def worker_pid(proc: subprocess.Popen, rank: int) -> int:
    import psutil

    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "dptrain.launch.worker" in " ".join(child.cmdline()) and child.environ().get("RANK") == str(rank):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise SystemExit(f"no worker of rank {rank}")


RUN = ["train.log_every_steps=1", "log.progress=false", "train.eval_every_steps=0"]


def kill(a: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="dptrain-memsnap-kill-"))
    out = tmp / "run"
    argv = [sys.executable, "-m", "dptrain", "run", *RUN, *MEMORY, f"checkpoint.snapshot_dir={tmp / 'mem'}",
            f"train.max_steps={a.steps}", "--nproc-per-node", "2", "--max-restarts", "1", "--out", str(out)]
    proc = subprocess.Popen(argv, env=env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait("step reached", lambda: max(metrics_steps(out), default=0) >= a.kill_at, 300)
    before = max(metrics_steps(out))
    os.kill(worker_pid(proc, 1), signal.SIGKILL)
    killed = time.monotonic()
    wait("training again", lambda: len(progress(out)) == 2 and all(
        p["attempt"] == 1 and p["step"] is not None for p in progress(out)), 120)
    again = time.monotonic() - killed
    output = proc.communicate(timeout=600)[0]
    found = re.search(r"resumed from memory snapshot step (\d+)", output)
    last = json.loads((out / "attempts.jsonl").read_text())["last_step"]
    disk = sorted(p.name for p in (out / "checkpoints").iterdir())
    print(f"exit {proc.returncode}; SIGKILL of rank 1 after step {before} (last finished step {last})")
    print(found.group(0) if found else "NOT resumed from memory:\n" + output[-2000:])
    if found:
        print(f"training again {again:.2f}s after the kill; steps lost {last - int(found.group(1))}")
    print(f"disk checkpoints at the end: {disk} (every_steps=1000: only the final save)")


def nodeloss(a: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file

    from dptrain.tools.netns import Cluster, dptrain_argv

    tmp = Path(tempfile.mkdtemp(prefix="dptrain-memsnap-node-"))
    out, mem = tmp / "run", tmp / "mem"
    items = [*RUN, *MEMORY, f"checkpoint.snapshot_dir={mem}", f"train.max_steps={a.steps}", "optim.name=sgd",
             "model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
             "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
             "train.global_batch_size=8", "train.micro_batch_size=2", "launch.max_restarts=3",
             "launch.rdzv_conf=last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"]
    logs = [tmp / "node0.log", tmp / "node1.log"]
    with Cluster(rate="1gbit") as c:
        procs = [
            c.popen(i, dptrain_argv([*items, *c.launch_overrides(i, nnodes="1:2"), "--nproc-per-node", "1",
                                     "--out", str(out)]),
                    cwd=ROOT, env=env(), stdout=open(logs[i], "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
            for i in range(2)
        ]
        wait("both nodes training", lambda: max(metrics_steps(out), default=0) >= a.kill_at, 300)
        c.kill_node(1)
        killed = time.monotonic()

        def again() -> bool:
            p = [r for r in progress(out) if r.get("generation", 0) >= 1]
            return bool(p) and p[0].get("step") is not None

        wait("node 0 training alone", again, 120)
        again_s = time.monotonic() - killed
        procs[0].wait(timeout=600)
        host1 = c.hostnames[1]
    log = logs[0].read_text()
    found = re.search(r"resumed from memory snapshot step (\d+) .*", log)
    if not found:
        raise SystemExit("NOT resumed from memory:\n" + log[-3000:])
    k = int(found.group(1))
    change = [json.loads(s) for s in (out / "attempts.jsonl").read_text().splitlines() if '"membership"' in s]
    print(f"node {host1} killed; {found.group(0)}")
    print(f"membership record: {change[-1] if change else None}")
    print(f"training again {again_s:.2f}s after the kill; steps lost {change[-1]['steps_lost'] if change else '?'}")
    toy = [s for s in items if not s.startswith(("launch.", "checkpoint.snapshot", "train.max_steps"))]
    dptrain_run([*toy, f"train.max_steps={k}"], nproc=2, out=tmp / "ref2", env=env(), cwd=ROOT)
    dptrain_run([*toy, f"train.max_steps={a.steps}", "--resume", str(tmp / "ref2" / "checkpoints" / f"step_{k:06d}")],
                nproc=1, out=tmp / "ref1", env=env(), cwd=ROOT)
    got, want = load_file(out / "final" / "model.safetensors"), load_file(tmp / "ref1" / "final" / "model.safetensors")
    diff = max((got[n] - want[n]).abs().max().item() for n in want)
    same = all(torch.equal(got[n], want[n]) for n in want)
    print(f"final weights vs the 2->1 reference switched at step {k}: max |diff| = {diff:.3g} (identical: {same})")
    losses = {}
    for name in ("run", "ref1"):
        losses[name] = [(r["step"], r["loss"]) for r in read_jsonl(tmp / name / "metrics.jsonl")
                        if "loss" in r and r["step"] > k]
    ldiff = max(abs(x[1] - y[1]) for x, y in zip(losses["run"], losses["ref1"], strict=True))
    print(f"losses after step {k}: {len(losses['run'])} steps, max |diff| vs the reference = {ldiff:.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--rounds", type=int, default=60)
    o.add_argument("--strategy", help="parallel.strategy (default: the built-in recipe's)")
    o.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                   help="2: each rank acts as its own node, so snapshots are replicated to the other rank (loopback)")
    for name, steps, at in (("kill", 40, 20), ("nodeloss", 30, 10)):
        k = sub.add_parser(name)
        k.add_argument("--steps", type=int, default=steps)
        k.add_argument("--kill-at", type=int, default=at)
    a = p.parse_args()
    {"overhead": overhead, "kill": kill, "nodeloss": nodeloss}[a.what](a)


if __name__ == "__main__":
    main()
