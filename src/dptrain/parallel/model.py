"""`parallelize_model`: PyTorch's parallel APIs applied to a plain model in one fixed order, and the
`ParallelModel` it returns, the only object that knows which wrapper is in use.

With pp > 1 the model is first split into pipeline stages (`parallel/pipeline.py`), and steps 1 to 3
apply to each stage. Order (torchtitan's): 1. tensor parallelism on the tp mesh (parallel/tensor.py),
2. activation checkpointing per block, 2b. torch.compile per block (train.compile; parallel/compile.py),
3. data parallelism: FSDP2 `fully_shard` on the
dp_shard dimension (or the 2-D (dp_replicate, dp_shard) mesh: HSDP), or DDP on the data-parallel
group, or nothing (single) / nn.DataParallel (dp); ZeRO-1 is DDP plus a sharded optimizer
(`build_optimizer`). Which of these applies comes from the `DataParallelMode` of the strategy
(config/layout.py), never from the strategy name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from dptrain.config import OptimConfig, ParallelConfig
from dptrain.config.compression import fsdp_reduce_dtype
from dptrain.config.layout import DataParallelMode, strategy_mode
from dptrain.distributed.mesh import ParallelMesh
from dptrain.parallel import ddp, fsdp
from dptrain.parallel.activation_checkpointing import apply_activation_checkpointing
from dptrain.parallel.dp import apply_dp
from dptrain.parallel.single import apply_single

Materialize = Callable[[nn.Module], None]


class ParallelModel:
    """A parallelised model: `.module` is what to call; the methods are what differs by wrapper."""

    def __init__(self, module: nn.Module, *, plain: nn.Module, mode: DataParallelMode, mesh: ParallelMesh,
                 loss_parallel: bool = False) -> None:
        self.module = module
        self.plain = plain
        self.mode = mode
        self.mesh = mesh
        self.cfg_loss_parallel = loss_parallel
        """parallel.loss_parallel: the logits stay vocabulary-sharded under tp (see loss_context)."""

    pipelined = False
    """True for a `PipelineModel` (parallel/pipeline.py): the step goes through its schedule."""

    @property
    def sharded(self) -> bool:
        """Parameters are sharded across ranks (FSDP2: zero2, fsdp, HSDP; tensor parallelism): their
        state is saved and loaded as DCP shards, never gathered into one file."""
        return self.mode.wrapper == "fsdp" or self.tensor_parallel

    @property
    def tensor_parallel(self) -> bool:
        """The model is split over tp > 1 ranks (its parameters are DTensors on the tp mesh)."""
        return self.mesh is not None and self.mesh.dims.tp > 1

    @property
    def full_checkpoint(self) -> bool:
        """Checkpoints in the `full` format (rank 0 holds everything) rather than DCP shards."""
        return not self.sharded

    @property
    def model_parts(self) -> list[nn.Module]:
        """The modules a checkpoint saves as model parts (one; a pipeline's stages on this rank)."""
        return [self.module]

    # ---------------------------------------------------------------- the step
    @contextlib.contextmanager
    def sync_gradients(self, sync: bool) -> Iterator[None]:
        """Wrap a micro-step's forward AND backward: sync=False only accumulates gradients locally
        (DDP `no_sync`, FSDP2 `set_requires_gradient_sync(False)`); sync=True reduces them."""
        with self.loss_context():
            if isinstance(self.module, DDP):
                with ddp.gradient_sync(self.module, sync):
                    yield
            elif isinstance(self.module, FSDPModule):  # FSDP2, and replicate (ddp over tp)
                with fsdp.gradient_sync(self.module, sync):
                    yield
            else:
                yield

    def loss_context(self) -> contextlib.AbstractContextManager[None]:
        """Around a forward that computes the loss (and its backward): `loss_parallel()` when the
        logits are vocabulary-sharded (parallel.loss_parallel with tp > 1), else nothing.
        `sync_gradients` enters it; evaluation enters it on its own."""
        from dptrain.parallel.tensor import loss_context

        return loss_context(self.tensor_parallel and self.cfg_loss_parallel)

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Clip to the global gradient norm over every dimension and return it (a plain tensor).
        DDP's gradients are already identical on every replica; FSDP2's are sharded DTensors whose
        norm is reduced over the shard (and replicate) dimensions."""
        from dptrain.parallel.clip import clip_grad_norm_

        return clip_grad_norm_(self.module, max_norm)

    # ---------------------------------------------------------------- optimizer
    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Any = None, **defaults: Any) -> torch.optim.Optimizer:
        """`optimizer_class(params or the model's parameters, **defaults)`; under zero1 its state is
        sharded over the data-parallel ranks (ZeroRedundancyOptimizer)."""
        params = list(self.module.parameters()) if params is None else list(params)
        if not self.mode.shard_optimizer:
            return optimizer_class(params, **defaults)
        from dptrain.parallel.zero import zero_redundancy_optimizer

        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        return zero_redundancy_optimizer(groups, optimizer_class=optimizer_class, process_group=self.mesh.dp_group,
                                         **defaults)

    def build_optimizer(self, *, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
        """The configured optimizer (no decay on 1-D parameters), sharded under zero1."""
        from dptrain.train.optim import optimizer_spec, param_groups

        cls, defaults = optimizer_spec(cfg, lr=lr)
        return self.optimizer(cls, param_groups(self.module, weight_decay=cfg.weight_decay), **defaults)

    # ---------------------------------------------------------------- state
    def state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model, optimizer) state under the plain module's names through DCP's `get_state_dict`:
        sharded (DTensor) values under FSDP2, full ones otherwise. Collective under FSDP2 and zero1.
        zero1's optimizer state (which DCP does not handle) is consolidated and given to every rank in
        ZeroRedundancyOptimizer's own format, which its `load_state_dict` re-partitions."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if optimizer is None:
            return get_model_state_dict(self.plain), {}
        if self.mode.shard_optimizer:
            from dptrain.distributed.collectives import broadcast_object

            optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # collective
            own = optimizer.state_dict() if self.mesh.dp_rank == 0 else None
            return get_model_state_dict(self.plain), broadcast_object(own, src=self._dp_root(), group=self.mesh.dp_group)
        return get_state_dict(self.plain, optimizer)

    def load_state_dict(self, model_state: dict[str, Any], optimizer: torch.optim.Optimizer | None = None,
                        optim_state: dict[str, Any] | None = None) -> None:
        """Put values from `state_dict` (possibly saved at another world size and resharded by DCP)
        back through DCP's `set_state_dict` (zero1's optimizer: its own `load_state_dict`)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if optimizer is None or self.mode.shard_optimizer:
            set_model_state_dict(self.plain, model_state)
            if optimizer is not None:
                optimizer.load_state_dict(optim_state or {})
        else:
            set_state_dict(self.plain, optimizer, model_state_dict=model_state, optim_state_dict=optim_state or {})

    def _dp_root(self) -> int:
        """Global rank of data-parallel rank 0 of this rank's data-parallel group."""
        import torch.distributed as dist

        return dist.get_process_group_ranks(self.mesh.dp_group)[0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated model state on CPU under the plain module's names (for export).
        Collective under FSDP2 (call on every rank); complete on rank 0."""
        from dptrain.parallel.wrapped import full_state_dict

        return full_state_dict(self.module)

    # ---------------------------------------------------------------- communication
    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """Install a DDP communication hook (gradient compression and the like; see
        torch.distributed.algorithms.ddp_comm_hooks). Only DDP (ddp, zero1) has one."""
        if not isinstance(self.module, DDP):
            why = ("with tensor parallelism, ddp is FSDP2's replicate" if self.mode.wrapper == "ddp" else
                   f"this model uses {self.mode.wrapper!r}")
            raise ValueError(f"communication hooks apply to DDP (strategies ddp, zero1); {why}, whose reductions "
                             "are not hookable")
        self.module.register_comm_hook(state, hook)

    def release(self) -> nn.Module:
        """Drop the wrapper (call while the process group still exists: a DDP reducer freed after
        `destroy_process_group` can deadlock gloo's teardown); `.module` becomes the plain module."""
        self.module = self.plain
        return self.plain


def parallelize_model(
    model: nn.Module, *, cfg: ParallelConfig, mesh: ParallelMesh, device: torch.device,
    materialize: Materialize | None = None, comm_hook: tuple[Any, Callable[..., Any]] | None = None,
    compile_backend: str | None = None,
) -> ParallelModel:
    """Apply tensor parallelism, activation checkpointing, then FSDP2 or DDP to a plain
    `model` for the layout of `mesh`. Parameters on the meta device are handed to `materialize`
    (which allocates, e.g. `to_empty`, and initialises them) at the right point: after sharding
    under FSDP2, before DDP (which broadcasts parameters at construction). `comm_hook`: a DDP
    communication hook `(state, hook)`, registered right after construction. `compile_backend`: compile
    every block with this torch.compile backend (train.compile) between activation checkpointing and
    data parallelism; None: eager."""
    mode = strategy_mode(cfg)
    if mesh.dims.pp > 1:  # pipeline parallelism: stages by layer ranges, DP per stage (parallel/pipeline.py)
        from dptrain.parallel.pipeline import parallelize_pipeline

        return parallelize_pipeline(model, cfg=cfg, mesh=mesh, device=device, materialize=materialize)
    tp = mesh.dims.tp > 1
    if tp:  # 1. tensor parallelism on the innermost mesh dimension
        from dptrain.parallel.tensor import apply_tp

        apply_tp(model, mesh.tp_mesh, tp_plan=cfg.tp_plan, sequence_parallel=cfg.sequence_parallel,
                 loss_parallel=cfg.loss_parallel)
    apply_activation_checkpointing(model, mode=cfg.activation_checkpointing)  # 2.
    if compile_backend is not None:  # 2b. per block, before the data-parallel wrapper
        from dptrain.parallel.compile import apply_compile

        apply_compile(model, backend=compile_backend)
    if mode.wrapper == "fsdp":  # 3. data parallelism
        reshard = mode.reshard_after_forward if cfg.reshard_after_forward is None else cfg.reshard_after_forward
        module: nn.Module = fsdp.apply_fsdp(
            model, device=device, mesh=mesh.fsdp_mesh, reshard_after_forward=reshard,
            cpu_offload=cfg.cpu_offload, mp_policy=fsdp.mixed_precision(cfg.fsdp_param_dtype, fsdp_reduce_dtype(cfg)),
            materialize=materialize, prefetch=(cfg.fsdp_forward_prefetch, cfg.fsdp_backward_prefetch),
        )
    elif mode.wrapper == "ddp" and tp and mesh.dims.dp_size == 1:
        module = apply_single(model, device=device, materialize=materialize)  # tp alone: nothing to replicate
    elif mode.wrapper == "ddp" and tp:
        module = ddp.apply_ddp_over_tp(model, device=device, mesh=mesh.dp_mesh, materialize=materialize)
    elif mode.wrapper == "ddp":
        module = ddp.apply_ddp(model, device=device, bucket_cap_mb=cfg.bucket_cap_mb, process_group=mesh.dp_group,
                               materialize=materialize, gradient_as_bucket_view=cfg.gradient_as_bucket_view,
                               static_graph=cfg.static_graph)
    elif mode.wrapper == "dataparallel":
        module = apply_dp(apply_single(model, device=device, materialize=materialize), device=device)
    else:
        module = apply_single(model, device=device, materialize=materialize)
    plan = ParallelModel(module, plain=model, mode=mode, mesh=mesh, loss_parallel=cfg.loss_parallel)
    if comm_hook is not None:
        plan.register_comm_hook(*comm_hook)
    return plan
