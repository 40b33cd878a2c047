"""Factories named by import path in the config: model, data, loss, collate. (`import_object` lives
in dptrain/config/imports.py and `to_device` in dptrain/parallel/model.py; both are re-exported
here, where configs and own loops found them before.)"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dptrain.config import Config, ConfigError, DataConfig, ModelConfig, Resolved, TrainConfig
from dptrain.config.datasource import FINETUNE_FACTORY, PACKED_FACTORY, resolve_data
from dptrain.config.imports import import_object
from dptrain.data import GlobalBatchSampler, build_dataloader
from dptrain.data.loader import split_train_val
from dptrain.models.chunked_loss import apply_chunked_loss
from dptrain.models.labels import labels_shifted_by, model_kind
from dptrain.models.lora import apply_lora
from dptrain.models.pretrained import find_source
from dptrain.parallel.materialize import (
    check_init_contract,
    converted_after_registration,
    provided_names,
    track_registrations,
)
from dptrain.parallel.model import to_device
from dptrain.train.loss import LossFn, check_scalar, forward_loss

__all__ = [
    "align_labels", "build_collate", "build_datasets", "build_loss_fn", "build_model", "build_model_meta",
    "chunk_the_loss", "import_object", "to_device",
]


def build_model(cfg: ModelConfig, *, seed: int) -> nn.Module:
    """Call the model factory under `seed`, so every rank starts from identical weights
    (FSDP2 does not broadcast parameters; DDP does, but then the seed costs nothing)."""
    torch.manual_seed(seed)
    return _call_factory(cfg)


def build_model_meta(cfg: ModelConfig, *, seed: int) -> tuple[nn.Module, str | None]:
    """Build the model on the meta device (no storage) for `dptrain.parallel.materialize` to
    initialise after sharding, bit-identical to `build_model(cfg, seed=seed)`. Returns
    `(model, None)`; or, when the factory cannot be built on meta or breaks the init contract
    (see `dptrain.parallel.materialize`), `(build_model(cfg, seed=seed), reason)`: an eager model
    as today, and a line for the console saying why. A meta build leaves the global RNG as it
    found it (`materialize` moves it to where eager construction leaves it); the fallback leaves
    it where `build_model` does.

    A model with pretrained weights (its factory attached a `PretrainedSource`: dptrain/models/pretrained.py)
    is always returned on meta, to be loaded after sharding; the checks above apply to the tensors the files do
    not hold (adapters added to it), and a failure is a ConfigError: such a model has no eager build."""
    before = torch.get_rng_state()
    torch.manual_seed(seed)
    seeded = torch.get_rng_state()
    reason: str | None
    try:
        with torch.device("meta"), track_registrations() as registered:
            model = _call_factory(cfg)
    except ConfigError:
        torch.set_rng_state(before)
        raise
    except Exception as e:  # noqa: BLE001 - any failure on meta means: build it as today
        reason = f"it raised {type(e).__name__}: {e}"
    else:
        skip = provided_names(model)
        reason = (_meta_problem(model, seeded=seeded, skip=skip)
                  or converted_after_registration(model, registered, skip=skip)
                  or check_init_contract(model, skip=skip))
        if reason is not None and find_source(model) is not None:
            torch.set_rng_state(before)
            raise ConfigError(
                f"model.factory {cfg.factory!r} starts from pretrained weights, but the parameters its files do not "
                f"hold cannot be initialised after sharding: {reason}"
            )
    torch.set_rng_state(before)
    if reason is None:
        return model, None
    model = build_model(cfg, seed=seed)  # a ConfigError here is the factory's own problem
    return model, (f"model.factory {cfg.factory!r} cannot be initialised on the meta device ({reason}); "
                   "built it eagerly on every rank instead")


def _meta_problem(model: nn.Module, *, seeded: torch.Tensor, skip: frozenset[str] = frozenset()) -> str | None:
    """Why a model just built under `torch.device("meta")` cannot be replayed exactly, or None. `skip`: the
    names of tensors that come from elsewhere (pretrained files, buffers computed for real)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_meta and name not in skip:
            return f"{name!r} was created on {t.device}, not on meta"
    if not torch.equal(torch.get_rng_state(), seeded):
        return "its construction drew from the CPU random generator outside the init hooks"
    return None


