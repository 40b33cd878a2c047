"""Checkpoints that never lie: commit-marked, manifest-hashed, full or DCP-sharded; exact resume.

Modules, one job each: `state` (what a checkpoint holds, as named Stateful objects), `manifest`
(commit protocol, verification), `storage` (full vs DCP tensors), `safe_dcp` (restricted DCP
reading), `rng` (per-rank RNG state), `resume` (which checkpoint to load; metrics continuity),
`preempt` (SIGTERM, agreed without blocking), `attempts` (elastic restart reports), `manager`
(the CheckpointManager, on a CheckpointState), `snapshots/` (the in-memory snapshots, a sub-package the
manager uses through its `__init__`).
"""

from typing import Any

from dptrain.checkpoint.manifest import CheckpointError, CheckpointInfo, list_checkpoints, verify


def __getattr__(name: str) -> Any:
    # preempt imports torch (and its distributed stack): only on use, so `dptrain ckpt ls` and
    # `dptrain --help`, which import this package, stay fast.
    if name == "EXIT_PREEMPTED":
        # lazy: preempt imports torch; `dptrain ckpt ls` stays torch-free
        from dptrain.checkpoint.preempt import EXIT_PREEMPTED

        return EXIT_PREEMPTED
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CheckpointError", "CheckpointInfo", "EXIT_PREEMPTED", "list_checkpoints", "verify"]
