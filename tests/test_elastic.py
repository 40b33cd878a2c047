"""Elastic node count on the two-namespace cluster (`launch.nnodes=1:2`): node 1 is killed (every
process in its namespace, SIGKILL) mid-run; node 0's torchrun agent re-forms the group alone and the
run goes on from the newest committed checkpoint at world size 1 with the same global batch. Its
final weights equal a reference that switched from 2 ranks to 1 at the same committed step through
`--resume` at another world size. Then node 1 comes back and the world grows back to 2. Needs root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dptrain.config import ConfigError, resolve
from dptrain.config.load import load_config
from dptrain.launch.elastic import config_for_world, worker_config
from dptrain.launch.torchrun import torchrun_args
from dptrain.tools.netns import Cluster, dptrain_argv, unavailable_reason
from support import ROOT, subprocess_env
from support import overrides as join
from support.nodes import kill_running_nodes
from support.run_helpers import TOY_RUN

REASON = unavailable_reason()
needs_cluster = pytest.mark.skipif(REASON is not None, reason=f"two-host cluster: {REASON}")
RTOL, ATOL = 1e-5, 1e-6  # the parity tolerance (tests/test_parity.py)
TOY = [
    *TOY_RUN,
    "optim.name=sgd",
    "train.loss=support.slow_loss:slow_loss",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=null",
]
ELASTIC = [
    "launch.max_restarts=3",
    "launch.rdzv_conf=last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
]


def start(c: Cluster, node: int, out: Path, log: Path, *items: str) -> subprocess.Popen:
    argv = dptrain_argv(
        [*join(TOY, ELASTIC, [f"checkpoint.snapshot_dir={out.parent / 'shm'}"], items,  # the test's own, not /dev/shm
               c.launch_overrides(node, nnodes="1:2")), "--nproc-per-node", "1", "--out", str(out)]
    )
    return c.popen(
        node, argv, cwd=ROOT, env=subprocess_env(OMP_NUM_THREADS="1"), stdout=open(log, "w"), stderr=subprocess.STDOUT
    )  # noqa: SIM115


def records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


def wait_until(what: str, cond, *, timeout: float, procs: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise AssertionError(
                f"{what}: not reached; exit codes {[p.poll() for p in procs]}\n"
                + "\n----\n".join(log.read_text()[-3000:] for log in logs)
            )
        time.sleep(0.05)


def last_step(out: Path) -> int:
    return max((r["step"] for r in records(out / "metrics.jsonl") if "loss" in r), default=0)


def membership(out: Path) -> list[dict]:
    return [r for r in records(out / "attempts.jsonl") if r.get("event") == "membership"]


def dptrain(*items: str, timeout: float = 200) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "dptrain", "run", *join(TOY, items)],
        capture_output=True,
        text=True,
        env=subprocess_env(OMP_NUM_THREADS="1"),
        cwd=ROOT,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


# ------------------------------------------------------------------ config and batch arithmetic (no cluster)
@pytest.mark.fast
@pytest.mark.timeout(30)
def test_nnodes_range_reaches_torchrun_with_the_rendezvous_settings():
    cfg = load_config(
        None,
        [
            "launch.nnodes=1:2",
            "launch.rdzv_endpoint=h0:29500",
            "launch.max_restarts=3",
            "launch.rdzv_conf=last_call_timeout=2,join_timeout=60",
        ],
    )
    assert cfg.launch.nnodes == "1:2"  # YAML 1.2 scalars: not the base-60 integer 62
    argv = torchrun_args(cfg.launch, nproc_per_node=1, module="dptrain.launch.worker", module_args=[])
    assert argv[argv.index("--nnodes") + 1] == "1:2" and argv[argv.index("--rdzv-backend") + 1] == "c10d"
    # the user's settings, on top of the elastic defaults for the keys they leave out (config/nodes.py)
    conf = dict(kv.split("=") for kv in argv[argv.index("--rdzv-conf") + 1].split(","))
    assert conf == {"last_call_timeout": "2", "join_timeout": "60", "keep_alive_interval": "1",
                    "keep_alive_max_attempt": "3"}
    assert argv[argv.index("--max-restarts") + 1] == "3"
    assert resolve(cfg, world_size=None, cuda_available=False).world_size == 2 * 2  # planned at MAX nodes


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_elastic_runs_get_fast_failure_detection_by_default_and_fixed_runs_keep_torchruns():
    import inspect

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    from dptrain.config.nodes import ELASTIC_RDZV_DEFAULTS

    def conf(*items):
        cfg = load_config(None, ["launch.rdzv_endpoint=h0:29500", *items])
        argv = torchrun_args(cfg.launch, nproc_per_node=1, module="dptrain.launch.worker", module_args=[])
        text = argv[argv.index("--rdzv-conf") + 1] if "--rdzv-conf" in argv else ""
        return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}

    assert conf("launch.nnodes=1:2") == ELASTIC_RDZV_DEFAULTS
    assert conf("launch.nnodes=2") == {}  # a fixed node count: torchrun's own settings
    assert conf("launch.nnodes=1:2", "launch.rdzv_conf=last_call_timeout=30") == {**ELASTIC_RDZV_DEFAULTS,
                                                                                  "last_call_timeout": 30}
    # torchrun's defaults, which these replace: a dead node noticed after 5 s x 3, a 30 s last call
    params = inspect.signature(DynamicRendezvousHandler.from_backend).parameters
    torch_defaults = {"last_call_timeout": int(RendezvousTimeout().last_call.total_seconds()),
                      **{k: params[k].default for k in ("keep_alive_interval", "keep_alive_max_attempt")}}
    assert torch_defaults == {"last_call_timeout": 30, "keep_alive_interval": 5, "keep_alive_max_attempt": 3}
    assert all(ELASTIC_RDZV_DEFAULTS[k] < torch_defaults[k] for k in ("last_call_timeout", "keep_alive_interval"))


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_a_rank_that_lost_a_peer_on_another_host_exits_soon():
    from dptrain.launch.worker import peer_is_remote

    def closed(addr: str) -> RuntimeError:
        return RuntimeError(f"[/x/gloo/tcp/pair.cc:553] Connection closed by peer [{addr}]:28363. This is ...")

    assert peer_is_remote(closed("192.0.2.7"))  # TEST-NET-1: never an address of this host
    assert not peer_is_remote(closed("127.0.0.1"))  # a peer on this host: its agent sees it die
    assert not peer_is_remote(RuntimeError("Connection closed by peer"))  # no address named: keep the long wait


@pytest.mark.fast
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("launch.nnodes=2:1", "launch.nnodes='2:1' is not valid"),
        ("launch.nnodes=0:2", "launch.nnodes='0:2' is not valid"),
        ("launch.nnodes=one:two", "launch.nnodes='one:two' is not valid"),
        ("launch.rdzv_conf=last_call=2", "'last_call=2' is not valid"),
        ("launch.rdzv_conf=join_timeout=-1", "'join_timeout=-1' is not valid"),
    ],
)
def test_bad_node_ranges_and_rendezvous_settings_refused(override, named):
    with pytest.raises(ConfigError, match=named):
        resolve(load_config(None, ["launch.rdzv_endpoint=h0:29500", override]), world_size=2, cuda_available=False)


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_the_global_batch_is_kept_at_another_world_size_with_accumulation_re_derived():
    cfg = load_config(
        None,
        [
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            "train.grad_accum_steps=2",
            "launch.nnodes=1:2",
            "launch.rdzv_endpoint=h0:29500",
            "launch.nproc_per_node=1",
        ],
    )
    assert resolve(cfg, world_size=2, cuda_available=False).grad_accum_steps == 2
    one = resolve(config_for_world(cfg, world_size=1), world_size=1, cuda_available=False)
    assert (one.global_batch_size, one.micro_batch_size, one.grad_accum_steps) == (8, 2, 4)
    assert config_for_world(cfg, world_size=2) is cfg  # already fits: unchanged


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_a_global_batch_that_cannot_be_split_is_refused_and_recorded(tmp_path):
    cfg = load_config(
        None,
        ["train.global_batch_size=6", "train.micro_batch_size=3", "launch.nnodes=1:4", "launch.rdzv_endpoint=h0:29500"],
    )
    with pytest.raises(ConfigError, match="cannot keep the global batch of 6 at the new world size 4"):
        worker_config(cfg, run_dir=tmp_path, world_size=4, rank=0, attempt=2)
    (rec,) = records(tmp_path / "attempts.jsonl")
    assert rec["event"] == "refused" and rec["world_size"] == 4 and rec["attempt"] == 2
    assert "not divisible by micro_batch_size * dp world size = 3 * 4" in rec["reason"]


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_membership_report_names_the_node_that_left_and_the_steps_lost(tmp_path):
    from dptrain.checkpoint.attempts import ProgressFile, previous_attempt, report_restart

    old = [ProgressFile(tmp_path, rank=r, attempt=0, generation=0, host=f"h{r}", world_size=2) for r in range(2)]
    old[0].step(8), old[1].step(7), old[0].error("Traceback ...\nRuntimeError: Connection reset by peer")
    for p in old:
        p.close()
    text = report_restart(tmp_path, attempt=1, hosts=["h0"], resumed_step=5)
    assert "node(s) h1 left after step 8: world size 2 -> 1, resuming at step 5 (3 step(s) lost" in text
    assert "rank 1 (pid" in text and "without a Python error" in text
    (rec,) = records(tmp_path / "attempts.jsonl")
    assert (rec["nodes_left"], rec["nodes_joined"], rec["steps_lost"]) == (["h0", "h1"][1:], [], 3)
    new = ProgressFile(tmp_path, rank=0, attempt=1, generation=1, host="h0", world_size=1)  # rank1.json is stale now
    new.step(12), new.stopped(), new.close()
    assert previous_attempt(tmp_path)["world_size"] == 1
    text = report_restart(tmp_path, attempt=1, hosts=["h0", "h1"], resumed_step=12)
    assert "node(s) h1 joined after step 12: world size 1 -> 2, resuming at step 12 (0 step(s) lost" in text
    assert "failed" not in text  # a rank stopped by torchrun's SIGTERM is not a failure
    assert report_restart(tmp_path, attempt=1, hosts=["h0"], resumed_step=12) is None  # same nodes, no failure


# ------------------------------------------------------------------ on the two-namespace cluster
def progress(out: Path, rank: int = 0) -> dict:
    try:
        return json.loads((out / "attempts" / f"rank{rank}.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def training_in_generation(out: Path, generation: int) -> bool:
    """Whether rank 0 of worker group `generation` has finished a step."""
    p = progress(out)
    return p.get("generation") == generation and p.get("step") is not None and bool(membership(out))


@needs_cluster
@pytest.mark.timeout(420)
def test_node_lost_node0_continues_alone_and_matches_a_2_to_1_resume(tmp_path):
    out, logs = tmp_path / "run", [tmp_path / "node0.log", tmp_path / "node1.log"]
    with Cluster(rate="1gbit") as c:
        # the disk path (tests/test_snapshots_node_loss.py: the default, from the lost node's replica in memory)
        procs = [start(c, i, out, logs[i], "train.max_steps=20", "checkpoint.snapshot_every_steps=0") for i in range(2)]
        try:
            wait_until("both nodes past step 7", lambda: last_step(out) >= 7, timeout=90, procs=procs, logs=logs)
            c.kill_node(1)  # the whole node: launcher, torchrun agent and worker, SIGKILL
            killed = time.monotonic()
            wait_until(
                "node 0 training alone", lambda: training_in_generation(out, 1), timeout=90, procs=procs[:1], logs=logs
            )
            again_s = time.monotonic() - killed
            assert procs[0].wait(timeout=120) == 0, logs[0].read_text()[-4000:]
        finally:
            kill_running_nodes(c, procs)
        host1 = c.hostnames[1]
    (lost,) = membership(out)
    print(f"\nnode loss: {lost}\ntraining again {again_s:.1f}s after the kill")
    assert lost["nodes_left"] == [host1] and lost["nodes_joined"] == []
    assert (lost["world_size_before"], lost["world_size_after"]) == (2, 1)
    k = lost["resumed_step"]
    assert k >= 5 and k % 5 == 0 and lost["steps_lost"] == lost["last_step"] - k >= 0
    assert (
        f"node(s) {host1} left after step {lost['last_step']}: world size 2 -> 1, resuming at step {k}"
        in logs[0].read_text()
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 20 and summary["global_batch_size"] == 8
    # The reference: 2 ranks to the same committed step, then `--resume` that checkpoint at world size 1.
    dptrain(f"train.max_steps={k}", "--nproc-per-node", "2", "--out", str(tmp_path / "ref2"))
    dptrain(
        "train.max_steps=20",
        "--nproc-per-node",
        "1",
        "--out",
        str(tmp_path / "ref1"),
        "--resume",
        str(tmp_path / "ref2" / "checkpoints" / f"step_{k:06d}"),
    )
    got, want = final_weights(out), final_weights(tmp_path / "ref1")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    diff = max((got[n] - want[n]).abs().max().item() for n in want)
    print(f"final weights vs the 2->1 --resume reference: max |diff| = {diff:.3g}")


@needs_cluster
@pytest.mark.timeout(420)
def test_node_rejoins_and_the_world_grows_back_to_2(tmp_path):
    out, logs = tmp_path / "run", [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "node1-again.log"]
    pace = tmp_path / "pace"  # steps are slow while it exists: the run outlasts the node's return
    pace.write_text("")
    items = ("train.max_steps=30", "train.loss=support.paced_loss:paced_loss")
    with Cluster(rate="1gbit") as c:
        os.environ["DPTRAIN_TEST_PACE_FILE"] = str(pace)
        try:
            procs = [start(c, i, out, logs[i], *items) for i in range(2)]
        finally:
            del os.environ["DPTRAIN_TEST_PACE_FILE"]
        try:
            wait_until("both nodes past step 6", lambda: last_step(out) >= 6, timeout=90, procs=procs, logs=logs)
            c.kill_node(1)
            wait_until(
                "node 0 training alone", lambda: training_in_generation(out, 1), timeout=90, procs=procs[:1], logs=logs
            )
            procs.append(start(c, 1, out, logs[2], *items))  # the same command on node 1 again
            wait_until(
                "node 1 taken in",
                lambda: len(membership(out)) >= 2 and training_in_generation(out, 2),
                timeout=120,
                procs=[procs[0], procs[2]],
                logs=logs,
            )
            pace.unlink()
            assert procs[0].wait(timeout=120) == 0, logs[0].read_text()[-4000:]
            assert procs[2].wait(timeout=60) == 0, logs[2].read_text()[-4000:]
        finally:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    c.kill_node(min(i, 1))
        host1 = c.hostnames[1]
    lost, joined = membership(out)
    print(f"\nnode loss: {lost}\nnode join: {joined}")
    assert lost["nodes_left"] == [host1] and (lost["world_size_before"], lost["world_size_after"]) == (2, 1)
    assert joined["nodes_joined"] == [host1] and joined["nodes_left"] == []
    assert (joined["world_size_before"], joined["world_size_after"]) == (1, 2)
    assert joined["failures"] == [] and joined["steps_lost"] == 0  # node 0 saved its step on torchrun's SIGTERM
    assert joined["restarted_as"] == 1  # a join costs no restart: torchrun's count stays at the loss's 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 30
    said = logs[0].read_text() + logs[2].read_text()
    assert f"node(s) {host1} joined after step {joined['last_step']}: world size 1 -> 2" in said
