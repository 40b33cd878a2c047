"""One device mesh per run: the named parallel dimensions and the groups every part takes from it.

`ParallelDims` is plain data (no torch): the degrees of the four dimensions, -1 resolved from the
world size and validated before launch (torchtitan's `ParallelDims`). `ParallelMesh` builds ONE
torch `DeviceMesh` with the named dimensions `("pp", "dp_replicate", "dp_shard", "tp")`, plus a
1-D data-parallel mesh (dp_replicate x dp_shard, flattened into `"dp"` under HSDP) for
data-parallel collectives, and answers
the questions the rest of the run asks:

- the data sampler and evaluation: `dp_rank`, `dp_size` (ranks that differ only in tp or pp
  coordinates see the same batch);
- loss, metric and eval means: `dp_group`;
- FSDP2: `fsdp_mesh` (1-D dp_shard, or 2-D (dp_replicate, dp_shard) = HSDP);
- tensor parallelism: `tp_mesh` (the innermost dimension; FSDP2 over a tensor-parallel model
  needs both meshes sliced from this one root mesh);
- DDP and ZeRO-1: `dp_group`;
- pipeline parallelism: `pp_group`, `pp_rank`, `pp_mesh` (the stages of one (dp, tp) coordinate);
- the replica check: `replica_group`, the dp_replicate dimension: ranks that hold the same
  parameters (or the same shard of them), one group per (dp_shard, tp, pp) coordinate.

Global ranks stay what they are for files (checkpoints, logs): rank r is coordinate r of the
mesh in row-major order, so with tp = pp = 1 the dp rank is the global rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dptrain.config.fields import ConfigError

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")
"""Mesh dimensions, outermost first: pipeline stages span nodes, tensor parallelism stays innermost
(fastest links); data-parallel replicas sit outside their shards (HSDP: replicate across nodes,
shard within a node)."""

@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the run's parallel dimensions; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int

    @classmethod
    def resolve(cls, *, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, pp: int = 1,
                world_size: int) -> ParallelDims:
        """Resolve at most one -1 from the world size and check the product. Raises ConfigError
        naming every factor and the world size."""
        factors = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp}
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
                "the product of dp_replicate, dp_shard, tp and pp must equal the world size "
                "(set one of them to -1 to infer it)"
            )
        return cls(world_size=world_size, **factors)

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: replicas x shards. The global batch is split over this many ranks."""
        return self.dp_replicate * self.dp_shard

    @property
    def degrees(self) -> dict[str, int]:
        """The degrees by mesh dimension name, in mesh order."""
        return {name: getattr(self, name) for name in DIM_NAMES}

    def describe(self) -> str:
        """`dp_replicate 2 x dp_shard 2 x tp 1 x pp 1 = world 4`."""
        return " x ".join(f"{n} {v}" for n, v in self.degrees.items()) + f" = world {self.world_size}"


def _dp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The 1-D data-parallel mesh: the one dp dimension larger than 1 when there is one (a plain
    slice), else (HSDP) dp_replicate x dp_shard flattened into `"dp"`. Flattening is avoided when
    it is not needed: the root mesh and its flattened mesh reference each other, and such a cycle
    of process-group holders left for the garbage collector can be freed in a forked child, whose
    gloo destructor then waits forever for threads that only exist in the parent."""
    if dims.dp_shard == 1:
        return mesh["dp_replicate"]
    if dims.dp_replicate == 1:
        return mesh["dp_shard"]
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


def _show(factors: dict[str, int]) -> str:
    return " x ".join(f"{n}={v}" for n, v in factors.items())


class ParallelMesh:
    """The run's DeviceMesh and the ranks and groups every part of the run takes from it."""

    def __init__(self, dims: ParallelDims, mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
        self.dims = dims
        self.mesh = mesh
        self.dp_mesh = dp_mesh
        """The flattened 1-D data-parallel mesh (dp_replicate x dp_shard)."""

    @classmethod
    def build(cls, dims: ParallelDims, *, device_type: str) -> ParallelMesh:
        """Create the mesh over the default process group (collective: every rank calls it).
        Works at world size 1 too (a world of one over a HashStore)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh.build needs a process group; call init_process_group first")
        if dist.get_world_size() != dims.world_size:
            raise RuntimeError(f"the layout {dims.describe()} was resolved for world size {dims.world_size} but "
                               f"{dist.get_world_size()} ranks joined the process group")
        shape = tuple(dims.degrees.values())
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIM_NAMES)
        return cls(dims, mesh, _dp_mesh(mesh, dims))

    def release(self) -> None:
        """Drop the DeviceMesh (and through it this object's process groups). Call before
        `destroy_process_group`: a process-group object that outlives its group, left as garbage,
        may be freed later, in a process forked from this one, where gloo's destructor waits forever
        for threads that only exist in the parent. The object cannot be used afterwards."""
        self.mesh = self.dp_mesh = None  # type: ignore[assignment]

    # ---------------------------------------------------------------- data parallelism

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: which slice of each global batch it takes."""
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Group for gradient all-reduce (DDP), ZeRO-1 and loss/metric/eval means."""
        return self.dp_mesh.get_group()

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh: dp_shard (1-D), or (dp_replicate, dp_shard) for HSDP."""
        if self.dims.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 1-D tensor-parallel mesh: this rank's tp group (size 1 when tp = 1)."""
        return self.mesh["tp"]

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same parameters (or the same shard): this rank's dp_replicate group,
        one per (dp_shard, tp, pp) coordinate. None when there is nothing to compare (no replicas)."""
        if self.dims.dp_replicate == 1:
            return None
        return self.mesh["dp_replicate"].get_group()

    # ---------------------------------------------------------------- pipeline parallelism

    @property
    def pp_mesh(self) -> DeviceMesh:
        """The 1-D pipeline mesh: the ranks holding the stages of this rank's (dp, tp) coordinate."""
        return self.mesh["pp"]

    @property
    def pp_rank(self) -> int:
        """This rank's position in its pipeline (0: holds the first stage)."""
        return self.mesh["pp"].get_local_rank()

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """Group of the pipeline's point-to-point traffic, the loss broadcast from the last stage and
        the gradient norm's sum over stages."""
        return self.mesh["pp"].get_group()

    def coordinate(self) -> dict[str, int]:
        """This rank's coordinate along every named dimension."""
        coord = self.mesh.get_coordinate()
        assert coord is not None  # every rank is in the mesh: it spans the world
        return dict(zip(DIM_NAMES, coord, strict=True))

    def describe(self) -> dict[str, Any]:
        """Degrees and this rank's coordinate, for logs and summaries."""
        return {"degrees": self.dims.degrees, "coordinate": self.coordinate(), "dp_rank": self.dp_rank}
