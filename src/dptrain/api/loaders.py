"""Data for an own loop: the training loader (epochs, world-size-invariant order, exact resume), the
evaluation loader (sharded, nothing dropped), the loops over them, and the check that catches a plain
DataLoader on several ranks (every rank would train on the whole data set)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from dptrain.api.setup import in_callers_words
from dptrain.api.step_check import watch
from dptrain.config import ConfigError, TrainConfig, resolve_batch
from dptrain.data import (
    EpochBatchSampler,
    EpochLoader,
    EvalBatchSampler,
    EvalLoader,
    GlobalBatchSampler,
    build_dataloader,
)
from dptrain.distributed import collectives
from dptrain.parallel import ParallelModel

BATCH_ARGS = ("global_batch_size", "micro_batch_size", "grad_accum_steps")


def prepare_dataloader(
    dataset: Any,
    *,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    grad_accum_steps: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    start_step: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Any = None,
    parallel: ParallelModel | None = None,
    rank_split: str = "contiguous",
) -> EpochLoader:
    """A DataLoader yielding this rank's micro-batches in the world-size-invariant global order
    (reshuffled every epoch from `seed + epoch`, no `set_epoch` needed).

    Epochs: `len(loader)` is this rank's micro-batches per epoch, `(len(dataset) // global_batch_size)
    x grad_accum_steps` (with accumulation, `grad_accum_steps` micro-batches make one optimizer step;
    the last `len(dataset) % global_batch_size` samples of each epoch's order are left out, so every
    step is a whole global batch). `for batch in loader` ends at the end of the epoch; the next
    `for` runs the next epoch. A loader resumed in the middle of an epoch (a `Checkpointer`, or
    `start_step`) finishes that epoch first. `loader.step` (optimizer steps consumed) and
    `loader.epoch` say where it is; `dptrain.epochs(loader, n)` and `dptrain.micro_steps(loader,
    max_steps=...)` loop over it.

    With accumulation, an `optimizer.step()` of any optimizer while the loader stands in the middle of
    an optimizer step (the loop steps on every micro-batch) is warned about once; the step is taken.

    Batch sizes follow global = micro * accum * data-parallel size; any one may be left out. The
    data-parallel rank and size come from `parallel`'s mesh when given, else every rank is one.

    `rank_split`: how each global batch is shared among the ranks: "contiguous" (rank r takes the r-th
    block) or "interleaved" (every W-th sample from position r: the samples torch's DistributedSampler
    gives rank r over the same order, so a ported DDP script whose model has BatchNorm sees the same
    per-rank batches as its original). Either way the global batch of a step is the same samples."""
    world = parallel.mesh.dp_size if parallel is not None else collectives.world_size()
    dp_rank = parallel.mesh.dp_rank if parallel is not None else collectives.rank()
    try:
        g, m, a = resolve_batch(
            TrainConfig(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                        grad_accum_steps=grad_accum_steps),
            dp_world_size=world,
        )
    except ConfigError as e:  # BatchSizeError stays one
        raise in_callers_words(e, "prepare_dataloader", "train", BATCH_ARGS) from None
    try:
        sampler = EpochBatchSampler(
            dataset_len=len(dataset),
            global_batch_size=g,
            micro_batch_size=m,
            grad_accum_steps=a,
            dp_rank=dp_rank,
            dp_world_size=world,
            seed=seed,
            shuffle=shuffle,
            start_step=start_step,
            rank_split=rank_split,
        )
    except ValueError as e:
        raise ConfigError(f"prepare_dataloader: {e}") from None
    loader = build_dataloader(
        dataset, sampler=sampler, num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_fn, seed=seed,
        loader_cls=EpochLoader,
    )
    assert isinstance(loader, EpochLoader)
    watch(loader)  # one warning if an optimizer steps in the middle of an accumulation (api/step_check.py)
    return loader


def prepare_eval_dataloader(
    dataset: Any,
    batch_size: int,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Any = None,
    parallel: ParallelModel | None = None,
) -> EvalLoader:
    """Evaluation data split over the data-parallel ranks in order, without dropping a sample: every
    rank runs the same number of batches (so FSDP's collectives line up); the last round repeats up to
    (ranks - 1) samples to even it out, and `dptrain.gather_for_metrics(outputs, loader)` drops them
    again. Gathering every batch and concatenating gives the outputs of the whole set in dataset order.
    `batch_size` is per rank."""
    world = parallel.mesh.dp_size if parallel is not None else collectives.world_size()
    rank = parallel.mesh.dp_rank if parallel is not None else collectives.rank()
    try:
        sampler = EvalBatchSampler(dataset_len=len(dataset), batch_size=batch_size, rank=rank, world_size=world)
    except ValueError as e:
        raise ConfigError(f"prepare_eval_dataloader: {e}") from None
    return EvalLoader(
        dataset,
        batch_sampler=sampler,
        group=parallel.mesh.dp_group if parallel is not None else None,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate_fn,
    )


def grad_accum_steps(loader: DataLoader) -> int:
    """Micro-batches per optimizer step of a loader made by `prepare_dataloader`."""
    return loader.batch_sampler.grad_accum_steps  # type: ignore[union-attr]


def micro_steps(loader: DataLoader, *, max_steps: int) -> Iterator[tuple[int, int, Any]]:
    """(step, micro, batch) until global step `max_steps`, from the loader's position (its start step,
    or where a resumed loader stands), across epoch ends."""
    sampler: GlobalBatchSampler = loader.batch_sampler  # type: ignore[assignment]
    accum = sampler.grad_accum_steps
    step = loader.step if isinstance(loader, EpochLoader) else sampler.start_step
    it = iter(loader)
    while step < max_steps:
        for micro in range(accum):
            try:
                batch = next(it)
            except StopIteration:  # an epoch ended (always at a step boundary): the next one begins
                it = iter(loader)
                batch = next(it)
            yield step, micro, batch
        step += 1


def epochs(loader: DataLoader, n: int) -> Iterator[int]:
    """The epochs left of `n`, for `for epoch in dptrain.epochs(loader, n): for batch in loader: ...`.

    With a loader from `prepare_dataloader` the epoch numbers come from its position: a resumed loader
    starts at its epoch (and finishes it), and a body that leaves the loader in the middle of an epoch
    (`break`) gets the same epoch again, continued. With a plain DataLoader: 0..n-1, calling its
    DistributedSampler's `set_epoch`; on several ranks without one it warns (see `check_loader`)."""
    if isinstance(loader, EpochLoader):
        while loader.epoch < n:
            before = loader.micro_batches_consumed
            yield loader.epoch
            if loader.micro_batches_consumed == before:
                raise RuntimeError(
                    f"dptrain.epochs: epoch {loader.epoch} did not iterate the loader (its position is unchanged); "
                    "loop `for batch in loader` inside `for epoch in dptrain.epochs(loader, n)`"
                )
        return
    check_loader(loader)
    sampler = distributed_sampler(loader)
    for epoch in range(n):
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield epoch


def distributed_sampler(loader: DataLoader) -> DistributedSampler | None:
    """The loader's DistributedSampler (as its sampler, or inside its batch sampler), if any."""
    for s in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(s, DistributedSampler):
            return s
    return None


def check_loader(loader: Any, *, strict: bool = False) -> str | None:
    """Catch a plain DataLoader that would give every rank the whole data set.

    On more than one rank, a DataLoader that is neither from `prepare_dataloader` /
    `prepare_eval_dataloader` nor over a DistributedSampler loads the same samples on every rank:
    each step trains on W copies of one batch. Returns the problem (None when the loader is fine)
    after warning about it, or raises ConfigError with `strict`."""
    if collectives.world_size() == 1 or not isinstance(loader, DataLoader):
        return None
    if isinstance(loader, EpochLoader | EvalLoader) or isinstance(loader.batch_sampler, GlobalBatchSampler):
        return None
    if distributed_sampler(loader) is not None:
        return None
    problem = (
        f"a plain DataLoader on {collectives.world_size()} ranks: every rank loads the whole data set, so each step "
        "trains on copies of the same batches. Use loader = dptrain.prepare_dataloader(dataset, "
        "global_batch_size=..., micro_batch_size=...) (or dptrain.prepare_eval_dataloader for evaluation), or a "
        "torch DistributedSampler"
    )
    if strict:
        raise ConfigError(problem)
    warnings.warn(f"dptrain: {problem}", stacklevel=3)
    return problem
