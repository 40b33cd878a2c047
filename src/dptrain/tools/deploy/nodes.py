"""What a scheduler's job description shares with every other: the node layout (nodes, dptrain
workers per node, GPUs per node) and the check of a job's whole numbers, each error naming the
command-line flag and its value. Used by kubeflow.py and slurm.py."""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.config import ConfigError


@dataclass(frozen=True)
class NodeLayout:
    """Nodes x workers per node (one `dptrain run` per node, torchrun's workers inside it), GPUs per node."""

    nnodes: int
    nproc_per_node: int
    gpus_per_node: int


def check_at_least(*checks: tuple[str, int | None, int]) -> None:
    """Each `(flag, value, low)`: a value below `low` is a ConfigError naming the flag and the value;
    None (an option not given) passes."""
    for flag, value, low in checks:
        if value is not None and value < low:
            raise ConfigError(f"{flag}={value} is not valid; it must be an integer >= {low}")


def check_layout(spec: NodeLayout) -> None:
    """At least one node and one worker per node; GPUs per node may be 0 (CPU nodes)."""
    check_at_least(("--nnodes", spec.nnodes, 1), ("--nproc-per-node", spec.nproc_per_node, 1),
                   ("--gpus-per-node", spec.gpus_per_node, 0))
