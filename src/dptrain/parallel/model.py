"""The `ParallelModel` that `parallelize_model` (parallel/compose.py) returns: the only object that knows which
wrapper is in use. It owns the forward and backward of a step's micro-batches (`forward_backward`; a
`PipelineModel` runs its schedule there instead), the gradient-sync context, clipping, the optimizer's sharding
and the state dicts; the trainer calls the same methods whatever the layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from dptrain.config.layout import DataParallelMode
from dptrain.distributed.collectives import broadcast_object
from dptrain.distributed.mesh import ParallelMesh
from dptrain.parallel.clip import clip_grad_norm_
from dptrain.parallel.context import ContextParallel
from dptrain.parallel.tensor import loss_context
from dptrain.parallel.wrapped import full_state_dict
from dptrain.parallel.zero import zero_redundancy_optimizer

Materialize = Callable[[nn.Module], None]
LossFn = Callable[..., torch.Tensor]
"""`loss_fn(module, batch, **kw) -> scalar loss` (dptrain/train/loss.py)."""
CountItems = Callable[[Sequence[Any]], "torch.Tensor | None"]
"""The token rule's `num_items_in_batch` of a step's micro-batches (dptrain/train/loss.py: `items_per_rank`)."""
Context = Callable[[], contextlib.AbstractContextManager[Any]]
"""A context factory entered around each forward (autocast: dptrain/train/precision.py)."""


def _no_phase(name: str, **kw: Any) -> None:
    pass


def to_device(batch: Any, device: torch.device | str) -> Any:
    """`batch` with every tensor moved to `device`, through nested mappings (dicts, Hugging Face's
    `BatchEncoding`: returned as dicts), lists, tuples and named tuples; other values as they are.
    Copies from pinned memory are non-blocking."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@contextlib.contextmanager
def gradient_sync(module: nn.Module, sync: bool) -> Iterator[None]:
    """Around a micro-step's forward AND backward: sync=False only accumulates gradients locally
    (DDP `no_sync`; FSDP2 `set_requires_gradient_sync(False)`, also torch's `replicate`); sync=True,
    or any other module, reduces them as usual."""
    if sync:
        yield
    elif isinstance(module, DDP):
        with module.no_sync():
            yield
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


