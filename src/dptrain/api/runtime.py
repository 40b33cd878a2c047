"""Small helpers for an own loop: rank-0 print, barrier, mean over ranks, gathering evaluation outputs
without the padding of an uneven set, autocast + loss scaling by precision, and saving the plain module."""

from __future__ import annotations

import builtins
import contextlib
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dptrain.checkpoint.storage import save_safetensors
from dptrain.config import ConfigError, PrecisionConfig
from dptrain.data import EvalLoader
from dptrain.distributed import collectives
from dptrain.parallel import ParallelModel, full_state_dict, is_sharded
from dptrain.train.precision import autocast_factory, build_grad_scaler


def print0(*args: Any, **kwargs: Any) -> None:
    """`print` on global rank 0 only (flushed)."""
    if collectives.rank() == 0:
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


def barrier() -> None:
    """Wait until every rank gets here (nothing in a world of one)."""
    collectives.barrier()


def all_reduce_mean(x: torch.Tensor | float, *, group: Any = None) -> Any:
    """The mean of `x` over the ranks of `group` (default: every rank). A tensor gives a new tensor on its
    own device (the input is left as it is); a Python number gives a float."""
    if isinstance(x, torch.Tensor):
        out = x.detach().clone()
        if not out.is_floating_point():
            out = out.double()
        if collectives.world_size(group) > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out / collectives.world_size(group)
    return collectives.all_reduce_mean([float(x)], device=_collective_device(), group=group)[0]


def broadcast(value: Any, *, src: int = 0) -> Any:
    """Rank `src`'s `value` on every rank: a decision one rank made (`is_best = dptrain.broadcast(val_loss <
    best)`), so that every rank takes the same branch to a collective such as `Checkpointer.save`. A tensor
    gives a new tensor on its own device (the same shape and dtype on every rank); anything else is sent
    pickled (keep it small: numbers, strings, flags). Collective; a world of one returns `value`."""
    if collectives.world_size() == 1:
        return value
    if isinstance(value, torch.Tensor):
        out = value.detach().clone()
        dist.broadcast(out, src=src)
        return out
    return collectives.broadcast_object(value, src=src)


def _collective_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(t: torch.Tensor, group: Any) -> torch.Tensor:
    world = collectives.world_size(group)
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def gather_for_metrics(outputs: Any, loader: EvalLoader | None = None, *, group: Any = None) -> Any:
    """Every rank's `outputs` of the current evaluation batch, concatenated along dim 0 in rank order,
    without the samples `prepare_eval_dataloader` repeated to even out the last round.

    `outputs`: a tensor whose dim 0 is the batch (predictions, labels, per-sample losses), or a
    tuple/list/dict of them. With the `loader` the batch came from, the result is exactly the
    evaluation set's samples of this round in dataset order; without one, a plain all-gather (no
    padding removed). Collective: every rank calls it for every batch."""
    if loader is not None and not isinstance(loader, EvalLoader):
        raise ConfigError(
            f"gather_for_metrics(..., loader) needs a loader from dptrain.prepare_eval_dataloader, got a "
            f"{type(loader).__name__}: only that one knows which samples of the last batch are repeats"
        )
    if loader is not None and loader.batch_index < 0:
        raise ConfigError("gather_for_metrics: the evaluation loader has not yielded a batch yet")
    if loader is not None:
        group = loader.group
    return _map(outputs, lambda t: _gather_one(t, loader, group))


def _gather_one(t: torch.Tensor, loader: EvalLoader | None, group: Any) -> torch.Tensor:
    if loader is None:
        return _gather(t, group)
    sampler, k = loader.eval_sampler, loader.batch_index
    size = sampler.batch_size_of(k)
    if t.dim() == 0 or t.shape[0] != size:
        raise ConfigError(
            f"gather_for_metrics: an output of shape {tuple(t.shape)} does not hold one row per sample of the batch "
            f"({size} samples); gather per-sample values (predictions, labels), not sums or means"
        )
    return _gather(t, group)[: sampler.real_in_round(k)]


def _map(obj: Any, fn: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_map(v, fn) for v in obj)
    raise ConfigError(f"gather_for_metrics: cannot gather a {type(obj).__name__}; pass tensors (or dicts/tuples)")


class MixedPrecision:
    """Autocast for the forward and loss scaling for the backward, by precision (`mixed_precision`).

    `with amp:` (or `with amp.autocast():`) around the forward; `amp.backward(loss)`; before
    clipping `amp.unscale_(optimizer)`; `amp.step(optimizer)` steps (skipped by an fp16 overflow) and
    updates the scale. `amp.scaler` is the GradScaler (enabled only for fp16; a Checkpointer saves it)."""

    def __init__(self, dtype: str, *, device: torch.device, sharded: bool) -> None:
        if dtype not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"mixed_precision({dtype!r}): valid precisions are 'fp32', 'bf16' and 'fp16'")
        self.dtype, self.device = dtype, device
        cfg = PrecisionConfig(dtype=dtype)
        self._autocast = autocast_factory(cfg, device)
        self.scaler = build_grad_scaler(cfg, device, sharded=sharded)  # ShardedGradScaler under FSDP2 fp16
        self._open: list[contextlib.AbstractContextManager[Any]] = []

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A fresh autocast context for one forward (nothing under fp32)."""
        return self._autocast()

    def __enter__(self) -> MixedPrecision:
        ctx = self._autocast()
        ctx.__enter__()
        self._open.append(ctx)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._open.pop().__exit__(et, ev, tb)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, scaled under fp16."""
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """The true gradients in place (call before clipping; once per step)."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.step()` (skipped when fp16 gradients overflowed) and the scale's update."""
        self.scaler.step(optimizer)
        self.scaler.update()


def mixed_precision(dtype: str = "fp32", *, device: torch.device | None = None, model: Any = None) -> MixedPrecision:
    """Autocast + loss scaling for `dtype` ("bf16", "fp16" or "fp32"), as `dptrain run`'s precision.dtype
    does it: bf16 autocast without scaling, fp16 autocast with dynamic loss scaling (a ShardedGradScaler
    when `model` is sharded by FSDP2), fp32 neither. `device`: where the forward runs (default: the
    model's, else the CPU)."""
    if device is None:
        param = next(iter(_module(model).parameters()), None) if model is not None else None
        device = param.device if param is not None else torch.device("cpu")
    sharded = model is not None and (model.sharded if isinstance(model, ParallelModel) else is_sharded(model))
    return MixedPrecision(dtype, device=device, sharded=sharded)


def _module(model: Any) -> nn.Module:
    return model.module if isinstance(model, ParallelModel) else model


def save_model(model: Any, path: str | os.PathLike[str]) -> Path:
    """Save the plain module's consolidated weights (the names of your own module, no wrapper): a
    `.safetensors` file, or else `torch.save` of the state dict, which `torch.load(path,
    weights_only=True)` and `module.load_state_dict` read back. Collective under FSDP2 (call on every
    rank); rank 0 writes. Unlike `torch.save(model)`, nothing of DDP or dptrain is pickled."""
    state = full_state_dict(model)
    out = Path(path)
    if collectives.rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".safetensors":
            save_safetensors(state, out)
        else:
            torch.save(state, out)
    collectives.barrier()
    return out
