"""A Kubeflow Training Operator (v1) `PyTorchJob` for a dptrain config, and its schema check.

One pod per node: the Master replica is node 0, the Workers nodes 1..N-1. Every pod runs
`dptrain run /etc/dptrain/config.yaml --out /runs/<job>`; the operator's `PET_*` variables give
`dptrain run` the node layout and the rendezvous at `<job>-master-0` (see `cluster_env`). The config
travels in a ConfigMap; the run directory is a PersistentVolumeClaim mounted on every pod (each
rank writes its own checkpoint shards there and every node resumes from it); `/dev/shm` is a
memory-backed emptyDir (the DataLoader's workers pass batches through shared memory, which the
container runtime's default 64 MiB cannot hold). `restartPolicy: ExitCode` restarts a pod only for
a retryable exit (128-255: dptrain's 143 after a SIGTERM checkpoint, a kill), never for a failed
config (2) or a crashed run (1); the restarted pod resumes from the claim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dptrain.config import ConfigError
from dptrain.tools.deploy.nodes import NodeLayout, check_at_least, check_layout

PORT = 23456
"""The operator's default `pytorchjob-port`: MASTER_PORT / PET_MASTER_PORT and the rendezvous port."""
CONFIG_DIR = "/etc/dptrain"
RUNS_DIR = "/runs"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class JobSpec(NodeLayout):
    """What the PyTorchJob is made of, besides the config text (and the node layout)."""

    name: str
    image: str
    pvc: str
    pvc_size: str | None = None
    storage_class: str | None = None
    max_restarts: int | None = None
    shm_size: str | None = None
    namespace: str | None = None

    @property
    def run_dir(self) -> str:
        return f"{RUNS_DIR}/{self.name}"


def check_spec(spec: JobSpec) -> None:
    """The job's names and numbers, before anything is written."""
    if len(spec.name) > 50 or not _NAME.match(spec.name):
        raise ConfigError(
            f"--name={spec.name!r} is not valid; use lowercase letters, digits and '-', starting and ending "
            "with a letter or digit, at most 50 characters (pods are named <name>-worker-<i>)"
        )
    if not _NAME.match(spec.pvc) or len(spec.pvc) > 253:
        raise ConfigError(f"--pvc={spec.pvc!r} is not a valid claim name; use lowercase letters, digits and '-'")
    if not spec.image.strip():
        raise ConfigError("--image is empty; name the container image that has dptrain installed")
    check_layout(spec)
    check_at_least(("--max-restarts", spec.max_restarts, 0))


def _container(spec: JobSpec) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if spec.gpus_per_node:
        resources = {"limits": {"nvidia.com/gpu": str(spec.gpus_per_node)}}  # a quantity: a string
    return {
        "name": "pytorch",  # the operator sets its variables on the container of this name
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["dptrain"],
        "args": ["run", f"{CONFIG_DIR}/config.yaml", "--out", spec.run_dir],
        "ports": [{"name": "pytorchjob-port", "containerPort": PORT}],
        "resources": resources,
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "runs", "mountPath": RUNS_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }


def _pod_template(spec: JobSpec) -> dict[str, Any]:
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.shm_size:
        shm["sizeLimit"] = spec.shm_size
    return {
        "spec": {
            "containers": [_container(spec)],
            "volumes": [
                {"name": "config", "configMap": {"name": f"{spec.name}-config"}},
                {"name": "runs", "persistentVolumeClaim": {"claimName": spec.pvc}},
                {"name": "dshm", "emptyDir": shm},
            ],
        }
    }


def _metadata(spec: JobSpec, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "dptrain", "dptrain/job": spec.name}}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    return meta


