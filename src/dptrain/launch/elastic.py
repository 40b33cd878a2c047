"""A run whose node count changes (`launch.nnodes=MIN:MAX`): the same global batch at every world size.

torchrun re-forms the worker group when a node leaves (the survivors' workers fail, their agents
restart them: one of `--max-restarts` each) or joins (the agents stop their healthy workers and
re-rendezvous: free). dptrain's part: the launcher pins the global batch it resolved at MAX nodes
(`pin_global_batch`); each worker group re-derives the accumulation at its own world size keeping the
micro-batch (`config_for_world`), or refuses with the reason, also written to attempts.jsonl. Resume
from the newest committed checkpoint (resharded N -> M), the world-size-invariant sample order and the
unchanged schedule (counted in optimizer steps) do the rest. Torch-free.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from dptrain.checkpoint.attempts import record_refusal
from dptrain.config import BatchSizeError, Config, ConfigError, Resolved, resolve


def pin_global_batch(cfg: Config, *, res: Resolved) -> Config:
    """`cfg` with train.global_batch_size set to what it resolves to at the launch's world size."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=res.global_batch_size))


def config_for_world(cfg: Config, *, world_size: int) -> Config:
    """`cfg` for a worker group of `world_size` ranks with the same global batch: unchanged when it
    resolves as it is, else with the accumulation re-derived (the micro-batch, i.e. memory per rank,
    is kept). BatchSizeError naming the numbers when the global batch cannot be split so."""
    g = cfg.train.global_batch_size
    try:
        if resolve(cfg, world_size=world_size).global_batch_size == g or g is None:
            return cfg
    except BatchSizeError:
        pass
    new = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=None))
    try:
        res = resolve(new, world_size=world_size)
    except BatchSizeError as e:
        raise BatchSizeError(f"cannot keep the global batch of {g} at the new world size {world_size}: {e}") from None
    print(f"dptrain: elastic: world size {world_size}: global batch {g} = micro {res.micro_batch_size} x accum "
          f"{res.grad_accum_steps} x dp {res.dp_world_size}", file=sys.stderr, flush=True)
    return new


def worker_config(cfg: Config, *, run_dir: Path, world_size: int, rank: int, attempt: int) -> Config:
    """What `python -m dptrain.launch.worker` trains at `world_size` in an elastic run; a refusal is written
    to RUN_DIR/attempts.jsonl (by rank 0) and raised as ConfigError (exit 2)."""
    try:
        return config_for_world(cfg, world_size=world_size)
    except ConfigError as e:
        if rank == 0:
            record_refusal(run_dir, attempt=attempt, world_size=world_size, reason=str(e))
        raise
