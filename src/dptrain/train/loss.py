"""The default loss and how each micro-step's loss is normalised.

Two rules, chosen once per run from the loss function (and per step from the batch):

- **Token rule** (token-level losses: language models with ignored labels or variable lengths).
  It applies when the loss takes `num_items_in_batch` (see `takes_num_items`) and the step's
  batches are mappings with a `labels` tensor. Before the first backward of a step the trainer
  counts the valid targets (`labels != -100`) of all its micro-batches, sums that count over the
  data-parallel ranks in one small all-reduce that stays on the device, and passes
  `num_items_in_batch = global count / dp world size` to every micro-step's loss, which returns
  `sum of its token losses / num_items_in_batch`. DDP/FSDP average gradients over ranks, so the
  step's gradient is the gradient of the global batch's token mean, whatever the split of tokens
  over micro-batches and ranks. This is Hugging Face's loss-kwargs protocol (its Trainer counts
  `labels.ne(-100)` the same way, and its models accept `num_items_in_batch`).
- **Sample rule** (everything else: losses that return a per-sample mean and know nothing of
  tokens). Each micro-step's loss is divided by `grad_accum_steps`: the mean of equal-sized
  micro-batch means, which is the global batch's mean.

Counting rule: every position of `labels` that is not -100 counts, as given. A causal LM that
shifts labels inside (Hugging Face's `*ForCausalLM`) never scores the first label of a row: put
-100 there (or pass labels already aligned with the predictions, as dptrain's LLaMA does) for the
count to be exact; otherwise every micro-step is scaled by the same factor (1 - rows/tokens), and
the gradient's direction is still the global batch's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dptrain.config import ConfigError
from dptrain.distributed import collectives
from dptrain.models.lora import base_of

IGNORE_INDEX = -100

LossFn = Callable[..., torch.Tensor]
CountItems = Callable[[Sequence[Any]], "torch.Tensor | None"]
"""`items_per_rank` with its device and group bound: what the trainer hands `ParallelModel.forward_backward`."""


def forward_loss(model: nn.Module, batch: Any, *, num_items_in_batch: torch.Tensor | None = None) -> torch.Tensor:
    """The default loss: the model's forward returns the loss, or an object with `.loss`
    (Hugging Face models). A mapping batch is passed as keyword arguments, `model(**batch)`
    (`input_ids`, `labels`, `attention_mask`, ...); anything else as one argument, `model(batch)`.
    `num_items_in_batch` (token rule) is passed on as a keyword argument.
    nn.DataParallel gathers one loss per GPU: their mean is the batch mean for equal splits."""
    extra: dict[str, Any] = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    if isinstance(batch, Mapping) and _keeps_a_cache(model) and "use_cache" not in batch:
        # a training forward never reads the cache back; under activation checkpointing the recomputed forward would
        # append its keys and values to the same cache again (a shape error, or silently more memory)
        extra["use_cache"] = False
    out = model(**batch, **extra) if isinstance(batch, Mapping) else model(batch, **extra)
    loss = getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"the model's forward returned {type(out).__name__}, not a loss tensor; "
            "return the loss, an object with .loss, or set train.loss=pkg.mod:fn"
        )
    return check_scalar(loss, model=model, source="the model's forward")


def _keeps_a_cache(model: nn.Module) -> bool:
    """Whether `model` (wrapped by DDP or not; a PEFT model looks at its base) keeps a generation cache of keys and
    values by default: Hugging Face's `config.use_cache`."""
    plain = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    config = getattr(base_of(getattr(plain, "_orig_mod", plain)), "config", None)
    return bool(getattr(config, "use_cache", False))


def check_scalar(loss: torch.Tensor, *, model: nn.Module, source: str) -> torch.Tensor:
    """`loss` if it is one number; nn.DataParallel's one loss per GPU -> their mean (the batch mean
    for equal splits). Anything else is refused naming its shape: averaging a per-sample vector
    silently would hide a reduction the user forgot, and a sum would change the learning rate."""
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"{source} returned {type(loss).__name__} ({loss!r:.40}), not a loss tensor; return a scalar tensor"
        )
    if loss.ndim == 0:
        return loss
    if isinstance(model, nn.DataParallel) and loss.ndim == 1 and loss.numel() == len(model.device_ids or [None]):
        return loss.mean()
    raise ConfigError(
        f"{source} returned a loss of shape {tuple(loss.shape)}, not a scalar; return one number per batch "
        "(e.g. loss.mean() over the samples, or a sum divided by num_items_in_batch): "
        "dptrain does not reduce it for you"
    )


def takes_num_items(loss_fn: LossFn, model: nn.Module) -> bool:
    """Whether `loss_fn(model, batch, num_items_in_batch=n)` returns `sum of token losses / n`.

    For the default loss: the plain module says so with an `accepts_loss_kwargs` attribute, else
    its `forward` has a `num_items_in_batch` parameter, or `**kwargs` (Hugging Face's own test) and
    a source that passes them to a loss that uses them (see `_may_use_num_items`: not T5's).
    For a `train.loss` function: it has a parameter named `num_items_in_batch`. Never under
    nn.DataParallel, which would split the count over its replicas (the sample rule applies)."""
    if loss_fn is not forward_loss:
        return _has_param(loss_fn, "num_items_in_batch", var_keyword=False)
    if isinstance(model, nn.DataParallel):
        return False
    plain = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    plain = getattr(plain, "_orig_mod", plain)  # torch.compile's wrapper forwards *args, **kwargs
    plain = base_of(plain)  # a PEFT model passes its **kwargs on to the model it wraps: that one decides
    declared = getattr(plain, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    if _has_param(plain.forward, "num_items_in_batch", var_keyword=False):
        return True
    return _has_param(plain.forward, "num_items_in_batch", var_keyword=True) and _may_use_num_items(plain.forward)


def _may_use_num_items(forward: Callable[..., Any]) -> bool:
    """Whether a forward that takes `**kwargs` may pass `num_items_in_batch` on to its loss: its source
    names it or Hugging Face's `loss_function` (which takes it). Hugging Face's own test stops at
    `**kwargs`, which is wrong for models whose loss is a plain token mean that ignores it (T5, BART,
    BERT MLM): under the token rule such a loss would not be divided by the accumulation steps.
    Without source to read, `**kwargs` counts."""
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return True
    return "num_items_in_batch" in source or "loss_function" in source


def _has_param(fn: Callable[..., Any], name: str, *, var_keyword: bool) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(p.name == name or (var_keyword and p.kind is p.VAR_KEYWORD) for p in params)


def count_targets(batch: Any) -> torch.Tensor | None:
    """Valid targets (`labels != -100`) of a mapping batch with a `labels` tensor, as an int64
    tensor on the labels' device; None for any other batch (the sample rule applies)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor):
        return None
    return (labels != IGNORE_INDEX).sum()


def items_per_rank(
    micro_batches: Sequence[Any], *, device: torch.device, dp_world_size: int, group: Any = None
) -> torch.Tensor | None:
    """`num_items_in_batch` for one step: valid targets of the whole global batch (all micro-batches
    of all data-parallel ranks) divided by the data-parallel world size, as a float32 tensor on
    `device`; None unless every micro-batch is countable. One all-reduce over `group` (the
    data-parallel group; None = the world), no host-device sync. At least 1, so that a global batch
    without a valid target gives a zero loss, not 0/0."""
    counts = [count_targets(b) for b in micro_batches]
    if any(c is None for c in counts):
        return None
    total = torch.stack([c.to(device) for c in counts if c is not None]).sum()
    collectives.all_reduce_sum_(total, group=group)
    return total.clamp_min(1).float() / dp_world_size