def _call_factory(cfg: ModelConfig) -> nn.Module:
    factory = import_object(cfg.factory)
    try:
        model = factory(**cfg.kwargs)
    except TypeError as e:
        raise ConfigError(f"model.factory {cfg.factory!r} rejected model.kwargs {cfg.kwargs}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory {cfg.factory!r} returned {type(model).__name__}, not an nn.Module")
    if cfg.lora.enabled:  # on the meta device too: materialize replays peft's adapter init (models/lora.py)
        model = apply_lora(model, cfg.lora)
    return model


def build_datasets(cfg: DataConfig) -> tuple[Any, Any | None]:
    """(train, val or None) from the data factory (`data.source` picks it: dptrain/config/datasource.py)."""
    cfg = resolve_data(cfg)
    factory = import_object(cfg.factory)
    try:
        out = factory(**cfg.kwargs)
    except TypeError as e:
        raise ConfigError(f"data.factory {cfg.factory!r} rejected data.kwargs {cfg.kwargs}: {e}") from None
    return split_train_val(out)


def align_labels(cfg: DataConfig, model: nn.Module) -> DataConfig:
    """`cfg` (``data.source`` resolved) giving `model` the labels it expects (dptrain/models/labels.py).

    The fine-tuning rows (``dptrain.data.finetune:build_finetune``): ``data.kwargs.shift`` follows the model when
    not given (``false`` for a transformers causal LM, which shifts its labels itself; ``true`` for the built-in
    LLaMA), and a ``shift`` that contradicts it is refused. Packed rows (labels always aligned with the
    predictions) are refused for a model that shifts its labels itself. Other data factories, and models that
    do not say (``labels_shifted_by`` is None), are left as they are. ConfigError naming the setting, the
    model's class and what to set instead: shifted twice, or not at all, the loss still falls and nothing
    fails, but every token learns to predict the one two places ahead (or itself)."""
    cfg = resolve_data(cfg)
    by_model = labels_shifted_by(model)
    if by_model is None:
        return cfg
    kind = model_kind(model)
    if cfg.factory == PACKED_FACTORY and by_model:
        raise ConfigError(
            f"data.factory={PACKED_FACTORY} gives labels already shifted (labels = the next tokens), but {kind} "
            "shifts its labels itself: every token would learn to predict the one two places ahead. Packed rows "
            "train the built-in LLaMA (model.factory=dptrain.models.llama:build_llama); for this model use a "
            "JSON-lines file (data.source=FILE.jsonl), whose labels follow the model"
        )
    if cfg.factory != FINETUNE_FACTORY:
        return cfg
    want = not by_model  # the data shifts exactly when the model does not
    given = cfg.kwargs.get("shift")
    if given is None:
        return dataclasses.replace(cfg, kwargs={**cfg.kwargs, "shift": want})
    if bool(given) != want:
        why = ("shifts its labels itself (it takes labels equal to input_ids): shifted labels would train every "
               "token to predict the one two places ahead" if by_model else
               "takes labels aligned with its predictions: unshifted labels would train every token to predict "
               "itself")
        raise ConfigError(
            f"data.kwargs.shift={str(bool(given)).lower()} contradicts the model: {kind} {why}; remove "
            f"data.kwargs.shift (it follows the model) or set data.kwargs.shift={str(want).lower()}"
        )
    return cfg


def build_collate(cfg: DataConfig) -> Callable[[list[Any]], Any] | None:
    """`data.collate`, with `data.collate_kwargs` bound (functools.partial), or None (torch's default_collate)."""
    if cfg.collate is None:
        return None
    fn = import_object(cfg.collate)
    return functools.partial(fn, **cfg.collate_kwargs) if cfg.collate_kwargs else fn


