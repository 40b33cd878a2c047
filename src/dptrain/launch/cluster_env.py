"""Launch settings from the environment a cluster scheduler gives the launcher process.

Kubeflow's Training Operator (v1, PyTorchJob) starts each replica's container with torchrun's own
`PET_*` variables (torchrun reads `PET_<OPTION>` as the default of `--<option>`):

| variable | set by the operator to | becomes |
|---|---|---|
| `PET_NNODES` | the number of replicas, or `min:max` under an elasticPolicy | `launch.nnodes` (`N:N` -> N) |
| `PET_NPROC_PER_NODE` | `spec.nprocPerNode` | `launch.nproc_per_node` |
| `PET_NODE_RANK` | 0 on the Master, i + 1 on Worker i | `launch.node_rank` |
| `PET_RDZV_ENDPOINT` | elastic only: `rdzvHost:rdzvPort` | `launch.rdzv_endpoint` |
| `PET_MASTER_ADDR`/`PET_MASTER_PORT` (`MASTER_ADDR`/`MASTER_PORT`) | `<job>-master-0` and the Master's port | `launch.rdzv_endpoint` when there is no `PET_RDZV_ENDPOINT` |
| `PET_RDZV_ID` | elastic only, when configured | `launch.rdzv_id` |
| `PET_MAX_RESTARTS` | elastic only: `elasticPolicy.maxRestarts` | `launch.max_restarts` |

`WORLD_SIZE` (replicas x nprocPerNode) and `RANK` (the node index) are node-level there and are not
read: torchrun gives each worker its own. The overrides come before the command line's, so an
explicit `launch.*=` or flag still wins over the environment, and the environment over the file.
Inside a torchrun worker (`TORCHELASTIC_RUN_ID` set) nothing is derived.
"""  # noqa: E501 (a Markdown table: one row a line)

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from dptrain.config import ConfigError


@dataclass(frozen=True)
class ClusterLaunch:
    """`launch.*` overrides read from the environment, and the variables they came from."""

    overrides: list[str]
    sources: dict[str, str]

    def describe(self) -> str:
        return (
            "dptrain: launch settings from the environment (torchrun's PET_* variables, as a Kubeflow PyTorchJob "
            "sets them): " + ", ".join(f"{o} (from {self.sources[o.split('=')[0]]})" for o in self.overrides)
        )


def _int(name: str, value: str) -> int:
    if not value.strip().isdigit():
        raise ConfigError(f"{name}={value!r} in the environment is not valid; it must be a non-negative integer")
    return int(value)


def _nnodes(value: str) -> int:
    """`N` or an elastic `min:max`; dptrain trains a fixed number of nodes, so min must equal max."""
    lo, sep, hi = value.partition(":")
    if not sep:
        return _int("PET_NNODES", value)
    a, b = _int("PET_NNODES", lo), _int("PET_NNODES", hi)
    if a != b:
        raise ConfigError(
            f"PET_NNODES={value!r} asks for an elastic range of nodes; dptrain trains a fixed number of nodes "
            "(launch.nnodes): give the elasticPolicy minReplicas = maxReplicas (dptrain manifest kubeflow does)"
        )
    return a


def _endpoint(env: Mapping[str, str]) -> tuple[str, str] | None:
    if env.get("PET_RDZV_ENDPOINT"):
        return env["PET_RDZV_ENDPOINT"], "PET_RDZV_ENDPOINT"
    for addr, port in (("PET_MASTER_ADDR", "PET_MASTER_PORT"), ("MASTER_ADDR", "MASTER_PORT")):
        if env.get(addr) and env.get(port):
            return f"{env[addr]}:{_int(port, env[port])}", f"{addr}:{port}"
    return None


def cluster_launch(environ: Mapping[str, str] | None = None) -> ClusterLaunch | None:
    """The `launch.*` overrides the environment implies, or None when it names no node layout
    (no `PET_NNODES`) or this process is already a torchrun worker."""
    env = os.environ if environ is None else environ
    if not env.get("PET_NNODES") or env.get("TORCHELASTIC_RUN_ID"):
        return None
    found: dict[str, tuple[str, str]] = {"launch.nnodes": (str(_nnodes(env["PET_NNODES"])), "PET_NNODES")}
    if env.get("PET_NPROC_PER_NODE"):
        nproc = env["PET_NPROC_PER_NODE"]
        found["launch.nproc_per_node"] = (
            nproc if nproc == "auto" else str(_int("PET_NPROC_PER_NODE", nproc)),
            "PET_NPROC_PER_NODE",
        )
    if env.get("PET_NODE_RANK"):
        found["launch.node_rank"] = (str(_int("PET_NODE_RANK", env["PET_NODE_RANK"])), "PET_NODE_RANK")
    endpoint = _endpoint(env)
    if endpoint is not None:
        found["launch.rdzv_endpoint"] = (json.dumps(endpoint[0]), endpoint[1])  # quoted: always a string
    if env.get("PET_RDZV_ID"):
        found["launch.rdzv_id"] = (json.dumps(env["PET_RDZV_ID"]), "PET_RDZV_ID")
    if env.get("PET_MAX_RESTARTS"):
        found["launch.max_restarts"] = (str(_int("PET_MAX_RESTARTS", env["PET_MAX_RESTARTS"])), "PET_MAX_RESTARTS")
    return ClusterLaunch(
        overrides=[f"{k}={v}" for k, (v, _) in found.items()], sources={k: src for k, (_, src) in found.items()}
    )
