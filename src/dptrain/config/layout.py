"""The front door: `parallel.strategy` -> a layout (mesh degrees) plus a data-parallel mode.

This is the only module that reads the strategy name to decide anything; everything downstream
reads the `DataParallelMode` fields and the `ParallelDims` degrees instead.

| strategy | wrapper      | default layout          | optimizer | after forward          |
|----------|--------------|-------------------------|-----------|------------------------|
| single   | none         | world 1                 | plain     |                        |
| dp       | DataParallel | world 1 (every GPU)     | plain     |                        |
| ddp      | DDP          | dp_replicate = world    | plain     |                        |
| zero1    | DDP          | dp_replicate = world    | ZeRO-1    |                        |
| zero2    | FSDP2        | dp_shard = world        | sharded   | keep parameters        |
| fsdp     | FSDP2        | dp_shard = world        | sharded   | free parameters (ZeRO-3) |

With dp_replicate and dp_shard both left at 1, the strategy's own dimension takes the rest of the
world. zero2/fsdp with dp_replicate > 1 and dp_shard > 1 is HSDP. ddp/zero1 replicate only, so
dp_shard > 1 with them is refused. Tensor parallelism (tp > 1) composes with every multi-process
strategy except zero1 (refused: its optimizer cannot hold DTensor parameters). Context parallelism (cp > 1)
composes with ddp, zero2, fsdp, tp and pp; what it refuses is checked in config/context.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.config.dims import ParallelDims
from dptrain.config.fields import STRATEGIES, ConfigError, ParallelConfig


@dataclass(frozen=True)
class DataParallelMode:
    """How data parallelism is applied; read by parallelize, optim, checks and diagnostics."""

    wrapper: str
    """none (one process), dataparallel (nn.DataParallel, one process), ddp or fsdp (FSDP2)."""
    shard_optimizer: bool = False
    """ZeRO-1: partition the optimizer state over the data-parallel ranks (ZeroRedundancyOptimizer)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3) or keep them until backward (ZeRO-2)."""

    @property
    def single_process(self) -> bool:
        """The whole job is one process (single, dp)."""
        return self.wrapper in ("none", "dataparallel")

    @property
    def dp_dim(self) -> str:
        """The mesh dimension this mode's data parallelism fills when the layout leaves it open."""
        return "dp_shard" if self.wrapper == "fsdp" else "dp_replicate"


STRATEGY_MODES: dict[str, DataParallelMode] = {
    "single": DataParallelMode("none"),
    "dp": DataParallelMode("dataparallel"),
    "ddp": DataParallelMode("ddp"),
    "zero1": DataParallelMode("ddp", shard_optimizer=True),
    "zero2": DataParallelMode("fsdp", reshard_after_forward=False),
    "fsdp": DataParallelMode("fsdp", reshard_after_forward=True),
}
assert tuple(STRATEGY_MODES) == STRATEGIES


def strategy_mode(cfg: ParallelConfig) -> DataParallelMode:
    """The data-parallel mode of `parallel.strategy` (ConfigError naming the valid names)."""
    mode = STRATEGY_MODES.get(cfg.strategy)
    if mode is None:
        raise ConfigError(f"parallel.strategy={cfg.strategy!r} is not valid; choose one of: {', '.join(STRATEGIES)}")
    return mode


def resolve_layout(cfg: ParallelConfig, *, world_size: int) -> tuple[ParallelDims, DataParallelMode]:
    """(mesh degrees, mode) for `cfg` at `world_size`. Raises ConfigError before anything launches."""
    mode = strategy_mode(cfg)
    degrees = {"dp_replicate": cfg.dp_replicate, "dp_shard": cfg.dp_shard, "cp": cfg.cp, "tp": cfg.tp, "pp": cfg.pp}
    if mode.single_process:
        if world_size != 1:
            raise ConfigError(
                f"parallel.strategy={cfg.strategy!r} runs in one process but the world size is {world_size}; "
                "use launch.nproc_per_node=1 (--nproc-per-node 1) or a multi-process strategy (ddp, zero1, zero2, fsdp)"
            )
    elif degrees["dp_replicate"] == 1 and degrees["dp_shard"] == 1 and -1 not in degrees.values():
        degrees[mode.dp_dim] = -1  # the strategy's own dimension takes the rest of the world (unless cp/tp/pp is -1)
    dims = ParallelDims.resolve(**degrees, world_size=world_size)
    if mode.wrapper == "ddp" and dims.dp_shard > 1:
        raise ConfigError(
            f"parallel.dp_shard={dims.dp_shard} needs a sharding strategy: parallel.strategy={cfg.strategy!r} "
            "replicates the whole model on every data-parallel rank; use parallel.strategy=zero2 or fsdp "
            "(with parallel.dp_replicate > 1 too: HSDP), or parallel.dp_replicate instead"
        )
    if dims.tp > 1 and dims.pp > 1 and cfg.loss_parallel:
        raise ConfigError(
            f"parallel layout {dims.describe()}: parallel.loss_parallel=true is refused with pp > 1: the pipeline's "
            "loss is computed by its schedule's loss_fn on the last stage's plain (vocabulary-gathered) logits, "
            "outside DTensor's loss_parallel() context; use parallel.loss_parallel=false (the logits are gathered "
            "over tp) or pp=1"
        )
    if dims.tp > 1 and dims.pp > 1 and cfg.tp_plan is not None:
        raise ConfigError(
            f"parallel layout {dims.describe()}: parallel.tp_plan={cfg.tp_plan!r} is refused with pp > 1: a user's "
            "plan is written for the whole model, and each pipeline stage holds only some of its modules; the "
            "built-in LLaMA's plan is applied per stage (drop tp_plan), or use pp=1"
        )
    if dims.tp > 1 and mode.shard_optimizer:
        raise ConfigError(
            f"parallel.strategy='zero1' with parallel.tp={dims.tp} is refused: ZeroRedundancyOptimizer partitions "
            "plain tensors and cannot hold the tensor-parallel (DTensor) parameters, nor save their state through "
            "DCP; use parallel.strategy=zero2 (FSDP2 over the tp-split model: gradients and optimizer state sharded), "
            "or ddp"
        )
    return dims, mode
