"""The degrees of a run's parallel dimensions, resolved and validated before anything launches (plain
data, no torch; torchtitan's `ParallelDims`). distributed/mesh.py builds the one DeviceMesh from them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dptrain.config.fields import ConfigError

__all__ = ["DIM_NAMES", "ParallelDims"]

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimensions, outermost first: pipeline stages span nodes, tensor parallelism stays innermost
(fastest links); data-parallel replicas sit outside their shards (HSDP: replicate across nodes,
shard within a node); context parallelism (one sequence split over ranks) sits between the shards and
tp, as in torchtitan."""

@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the run's parallel dimensions; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1
    """Context-parallel degree: ranks one sequence is split over (they share their dp rank's rows)."""

    @classmethod
    def resolve(cls, *, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, pp: int = 1,
                cp: int = 1, world_size: int) -> ParallelDims:
        """Resolve at most one -1 from the world size and check the product. Raises ConfigError
        naming every factor and the world size."""
        factors = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp}
        for name, v in factors.items():
            if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1):
                raise ConfigError(f"parallel.{name}={v!r} is not valid; use a positive integer, or -1 to infer it "
                                  "from the world size")
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world size {world_size!r} is not valid; it must be a positive integer")
        inferred = [n for n, v in factors.items() if v == -1]
        if len(inferred) > 1:
            raise ConfigError(f"at most one parallel degree may be -1 (inferred from the world size), got "
                              f"{_show(factors)} at world size {world_size}")
        known = math.prod(v for v in factors.values() if v != -1)
        if inferred:
            if world_size % known:
                raise ConfigError(
                    f"cannot infer parallel.{inferred[0]}: the world size {world_size} is not divisible by the "
                    f"product of the other degrees ({_show(factors)}, product {known})"
                )
            factors[inferred[0]] = world_size // known
        product = math.prod(factors.values())
        if product != world_size:
            raise ConfigError(
                f"parallel layout {_show(factors)} = {product} does not match the world size {world_size}: "
                "the product of dp_replicate, dp_shard, cp, tp and pp must equal the world size "
                "(set one of them to -1 to infer it)"
            )
        return cls(world_size=world_size, **factors)

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: replicas x shards. The global batch is split over this many ranks."""
        return self.dp_replicate * self.dp_shard

    @property
    def grad_size(self) -> int:
        """Ranks whose gradients make one step's (dp x cp): the cp ranks of a dp rank hold different tokens of
        the same rows, so gradients, token counts and the logged loss are reduced over all of them."""
        return self.dp_size * self.cp

    @property
    def degrees(self) -> dict[str, int]:
        """The degrees by mesh dimension name, in mesh order."""
        return {name: getattr(self, name) for name in DIM_NAMES}

    def describe(self) -> str:
        """`pp 1 x dp_replicate 2 x dp_shard 2 x cp 1 x tp 1 = world 4`."""
        return " x ".join(f"{n} {v}" for n, v in self.degrees.items()) + f" = world {self.world_size}"


def _show(factors: dict[str, int]) -> str:
    return " x ".join(f"{n}={v}" for n, v in factors.items())
