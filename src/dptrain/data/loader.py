"""DataLoader construction around :class:`GlobalBatchSampler`, and data-factory helpers."""

from __future__ import annotations

import faulthandler
import functools
import os
import random
import signal
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from dptrain.config import ConfigError

from .sampler import GlobalBatchSampler
from .token_batches import TokenBudgetSampler

__all__ = ["build_dataloader", "split_train_val", "worker_seed"]


def _mix(*values: int) -> int:
    # SeedSequence mixes its inputs well, so nearby (rank, worker) pairs do not get
    # correlated streams the way seed + rank + worker_id would (nor collide).
    state = np.random.SeedSequence([int(v) for v in values]).generate_state(1, np.uint64)
    return int(state[0]) >> 1  # 63 bits: fits torch.manual_seed's int64


def worker_seed(seed: int, rank: int, worker_id: int) -> int:
    """Deterministic 63-bit seed for DataLoader worker ``worker_id`` of data-parallel ``rank``."""
    return _mix(seed, rank, worker_id)


LOADER_STACKS_ENV = "DPTRAIN_LOADER_STACKS"
"""A folder: each DataLoader worker writes its threads' stacks to FOLDER/loader-PID.txt on SIGUSR2 (set by the
diagnostics hub; read by diagnostics/loader_stacks.py when a rank waits for its workers)."""
_STACK_FILES: list[Any] = []  # kept open for the worker's life: faulthandler writes to them from a signal handler


def _seed_worker(worker_id: int, *, seed: int, rank: int) -> None:
    # Module-level function (wrapped in functools.partial) so it pickles under the spawn and
    # forkserver start methods as well as fork.
    s = worker_seed(seed, rank, worker_id)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    folder = os.environ.get(LOADER_STACKS_ENV)
    if folder and hasattr(signal, "SIGUSR2"):
        f = open(os.path.join(folder, f"loader-{os.getpid()}.txt"), "w")  # noqa: SIM115 - lives with the worker
        _STACK_FILES.append(f)
        faulthandler.register(signal.SIGUSR2, file=f, all_threads=True)


def build_dataloader(
    dataset: Dataset,
    *,
    sampler: GlobalBatchSampler | TokenBudgetSampler,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    seed: int = 0,
    persistent_workers: bool = True,
    prefetch_factor: int | None = None,
    loader_cls: type[DataLoader] = DataLoader,
) -> DataLoader:
    """A DataLoader yielding this rank's micro-batches in :class:`GlobalBatchSampler` order.

    Workers (if any) are seeded from ``(seed, sampler.dp_rank, worker_id)`` so any randomness
    inside ``__getitem__`` is reproducible; ``persistent_workers`` and ``prefetch_factor`` (None:
    the DataLoader's default) apply only with workers (``prefetch_factor`` without is an error).
    ``pin_memory`` is ignored when CUDA is unavailable (pinning needs a CUDA runtime and would only warn).
    ``loader_cls``: the DataLoader class to build (``EpochLoader`` for own loops' epoch-bounded loaders).
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if prefetch_factor is not None and num_workers == 0:
        raise ValueError(f"prefetch_factor={prefetch_factor} needs num_workers > 0 (got num_workers=0)")
    # Seeds the loader's own base seed (used by torch for worker RNG before our init fn runs);
    # two-value entropy keeps it distinct from every worker_seed.
    generator = torch.Generator().manual_seed(_mix(seed, sampler.dp_rank))
    kwargs: dict[str, Any] = {}
    if num_workers > 0:
        kwargs["worker_init_fn"] = functools.partial(_seed_worker, seed=seed, rank=sampler.dp_rank)
        # The sampler is infinite, so the loader is iterated once; persistent workers also
        # avoid re-forking (and re-mapping datasets) if the caller does restart iteration.
        kwargs["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    return loader_cls(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=bool(pin_memory) and torch.cuda.is_available(),
        collate_fn=collate_fn,
        generator=generator,
        **kwargs,
    )


def _dataset_like(obj: object) -> bool:
    return isinstance(obj, Dataset) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__"))


class DataFactoryError(ConfigError, TypeError):
    """A data factory returned something dptrain cannot train on (exit 2 before launch; a TypeError too)."""


def split_train_val(obj: object) -> tuple[Any, Any | None]:
    """Normalise a data factory's return value to ``(train, val_or_None)``.

    Accepts a map-style Dataset, a 2-element ``(train, val)`` tuple/list (``val`` may be ``None``),
    or a dict with ``"train"`` and optional ``"val"``. Anything else, an IterableDataset (the order
    that does not depend on the world size needs ``__len__`` and ``__getitem__``) and an empty
    validation split raise DataFactoryError naming what was returned.
    """
    if isinstance(obj, IterableDataset):
        obj = (obj, None)  # refused below, by name
    if isinstance(obj, dict):
        if "train" not in obj:
            raise DataFactoryError(f"data factory returned a dict without a 'train' key (keys: {sorted(obj)})")
        extra = set(obj) - {"train", "val"}
        if extra:
            raise DataFactoryError(f"data factory returned a dict with unexpected keys {sorted(extra)}")
        train, val = obj["train"], obj.get("val")
    elif isinstance(obj, (tuple, list)):
        if len(obj) != 2:
            raise DataFactoryError(
                f"data factory returned a {type(obj).__name__} of length {len(obj)}; expected (train, val)"
            )
        train, val = obj
    elif isinstance(obj, Dataset) and not isinstance(obj, IterableDataset):
        train, val = obj, None
    else:
        raise DataFactoryError(
            f"data factory returned {type(obj).__module__}.{type(obj).__qualname__}; expected a "
            f"Dataset, a (train, val) tuple/list, or a dict {{'train': ..., 'val': ...}}"
        )
    for name, split in (("train", train), ("val", val)):
        if isinstance(split, IterableDataset):
            raise DataFactoryError(
                f"the {name} split is an IterableDataset ({type(split).__qualname__}); dptrain's data order, the "
                "same at every world size and resumable mid-epoch, needs a map-style Dataset (__len__ and "
                "__getitem__)"
            )
    if not _dataset_like(train):
        raise DataFactoryError(f"train split is a {type(train).__qualname__}, not a Dataset")
    if val is not None and not _dataset_like(val):
        raise DataFactoryError(f"val split is a {type(val).__qualname__}, not a Dataset")
    if val is not None and len(val) == 0:
        raise DataFactoryError(
            "the validation split is empty; return it as None (no evaluation) or give it samples"
        )
    return train, val