def pytorchjob(spec: JobSpec) -> dict[str, Any]:
    """The PyTorchJob object: Master (node 0) and nnodes - 1 Workers, nprocPerNode workers each."""
    replicas: dict[str, Any] = {"Master": {"replicas": 1, "restartPolicy": "ExitCode", "template": _pod_template(spec)}}
    if spec.nnodes > 1:
        replicas["Worker"] = {"replicas": spec.nnodes - 1, "restartPolicy": "ExitCode", "template": _pod_template(spec)}
    job_spec: dict[str, Any] = {
        "nprocPerNode": str(spec.nproc_per_node),
        "runPolicy": {"cleanPodPolicy": "None"},  # keep finished pods' logs until the job is deleted
        "pytorchReplicaSpecs": replicas,
    }
    if spec.max_restarts is not None:
        # torchrun's restarts of the worker group, on a fixed node count (dptrain trains a fixed world);
        # the rendezvous stays on the Master (the operator's default host is <job>-worker-0).
        job_spec["elasticPolicy"] = {
            "rdzvBackend": "c10d",
            "rdzvHost": f"{spec.name}-master-0",
            "rdzvPort": PORT,
            "minReplicas": spec.nnodes,
            "maxReplicas": spec.nnodes,
            "maxRestarts": spec.max_restarts,
        }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(spec, spec.name),
        "spec": job_spec,
    }


def manifests(spec: JobSpec, *, config_yaml: str) -> list[dict[str, Any]]:
    """The objects to apply, in order: the config's ConfigMap, the claim (only with `pvc_size`), the job."""
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(spec, f"{spec.name}-config"),
            "data": {"config.yaml": config_yaml},
        }
    ]
    if spec.pvc_size:
        claim: dict[str, Any] = {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": spec.pvc_size}},
        }
        if spec.storage_class:
            claim["storageClassName"] = spec.storage_class
        docs.append(
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _metadata(spec, spec.pvc), "spec": claim}
        )
    docs.append(pytorchjob(spec))
    return docs


def schema_problems(job: dict[str, Any]) -> list[str]:
    """Check a PyTorchJob against the training operator's schema, as its Python SDK (PyPI
    `kubeflow-training`) models it: deserialise into `KubeflowOrgV1PyTorchJob` (types, required
    fields, enums the models check) and serialise back; a key the schema does not know is dropped on
    the way and reported with its path. An empty list means valid."""
    try:
        from kubeflow.training import ApiClient
    except ImportError as e:
        raise ConfigError(
            f"checking a PyTorchJob needs the Kubeflow training SDK: pip install kubeflow-training ({e})"
        ) from None
    import json

    class _Response:
        data = json.dumps(job)

    client = ApiClient()
    try:
        model = client.deserialize(_Response(), "KubeflowOrgV1PyTorchJob")
    except (ValueError, TypeError) as e:
        return [f"not a valid PyTorchJob: {e}"]
    back = client.sanitize_for_serialization(model)
    return _differences(job, back, path="") + _enum_problems(job)


_ENUMS = {
    "restartPolicy": ("Always", "OnFailure", "Never", "ExitCode"),
    "cleanPodPolicy": ("All", "Running", "None"),
    "rdzvBackend": ("c10d", "etcd", "etcd-v2"),
}
"""Enumerations of the PyTorchJob CRD that the SDK's models do not check."""


def _enum_problems(job: dict[str, Any]) -> list[str]:
    spec = job.get("spec", {})
    out = [
        f"/spec/pytorchReplicaSpecs/{t}: not a replica type (Master, Worker)"
        for t in spec.get("pytorchReplicaSpecs", {})
        if t not in ("Master", "Worker")
    ]
    places = [(f"/spec/pytorchReplicaSpecs/{t}", r) for t, r in spec.get("pytorchReplicaSpecs", {}).items()]
    places += [("/spec/runPolicy", spec.get("runPolicy", {})), ("/spec/elasticPolicy", spec.get("elasticPolicy", {}))]
    for where, obj in places:
        for key, allowed in _ENUMS.items():
            if key in obj and obj[key] not in allowed:
                out.append(f"{where}/{key}: {obj[key]!r} is not one of {', '.join(allowed)}")
    return out


def _differences(want: Any, got: Any, *, path: str) -> list[str]:
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{path or '/'}: the schema reads {type(got).__name__}, not an object"]
        out = []
        for k, v in want.items():
            if k not in got:
                out.append(f"{path}/{k}: not a field of the PyTorchJob schema")
            else:
                out += _differences(v, got[k], path=f"{path}/{k}")
        return out
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: the schema reads {got!r}"]
        return [
            d for i, (a, b) in enumerate(zip(want, got, strict=True)) for d in _differences(a, b, path=f"{path}/{i}")
        ]
    return [] if want == got else [f"{path}: {want!r} reads back as {got!r}"]
