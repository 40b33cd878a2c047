"""Node loss on the two-namespace cluster with in-memory snapshots (`launch.nnodes=1:2`,
`checkpoint.snapshot_every_steps=1`, no disk checkpoint before the end): node 1 is killed (every
process in its namespace); node 0 resumes at world size 1 from the memory snapshot built with node 1's
files from the replica node 0 holds, and ends with the final weights of a reference that switched
from 2 ranks to 1 at the same step through `--resume` (the disk path). Needs root."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dptrain.checkpoint import manifest as mf
from dptrain.tools.netns import Cluster, dptrain_argv, unavailable_reason
from support import ROOT, subprocess_env
from support import overrides as join
from support.nodes import kill_running_nodes
from support.run_helpers import TOY_RUN

REASON = unavailable_reason()
needs_cluster = pytest.mark.skipif(REASON is not None, reason=f"two-host cluster: {REASON}")
RTOL, ATOL = 1e-5, 1e-6  # the parity tolerance (tests/test_parity.py)
TOY = [*TOY_RUN, "optim.name=sgd", "train.loss=support.slow_loss:slow_loss", "checkpoint.every_steps=1000",
       "train.max_steps=20"]
ELASTIC = [
    "launch.max_restarts=3",
    "launch.rdzv_conf=last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
]


def records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


def wait_until(what: str, cond, *, timeout: float, procs: list, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise AssertionError(f"{what}: not reached\n" + "\n----\n".join(p.read_text()[-3000:] for p in logs))
        time.sleep(0.05)


def training_alone(out: Path) -> bool:
    try:
        p = json.loads((out / "attempts" / "rank0.json").read_text())
    except (FileNotFoundError, ValueError):
        return False
    return p.get("generation") == 1 and p.get("step") is not None


def reference(tmp_path: Path, k: int) -> dict[str, torch.Tensor]:
    """2 ranks to step k (its final save), then `--resume` that checkpoint at world size 1."""
    items = [s for s in TOY if not s.startswith("train.max_steps")]
    for args in (
        [f"train.max_steps={k}", "--nproc-per-node", "2", "--out", str(tmp_path / "ref2")],
        ["train.max_steps=20", "--nproc-per-node", "1", "--out", str(tmp_path / "ref1"), "--resume",
         str(tmp_path / "ref2" / "checkpoints" / mf.step_dir_name(k))],
    ):
        r = subprocess.run([sys.executable, "-m", "dptrain", "run", *join(items, args)], capture_output=True, text=True,
                           env=subprocess_env(OMP_NUM_THREADS="1"), cwd=ROOT, timeout=200)
        assert r.returncode == 0, r.stderr[-3000:]
    return load_file(tmp_path / "ref1" / "final" / "model.safetensors")


@needs_cluster
@pytest.mark.timeout(420)
def test_node_lost_the_survivor_resumes_from_the_lost_nodes_replica_in_memory(tmp_path):
    out, mem, logs = tmp_path / "run", tmp_path / "mem", [tmp_path / "node0.log", tmp_path / "node1.log"]
    items = [*TOY, *ELASTIC, "checkpoint.snapshot_every_steps=1", f"checkpoint.snapshot_dir={mem}"]
    with Cluster(rate="1gbit") as c:
        procs = [
            c.popen(i, dptrain_argv([*join(items, c.launch_overrides(i, nnodes="1:2")), "--nproc-per-node", "1",
                                     "--out", str(out)]),
                    cwd=ROOT, env=subprocess_env(OMP_NUM_THREADS="1"), stdout=open(logs[i], "w"),  # noqa: SIM115
                    stderr=subprocess.STDOUT)
            for i in range(2)
        ]
        try:
            wait_until("both nodes past step 7", lambda: max(
                (r["step"] for r in records(out / "metrics.jsonl") if "loss" in r), default=0) >= 7,
                timeout=90, procs=procs, logs=logs)
            assert mf.step_dirs(out / "checkpoints") == []  # nothing on disk to resume from
            c.kill_node(1)
            killed = time.monotonic()
            wait_until("node 0 training alone", lambda: training_alone(out), timeout=90, procs=procs[:1], logs=logs)
            again_s = time.monotonic() - killed
            assert procs[0].wait(timeout=120) == 0, logs[0].read_text()[-4000:]
        finally:
            kill_running_nodes(c, procs)
        hosts = c.hostnames
    log = logs[0].read_text()
    found = re.search(
        r"resumed from memory snapshot step (\d+) \(with rank 1 \(host (\S+)\) from host (\S+)'s replica\)", log
    )
    assert found and found.group(2, 3) == (hosts[1], hosts[0]), log[-4000:]
    k = int(found.group(1))
    (lost,) = [r for r in records(out / "attempts.jsonl") if r.get("event") == "membership"]
    # A snapshot starts only once every rank has finished the previous one: at most the last two steps are lost
    assert lost["resumed_step"] == k >= 5 and lost["steps_lost"] == lost["last_step"] - k <= 2, lost
    print(f"\nnode loss, memory snapshots: resumed at step {k}, {lost['steps_lost']} step(s) lost, "
          f"training again {again_s:.1f}s after the kill")
    got, want = load_file(out / "final" / "model.safetensors"), reference(tmp_path, k)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
