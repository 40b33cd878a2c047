"""Pipeline parallelism (`parallel.pp > 1`) for the built-in LLaMA, composed from
`torch.distributed.pipelining` (PipelineStage + ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B): no tracing, no hand-written send/recv.

Split (torchtitan's manual split). The model is built on the meta device; `split_llama` (models/llama_parallel.py)
cuts it
into `pp x pp_stages_per_rank` stages by layer ranges (`config/pipeline.py:stage_layer_counts`;
`parallel.pp_layers` overrides the even split). A stage (`LlamaStage`) holds the model's own
modules: the embedding on the first stage, its blocks in an `nn.ModuleDict` keyed by their
original index, the final norm and the output layer on the last. Parameter names therefore stay
the plain model's (`layers.3.attn.wq.weight`), so DCP checkpoints reshard across layouts and
`dptrain ckpt export` gives plain names. Rank r holds stages r, r + pp, ... (interleaved: looped).
Each stage is materialised after splitting (and after sharding under FSDP2), replaying the whole
model's init (`materialize(source=)`): a rank allocates only its layers, with weights bit-identical
to the eager build.

Per stage, in parallelize's order: tensor parallelism on the tp mesh when tp > 1 (the built-in
LLaMA plan, `tensor.apply_llama_tp`, on the blocks the stage holds and on tok_emb / norm / head where
it has them; under sequence parallelism the activation between stages is the rank's local Shard(1)
slice of the sequence, and the pp group pairs ranks of the same tp coordinate, so each slice goes
to its own counterpart; the last stage gathers the logits over the vocabulary for `loss_fn`),
activation checkpointing per block, then data parallelism over
the data-parallel ranks of that stage: torch's FSDP2-based `replicate` (ddp; see `apply_replicate`
for why not the DDP wrapper) or FSDP2 `fully_shard` (zero2/fsdp, HSDP), per block and per stage;
nothing at dp size 1. zero1 is refused before launch (config/pipeline.py). Under context parallelism (cp > 1) each
stage holds the cp split: its attention spans the cp ranks (`apply_cp`), every micro-batch is cut to the
rank's chunks first (`ContextParallel.shard`), the stages read the rotary tables at the rank's global positions
(`LlamaStage.positions`), the data-parallel wrapper reduces over dp x cp, and evaluation counts and sums over the cp
group too.

The step (`PipelineModel.forward_backward`, called by the trainer as for any `ParallelModel`): each
of the step's `grad_accum_steps` micro-batches runs as one schedule, split into `pp_microbatches`
pieces. The loss lives on the last stage: the schedule's `loss_fn` returns the piece's summed token
cross-entropy divided by the global batch's valid-token count / dp size (dptrain's token rule,
train/loss.py; the trainer's `count_items` counts it once per step), with `scale_grads=False`, so the
step's gradient is the single-process global-batch mean. The stage drives FSDP2 / replicate itself
and reduces the gradients of each schedule at its end (`perform_reduce_grad`), adding them to the
gradients already held; with accumulation that is one reduction per micro-batch rather than one
per step (the same mean, more communication).

Evaluation runs the schedule's forward-only path (`schedule.eval`); the loss is summed over the
pipeline group (the stages before the last contribute 0), so every rank logs the same number.
Clipping takes the global norm: each stage's norm (over its tp and FSDP2 shards, per mesh: see
parallel/clip.py), squared, summed over the pipeline group. `full_state_dict` gathers the tp shards
(`full_tensor`) and collects the stages on global rank 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from dptrain.config import ParallelConfig
from dptrain.config.compression import fsdp_reduce_dtype
from dptrain.config.layout import strategy_mode
from dptrain.config.pipeline import pipeline_microbatches, stage_layer_counts
from dptrain.distributed import collectives
from dptrain.distributed.mesh import ParallelMesh
from dptrain.models.llama import LlamaLM
from dptrain.models.llama_parallel import LlamaStage, split_batch, split_llama
from dptrain.parallel import fsdp
from dptrain.parallel.activation_checkpointing import apply_activation_checkpointing
from dptrain.parallel.clip import clip_grads_with_norm_, grad_norm
from dptrain.parallel.context import ContextParallel, apply_cp, chunk_positions
from dptrain.parallel.materialize import Materializer
from dptrain.parallel.model import Context, CountItems, LossFn, ParallelModel, _no_phase, to_device
from dptrain.parallel.tensor import apply_llama_tp, tp_problem

__all__ = ["LlamaStage", "PipelineModel", "parallelize_pipeline", "split_batch", "split_llama", "stage_ids"]


def stage_ids(pp_rank: int, *, pp: int, stages_per_rank: int) -> list[int]:
    """The stages rank `pp_rank` holds: pp_rank, pp_rank + pp, ... (looped, as the interleaved schedule expects)."""
    return [pp_rank + v * pp for v in range(stages_per_rank)]


class RankView(nn.Module):
    """This rank's stages seen as one module under the plain model's names (never called): what
    the optimizer, the state dicts, clipping and the diagnostics see."""

    accepts_loss_kwargs = True
    """The pipeline's loss follows the token rule (summed token CE / num_items_in_batch): the trainer's
    `takes_num_items` reads this and hands `forward_backward` its token counter."""

    def __init__(self, parts: Sequence[LlamaStage]) -> None:
        super().__init__()
        for name in ("tok_emb", "norm", "head"):
            mods = [getattr(p, name) for p in parts if getattr(p, name) is not None]
            setattr(self, name, mods[0] if mods else None)
        layers = {k: m for p in parts for k, m in p.layers.items()}
        self.layers = nn.ModuleDict({k: layers[k] for k in sorted(layers, key=int)})


class PipelineModel(ParallelModel):
    """A pipelined model: `.module` is the rank's `RankView`; the step goes through the schedule."""

    pipelined = True

    def __init__(
        self,
        *,
        view: RankView,
        parts: list[LlamaStage],
        wrapped: list[nn.Module],
        stages: list[Any],
        schedule: Any,
        cfg: ParallelConfig,
        mesh: ParallelMesh,
        device: torch.device,
    ) -> None:
        super().__init__(view, plain=view, mode=strategy_mode(cfg), mesh=mesh, device=device)
        self.stage_parts, self.wrapped, self.stages, self.schedule = parts, wrapped, stages, schedule
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self._n_items: torch.Tensor | float = 1.0  # the loss's divisor, set before each schedule
        self.loss_scale: Callable[[torch.Tensor], torch.Tensor] | None = None
        """fp16: the GradScaler's `scale`, applied to the loss the schedule backpropagates."""
        self._scaling = False

    @property
    def sharded(self) -> bool:
        """FSDP2 (or replicate) on the stages. The fp16 scaler is the sharded one under PP either
        way (trainer): its found-inf flag must be agreed by every stage."""
        return any(isinstance(m, fsdp.FSDPModule) for m in self.wrapped)

    @property
    def full_checkpoint(self) -> bool:
        return False  # stages live on different ranks: always DCP shards (disjoint names per stage)

    @property
    def model_parts(self) -> list[nn.Module]:
        return list(self.stage_parts)

    # ---------------------------------------------------------------- the step
    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one pipeline micro-batch: summed token CE / the divisor (times
        the fp16 loss scale in training: the schedule runs the backward, so it scales here)."""
        flat = logits.float().reshape(-1, logits.size(-1))  # float32 CE, as LlamaLM.forward
        loss = F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, reduction="sum") / self._n_items
        return self.loss_scale(loss) if self._scaling and self.loss_scale is not None else loss

    def _run(self, batch: Any, *, train: bool) -> torch.Tensor:
        ids, labels = split_batch(batch)
        if self.context is not None:  # cp: every stage reads the rotary tables at this rank's global positions
            cp = self.context
            pos = chunk_positions(ids.size(1) * cp.cp, cp=cp.cp, rank=cp.rank, device=self.device)
            for part in self.stage_parts:
                part.positions = pos
        # The schedule's own `losses` list: loss_fn is also called outside the micro-batches (the
        # stage's shape inference on the first step after an evaluation), so its calls are not counted.
        losses: list[torch.Tensor] = []
        self._scaling = train
        run = self.schedule.step if train else self.schedule.eval
        args = (ids.to(self.device),) if self.has_first else ()
        extra = {"return_outputs": False} if train else {}
        run(*args, target=labels.to(self.device), losses=losses, **extra)
        if not losses:  # only the rank holding the last stage computes losses
            return torch.zeros((), device=self.device)
        total = torch.stack([loss.detach().float() for loss in losses]).sum()
        if train and self.loss_scale is not None:  # fp16: report the unscaled loss (no host sync)
            total = total / self.loss_scale(torch.ones((), device=self.device))
        return total

    def forward_backward(
        self,
        micro_batches: Sequence[Any],
        *,
        loss_fn: LossFn,
        count_items: CountItems | None,
        scaler: torch.amp.GradScaler,
        context: Context = contextlib.nullcontext,
        phase: Callable[..., None] = _no_phase,
    ) -> torch.Tensor:
        """Forward and backward of the step's micro-batches, one schedule each (the pipeline's
        micro-batch loop). The loss is the last stage's token cross-entropy (`self.loss_fn`; a
        `train.loss` is refused with pp > 1, so `loss_fn` is the default one and unused here),
        always under the token rule: `count_items` (required) counts the step's valid targets once.
        fp16: the last stage scales the loss it backpropagates with `scaler`; every stage unscales.
        Returns this rank's share of the step's loss: the global batch's loss on the last stage's
        ranks divided over dp, 0 on the other stages (`reduce_loss` sums it)."""
        if count_items is None:
            raise ValueError("pipeline parallelism trains under the token rule: forward_backward needs count_items")
        if scaler.is_enabled():
            self.loss_scale = scaler.scale
            scaler.scale(torch.zeros((), device=self.device))  # creates the scale on every stage
        batches = [to_device(b, self.device) for b in micro_batches]
        if self.context is not None:  # cp > 1: this rank's chunks of every row (parallel/context.py)
            batches = [self.context.shard(b) for b in batches]
        pairs = [split_batch(b) for b in batches]
        n = count_items([{"labels": lab} for _, lab in pairs])
        assert n is not None
        self._n_items = n
        step_loss = torch.zeros((), device=self.device)
        for ids, labels in pairs:
            phase("pipeline", collective="pipeline schedule: stage send/recv, forward + backward")
            with context():
                step_loss += self._run((ids, labels), train=True)
        return step_loss

    @torch.no_grad()
    def eval_loss(
        self, batch: Any, *, loss_fn: LossFn | None = None, context: Context = contextlib.nullcontext
    ) -> torch.Tensor:
        """The mean token loss of one evaluation batch, on every rank of the pipeline (forward only;
        the schedule's loss, `loss_fn` is unused)."""
        batch = to_device(batch, self.device)
        if self.context is not None:  # cp: this rank's chunks; the rows' valid targets counted over the cp ranks
            batch = self.context.shard(batch)
        _, labels = split_batch(batch)
        count = (labels != -100).sum().float()
        if self.context is not None:
            collectives.all_reduce_sum_(count, group=self.context.group)
        self._n_items = count.clamp_min(1)
        with context():
            loss = self.reduce_loss(self._run(batch, train=False))
        if self.context is not None:  # each cp rank's share of the rows' token mean
            collectives.all_reduce_sum_(loss, group=self.context.group)
        return loss

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss on every rank of the pipeline (the other stages hold 0): a sum over pp."""
        loss = loss.clone()
        collectives.all_reduce_sum_(loss, group=self.mesh.pp_group)
        return loss

    @contextlib.contextmanager
    def sync_gradients(self, sync: bool) -> Iterator[None]:
        yield  # the stages drive DDP/FSDP2 themselves (see the module docstring)

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Global gradient norm: this rank's stages' norm over their tp and FSDP2 shards (per mesh,
        made whole by DTensor: parallel/clip.py), squared and summed over pp; then every rank clips
        by the same factor."""

        norm, groups = grad_norm(self.plain)
        total = norm.double() ** 2
        collectives.all_reduce_sum_(total, group=self.mesh.pp_group)
        total = total.sqrt().to(norm.dtype)
        if max_norm is not None:
            clip_grads_with_norm_(groups, max_norm, total)
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated model on global rank 0: each stage's full state (collective over its
        shards under FSDP2), gathered over rank 0's pipeline group. Empty on the other ranks."""
        import torch.distributed as dist

        local: dict[str, torch.Tensor] = {}
        for part in self.stage_parts:
            # DTensor.full_tensor: a collective over the stage's data-parallel mesh (same order on every rank)
            local.update(
                {
                    k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                    for k, v in part.state_dict().items()
                }
            )
        group = self.mesh.pp_group
        ranks = dist.get_process_group_ranks(group)
        if 0 not in ranks:
            return {}
        gathered: list[Any] = [None] * len(ranks) if dist.get_rank() == 0 else []
        dist.gather_object(local, gathered if dist.get_rank() == 0 else None, dst=0, group=group)
        out: dict[str, torch.Tensor] = {}
        for sd in gathered:
            out.update(sd)
        return out

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        raise ValueError("communication hooks are not supported with pipeline parallelism (parallel.pp > 1)")

    def release(self) -> nn.Module:
        self.schedule = None
        self.stages, self.wrapped = [], []
        return super().release()


