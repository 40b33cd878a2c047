"""`parallelize_model`: PyTorch's parallel APIs applied to a plain model in one fixed order, returning the
`ParallelModel` (parallel/model.py) that owns the result.

With pp > 1 the model is first split into pipeline stages (`parallel/pipeline.py`), and steps 1 to 3
apply to each stage. Order (torchtitan's): 1. tensor parallelism on the tp mesh (parallel/tensor.py),
1b. context parallelism (parallel.cp: the built-in LLaMA's attention: Ulysses all-to-all or K/V all-gather;
parallel/context.py), 2. activation checkpointing per block, 2b. torch.compile per block (train.compile;
parallel/compile.py), 3. data parallelism: FSDP2 `fully_shard` on the dp_shard dimension (dp_shard x cp
under cp), or the 2-D (dp_replicate, dp_shard) mesh: HSDP, or DDP on the data-parallel group (dp x cp; over a
tensor-parallel model FSDP2's `replicate` on the 1-D dp (x cp) mesh), or nothing (single) / nn.DataParallel (dp);
ZeRO-1 is DDP plus a sharded optimizer
(`ParallelModel.optimizer`). Which of these applies comes from the `DataParallelMode` of the strategy
(config/layout.py), never from the strategy name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dptrain.config import ParallelConfig
from dptrain.config.compression import fsdp_reduce_dtype
from dptrain.config.layout import strategy_mode
from dptrain.distributed.mesh import ParallelMesh
from dptrain.parallel import ddp, fsdp
from dptrain.parallel.activation_checkpointing import apply_activation_checkpointing
from dptrain.parallel.compile import apply_compile
from dptrain.parallel.context import ContextParallel, apply_cp
from dptrain.parallel.dp import apply_dp
from dptrain.parallel.model import Materialize, ParallelModel
from dptrain.parallel.pipeline import parallelize_pipeline
from dptrain.parallel.single import apply_single
from dptrain.parallel.tensor import apply_tp


def parallelize_model(
    model: nn.Module,
    *,
    cfg: ParallelConfig,
    mesh: ParallelMesh,
    device: torch.device,
    materialize: Materialize | None = None,
    comm_hook: tuple[Any, Callable[..., Any]] | None = None,
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
        return parallelize_pipeline(model, cfg=cfg, mesh=mesh, device=device, materialize=materialize)
    tp = mesh.dims.tp > 1
    if tp:  # 1. tensor parallelism on the innermost mesh dimension
        apply_tp(
            model,
            mesh.tp_mesh,
            tp_plan=cfg.tp_plan,
            sequence_parallel=cfg.sequence_parallel,
            loss_parallel=cfg.loss_parallel,
        )
    cp = None
    if mesh.dims.cp > 1:  # 1b. context parallelism: Ulysses or the K/V all-gather over the cp ranks
        cp = ContextParallel(mesh.cp_group, cp=mesh.cp_size, rank=mesh.cp_rank)
        apply_cp(model, group=cp.group, cp=cp.cp, rank=cp.rank, attention=cfg.cp_attention, tp=mesh.dims.tp)
    apply_activation_checkpointing(model, mode=cfg.activation_checkpointing)  # 2.
    if compile_backend is not None:  # 2b. per block, before the data-parallel wrapper
        apply_compile(model, backend=compile_backend)
    if mode.wrapper == "fsdp":  # 3. data parallelism
        reshard = mode.reshard_after_forward if cfg.reshard_after_forward is None else cfg.reshard_after_forward
        module: nn.Module = fsdp.apply_fsdp(
            model,
            device=device,
            mesh=mesh.fsdp_mesh,
            reshard_after_forward=reshard,
            cpu_offload=cfg.cpu_offload,
            mp_policy=fsdp.mixed_precision(cfg.fsdp_param_dtype, fsdp_reduce_dtype(cfg)),
            materialize=materialize,
            prefetch=(cfg.fsdp_forward_prefetch, cfg.fsdp_backward_prefetch),
        )
    elif mode.wrapper == "ddp" and tp and mesh.grad_size == 1:
        module = apply_single(model, device=device, materialize=materialize)  # tp alone: nothing to replicate
    elif mode.wrapper == "ddp" and tp:  # gradients all-reduced over dp, or dp x cp (the cp ranks' tokens differ)
        module = ddp.apply_ddp_over_tp(model, device=device, mesh=mesh.grad_mesh, materialize=materialize)
    elif mode.wrapper == "ddp":
        module = ddp.apply_ddp(
            model,
            device=device,
            bucket_cap_mb=cfg.bucket_cap_mb,
            process_group=mesh.grad_group,  # dp, or dp x cp
            materialize=materialize,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            static_graph=cfg.static_graph,
        )
    elif mode.wrapper == "dataparallel":
        module = apply_dp(apply_single(model, device=device, materialize=materialize), device=device)
    else:
        module = apply_single(model, device=device, materialize=materialize)
    pmodel = ParallelModel(module, plain=model, mode=mode, mesh=mesh, loss_parallel=cfg.loss_parallel, device=device,
                         sync_each_micro_step=cfg.sync_each_micro_step)
    pmodel.context = cp
    if comm_hook is not None:
        pmodel.register_comm_hook(*comm_hook)
    return pmodel