def build_loss_fn(spec: str | None) -> LossFn:
    """`fn(model, batch) -> scalar loss`: the configured one, or `dptrain.train.loss.forward_loss` (the
    model's own forward). How each micro-step's loss is normalised: `dptrain.train.loss`."""
    if spec is None:
        return forward_loss
    fn = import_object(spec)

    @functools.wraps(fn)  # keeps the signature: `takes_num_items` reads it
    def checked(model: nn.Module, batch: Any, **kwargs: Any) -> torch.Tensor:
        return check_scalar(fn(model, batch, **kwargs), model=model, source=f"train.loss={spec!r}")

    return checked


@dataclasses.dataclass
class TrainData:
    """What the trainer reads its batches from: the datasets, the collate, the batch order, the DataLoader."""

    train_ds: Any
    val_ds: Any | None
    collate: Callable[[list[Any]], Any] | None
    sampler: Any
    loader: Any


def build_train_data(cfg: Config, res: Resolved, *, dp_rank: int, dp_size: int, device: torch.device,
                     start_step: int) -> TrainData:
    """The datasets of `data.*`, the world-size-invariant batch order of this data-parallel rank from `start_step`
    (a dataset's own batch sampler, e.g. fine-tuning rows under a token budget, else fixed-size global batches), and
    the DataLoader over it."""
    train_ds, val_ds = build_datasets(cfg.data)
    # data.collate (+ collate_kwargs: a partial), else the dataset's own (packed rows: one storage per batch),
    # else None (torch's default)
    collate = build_collate(cfg.data) or getattr(train_ds, "collate", None)
    order: dict[str, Any] = {
        "global_batch_size": res.global_batch_size,
        "micro_batch_size": res.micro_batch_size,
        "grad_accum_steps": res.grad_accum_steps,
        "dp_rank": dp_rank,
        "dp_world_size": dp_size,
        "seed": cfg.train.seed,
        "shuffle": cfg.data.shuffle,
        "start_step": start_step,
    }
    own = getattr(train_ds, "make_batch_sampler", None)
    if own is not None and cfg.data.rank_split != "contiguous":
        raise ConfigError(f"data.rank_split={cfg.data.rank_split!r} applies to fixed-size global batches; this "
                          f"dataset ({type(train_ds).__name__}) brings its own batches: leave it contiguous")
    sampler = (own(**order) if own is not None else
               GlobalBatchSampler(dataset_len=len(train_ds), rank_split=cfg.data.rank_split, **order))
    loader = build_dataloader(
        train_ds,
        sampler=sampler,
        num_workers=cfg.data.num_workers,
        pin_memory=cfg.data.pin_memory and device.type == "cuda",
        collate_fn=collate,
        seed=cfg.train.seed,
        persistent_workers=cfg.data.persistent_workers,
        prefetch_factor=cfg.data.prefetch_factor,
    )
    return TrainData(train_ds=train_ds, val_ds=val_ds, collate=collate, sampler=sampler, loader=loader)


def chunk_the_loss(model: nn.Module, *, train: TrainConfig, tp: int, pp: int) -> str | None:
    """Switch `model`'s training loss to the chunked one (`train.loss_chunk_tokens`, dptrain/models/chunked_loss.py)
    where it applies: the default loss, no tensor or pipeline parallelism, a model it knows. Returns a line to
    say when the user set a chunk size and it does not apply, else None."""
    asked = train.loss_chunk_tokens
    if asked == 0:
        return None
    problem: str | None
    if train.loss is not None:
        problem = f"train.loss={train.loss!r} computes the loss itself"
    elif tp > 1 or pp > 1:
        problem = "tensor and pipeline parallelism keep the model's own loss"
    else:
        problem = apply_chunked_loss(model, chunk_tokens=asked)
    if problem is None or asked is None:
        return None
    return f"train.loss_chunk_tokens={asked} does not apply: {problem}; the loss is computed over the whole logits"