def apply_replicate(
    part: LlamaStage, *, device: torch.device, mesh: Any, materialize: Callable[[nn.Module], None] | None
) -> nn.Module:
    """ddp for a pipeline stage: torch's FSDP2-based `replicate` (gradients all-reduced over the
    data-parallel mesh), which the pipeline stage drives natively. The classic DDP wrapper does
    not compose with the schedules here: its bucket rebuild after the first step fails
    ("rebuilt parameter indices size is not same as original model parameters size", torch
    2.13), and with static_graph=True the gradients come out wrong."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    on_meta = any(p.is_meta for p in part.parameters())
    if not on_meta:
        part = part.to(device)
    for block in part.layers.values():  # one all-reduce per block, as FSDP2 units
        replicate(block, mesh=mesh)
    replicate(part, mesh=mesh)
    if on_meta:
        assert materialize is not None
        materialize(part)
    return part


def parallelize_pipeline(
    model: nn.Module,
    *,
    cfg: ParallelConfig,
    mesh: ParallelMesh,
    device: torch.device,
    materialize: Callable[[nn.Module], None] | None = None,
) -> PipelineModel:
    """Split `model` (a LlamaLM, on meta or eager) into this rank's stages, apply activation
    checkpointing and data parallelism to each, and build the schedule."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    if not isinstance(model, LlamaLM):
        raise TypeError(f"parallel.pp > 1 splits dptrain's LlamaLM; got {type(model).__name__}")
    pp, per_rank = mesh.dims.pp, cfg.pp_stages_per_rank
    n_stages = pp * per_rank
    counts = stage_layer_counts(model.cfg.n_layers, n_stages, cfg.pp_layers)
    ids = stage_ids(mesh.pp_rank, pp=pp, stages_per_rank=per_rank)
    parts = split_llama(model, stages=ids, layer_counts=counts)
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and not isinstance(materialize, Materializer):
        raise ValueError("pipeline stages of a meta-device model need dptrain's Materializer (make_materializer)")
    mode = strategy_mode(cfg)
    tp = mesh.dims.tp > 1
    if tp:
        if cfg.tp_plan is not None or cfg.loss_parallel:  # refused before launch (config/layout.py)
            raise ValueError("parallel.tp_plan and parallel.loss_parallel do not compose with parallel.pp > 1")
        if why := tp_problem(model, tp=mesh.dims.tp, tp_plan=None, sequence_parallel=cfg.sequence_parallel):
            raise ValueError(why)
    wrapped: list[nn.Module] = []
    for part in parts:
        hook = materialize.for_part(model) if isinstance(materialize, Materializer) and on_meta else None
        if tp:  # 1. tensor parallelism on the tp mesh, as parallelize does for the unsplit model
            apply_llama_tp(part, mesh.tp_mesh, sequence_parallel=cfg.sequence_parallel)
        if mesh.dims.cp > 1:  # 1b. context parallelism: the stage's attention (Ulysses or the K/V all-gather) over cp
            apply_cp(part, group=mesh.cp_group, cp=mesh.cp_size, rank=mesh.cp_rank, attention=cfg.cp_attention,
                     tp=mesh.dims.tp)
        apply_activation_checkpointing(part, mode=cfg.activation_checkpointing)  # 2.
        if mode.wrapper == "fsdp" and mesh.grad_size > 1:  # over dp_shard (x cp)
            module: nn.Module = fsdp.apply_fsdp(
                part,
                device=device,
                mesh=mesh.fsdp_mesh,
                cpu_offload=cfg.cpu_offload,
                reshard_after_forward=(
                    mode.reshard_after_forward if cfg.reshard_after_forward is None else cfg.reshard_after_forward
                ),
                mp_policy=fsdp.mixed_precision(cfg.fsdp_param_dtype, fsdp_reduce_dtype(cfg)),
                materialize=hook,
                prefetch=(cfg.fsdp_forward_prefetch, cfg.fsdp_backward_prefetch),
            )
        elif mode.wrapper == "ddp" and mesh.grad_size > 1:  # 3. (fsdp above); over dp (x cp)
            module = apply_replicate(part, device=device, mesh=mesh.grad_mesh, materialize=hook)
        else:
            if hook is not None:
                hook(part)
            module = part.to(device)
        wrapped.append(module)
    stages: list[Any] = [
        PipelineStage(m, s, n_stages, device, group=mesh.pp_group) for m, s in zip(wrapped, ids, strict=True)
    ]
    pmodel = PipelineModel(
        view=RankView(parts),
        parts=parts,
        wrapped=wrapped,
        stages=stages,
        schedule=None,
        cfg=cfg,
        mesh=mesh,
        device=device,
    )
    if mesh.dims.cp > 1:
        pmodel.context = ContextParallel(mesh.cp_group, cp=mesh.cp_size, rank=mesh.cp_rank)
    m = pipeline_microbatches(cfg)
    kwargs: dict[str, Any] = {"n_microbatches": m, "loss_fn": pmodel.loss_fn, "scale_grads": False}
    if cfg.pp_schedule == "interleaved_1f1b":
        pmodel.schedule = ScheduleInterleaved1F1B(stages, **kwargs)
    else:
        pmodel.schedule = (ScheduleGPipe if cfg.pp_schedule == "gpipe" else Schedule1F1B)(stages[0], **kwargs)
    return pmodel
