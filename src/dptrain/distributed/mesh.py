"""One device mesh per run: the named parallel dimensions and the groups every part takes from it.

`ParallelDims` (config/dims.py, re-exported here) is plain data: the degrees of the five dimensions, -1
resolved from the world size and validated before launch (torchtitan's `ParallelDims`). `ParallelMesh` builds ONE
torch `DeviceMesh` with the named dimensions `("pp", "dp_replicate", "dp_shard", "cp", "tp")`, plus a
1-D data-parallel mesh (dp_replicate x dp_shard, flattened into `"dp"` under HSDP) for
data-parallel collectives, and answers
the questions the rest of the run asks:

- the data sampler and evaluation: `dp_rank`, `dp_size` (ranks that differ only in cp, tp or pp
  coordinates see the same batch);
- metric and eval means: `dp_group`; gradients, the token rule's count and the logged loss: `grad_group` (dp x cp);
- context parallelism: `cp_group`, `cp_rank` (which chunks of each row; parallel/context.py);
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

from typing import TYPE_CHECKING, Any

from dptrain.config.dims import DIM_NAMES, ParallelDims

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

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


def _grad_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """cp > 1: the data-parallel dimensions and cp flattened into `"dp_cp"` (gradients, token counts, the logged
    loss), after `"dp_shard_cp"` (FSDP2's shard dimension under cp: torchtitan's layout)."""
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")


class ParallelMesh:
    """The run's DeviceMesh and the ranks and groups every part of the run takes from it."""

    def __init__(self, dims: ParallelDims, mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
        self.dims = dims
        self.mesh = mesh
        self.dp_mesh = dp_mesh
        """The flattened 1-D data-parallel mesh (dp_replicate x dp_shard)."""
        self.grad_mesh = dp_mesh if dims.cp == 1 else _grad_mesh(mesh, dims)
        """The 1-D mesh gradients are averaged over: dp_mesh, or with cp > 1 (dp_replicate x) dp_shard x cp."""

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
        self.mesh = self.dp_mesh = self.grad_mesh = None  # type: ignore[assignment]

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
    def grad_group(self) -> dist.ProcessGroup:
        """The ranks gradients are averaged over and the token rule counts over: `dp_group`, or with cp > 1 every
        (dp, cp) rank (the cp ranks of a dp rank hold different tokens of the same rows)."""
        return self.grad_mesh.get_group()

    @property
    def grad_size(self) -> int:
        return self.dims.grad_size

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh: dp_shard (1-D), or (dp_replicate, dp_shard) for HSDP; with cp > 1 the shard dimension is
        dp_shard x cp (`"dp_shard_cp"`), whose gradients FSDP2 reduce-scatters over the cp ranks too."""
        shard = "dp_shard" if self.dims.cp == 1 else "dp_shard_cp"
        if self.dims.dp_replicate > 1:
            return self.mesh["dp_replicate", shard]
        return self.mesh[shard]

    # ---------------------------------------------------------------- context parallelism

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """The ranks one sequence is split over (they share a dp rank's rows): K/V are all-gathered over it."""
        return self.mesh["cp"].get_group()

    @property
    def cp_rank(self) -> int:
        """Which chunks of each row this rank takes (chunks cp_rank and 2*cp-1-cp_rank of 2*cp)."""
        return self.mesh["cp"].get_local_rank()

    @property
    def cp_size(self) -> int:
        return self.dims.cp

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