class ParallelModel:
    """A parallelised model: `.module` is what to call; the methods are what differs by wrapper."""

    def __init__(self, module: nn.Module, *, plain: nn.Module, mode: DataParallelMode, mesh: ParallelMesh,
                 loss_parallel: bool = False, device: torch.device | None = None,
                 sync_each_micro_step: bool = False) -> None:
        self.module = module
        self.plain = plain
        self.mode = mode
        self.mesh = mesh
        self.device = device or torch.device("cpu")
        """Where the step's batches go (`forward_backward` moves them)."""
        self.loss_parallel = loss_parallel and self.tensor_parallel
        """parallel.loss_parallel with tp > 1: the logits stay vocabulary-sharded (see loss_context)."""
        self.sync_each_micro_step = sync_each_micro_step
        """parallel.sync_each_micro_step: reduce gradients in every micro-step's backward."""

    pipelined = False
    """True for a `PipelineModel` (parallel/pipeline.py): its stages span the pipeline group."""
    context: ContextParallel | None = None
    """parallel.cp > 1: every batch is cut to this rank's chunks of its rows first (parallel/context.py)."""

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
    def forward_backward(self, micro_batches: Sequence[Any], *, loss_fn: LossFn, count_items: CountItems | None,
                         scaler: torch.amp.GradScaler, context: Context = contextlib.nullcontext,
                         phase: Callable[..., None] = _no_phase) -> torch.Tensor:
        """Forward and backward of one step's micro-batches (each moved to this model's device first),
        reducing gradients only in the last backward (every one with parallel.sync_each_micro_step).
        Returns this rank's share of the step's loss (`reduce_loss` makes it the model's).

        Each micro-step's loss is normalised so that the step's gradient is the global batch's
        (dptrain/train/loss.py): `count_items(batches)` gives the token rule's `num_items_in_batch`
        (the global batch's valid targets / dp size, counted once per step before any backward), and
        the loss is `loss_fn(module, batch, num_items_in_batch=n)`; without it (or when it returns
        None) the sample rule divides each `loss_fn(module, batch)` by the number of micro-batches.
        `scaler`: the loss scaler (a pass-through unless fp16); `context()`: entered around each
        forward (autocast); `phase(name, **kw)`: the diagnostics' heartbeat."""
        batches = [to_device(b, self.device) for b in micro_batches]
        if self.context is not None:  # cp > 1: this rank's chunks of every row, with their global positions
            batches = [self.context.shard(b) for b in batches]
        n_items = count_items(batches) if count_items is not None else None
        accum = len(batches)
        step_loss = torch.zeros((), device=self.device)
        for micro, batch in enumerate(batches):
            sync = micro == accum - 1 or self.sync_each_micro_step
            with self.sync_gradients(sync):
                phase("forward")
                with context():
                    if n_items is None:  # sample rule: the mean of equal micro-batch means
                        loss = loss_fn(self.module, batch) / accum
                    else:  # token rule: this micro-batch's summed token losses / n_items
                        loss = loss_fn(self.module, batch, num_items_in_batch=n_items)
                phase("backward", sync=sync)  # sync: DDP/FSDP reduce gradients in this backward
                scaler.scale(loss).backward()
            step_loss += loss.detach()
        return step_loss

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss from `forward_backward` as every rank of this model holds it: itself here (a
        pipeline's lives on its last stage: see PipelineModel). Called at a log step."""
        return loss

    @torch.no_grad()
    def eval_loss(self, batch: Any, *, loss_fn: LossFn, context: Context = contextlib.nullcontext) -> torch.Tensor:
        """The loss of one evaluation batch (moved to this model's device), forward only, under the
        loss context (tensor parallelism's loss_parallel) and `context()` (autocast)."""
        with context(), self.loss_context():
            if self.context is not None:  # cp > 1: the rows' token mean, reduced over the cp ranks
                return self.context.eval_loss(self.module, to_device(batch, self.device), loss_fn=loss_fn)
            return loss_fn(self.module, to_device(batch, self.device))

    @contextlib.contextmanager
    def sync_gradients(self, sync: bool) -> Iterator[None]:
        """Wrap a micro-step's forward AND backward: sync=False only accumulates gradients locally
        (DDP `no_sync`, FSDP2 `set_requires_gradient_sync(False)`); sync=True reduces them."""
        with self.loss_context(), gradient_sync(self.module, sync):
            yield

    def loss_context(self) -> contextlib.AbstractContextManager[None]:
        """Around a forward that computes the loss (and its backward): `loss_parallel()` when the
        logits are vocabulary-sharded (parallel.loss_parallel with tp > 1), else nothing.
        `sync_gradients` and `eval_loss` enter it."""
        if not self.loss_parallel:
            return contextlib.nullcontext()

        return loss_context(True)

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Clip to the global gradient norm over every dimension and return it (a plain tensor).
        DDP's gradients are already identical on every replica; FSDP2's are sharded DTensors whose
        norm is reduced over the shard (and replicate) dimensions."""

        return clip_grad_norm_(self.module, max_norm)

    # ---------------------------------------------------------------- optimizer
    def optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], params: Any = None, **defaults: Any
    ) -> torch.optim.Optimizer:
        """`optimizer_class(params or the model's parameters, **defaults)`; under zero1 its state is
        sharded over the data-parallel ranks (ZeroRedundancyOptimizer)."""
        params = list(self.module.parameters()) if params is None else list(params)
        if not self.mode.shard_optimizer:
            return optimizer_class(params, **defaults)

        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        return zero_redundancy_optimizer(
            groups, optimizer_class=optimizer_class, process_group=self.mesh.dp_group, **defaults
        )

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
            optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # collective
            own = optimizer.state_dict() if self.mesh.dp_rank == 0 else None
            return get_model_state_dict(self.plain), broadcast_object(
                own, src=self._dp_root(), group=self.mesh.dp_group
            )
        return get_state_dict(self.plain, optimizer)

    def load_state_dict(
        self,
        model_state: dict[str, Any],
        optimizer: torch.optim.Optimizer | None = None,
        optim_state: dict[str, Any] | None = None,
    ) -> None:
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

        return full_state_dict(self.module)

    # ---------------------------------------------------------------- communication
    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """Install a DDP communication hook (gradient compression and the like; see
        torch.distributed.algorithms.ddp_comm_hooks). Only DDP (ddp, zero1) has one."""
        if not isinstance(self.module, DDP):
            why = (
                "with tensor parallelism, ddp is FSDP2's replicate"
                if self.mode.wrapper == "ddp"
                else f"this model uses {self.mode.wrapper!r}"
            )
            raise ValueError(
                f"communication hooks apply to DDP (strategies ddp, zero1); {why}, whose reductions are not hookable"
            )
        self.module.register_comm_hook(state, hook)

    def release(self) -> nn.Module:
        """Drop the wrapper (call while the process group still exists: a DDP reducer freed after
        `destroy_process_group` can deadlock gloo's teardown); `.module` becomes the plain module."""
        self.module = self.plain
        return self.plain
