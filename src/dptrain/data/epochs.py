"""Epoch-bounded loading for own training loops (`dptrain.prepare_dataloader`).

The Trainer's `GlobalBatchSampler` never ends: `dptrain run` stops at `train.max_steps`. Scripts that
count epochs need a loader whose `for batch in loader` ends, whose `len()` is the epoch's length, and
whose position survives a checkpoint. `EpochBatchSampler` is the same global order (a function of
seed and epoch only, so world-size-invariant) cut at epoch ends; `EpochLoader` is a DataLoader that
counts the micro-batches it has handed to the loop, so its position is what the loop consumed (not
what worker prefetching fetched ahead).

- `len(loader)` = micro-batches per epoch on this rank = steps_per_epoch x grad_accum_steps
  (with gradient accumulation one optimizer step takes `grad_accum_steps` of them);
- each `iter(loader)` starts at the loader's position and ends at the end of that epoch: a fresh
  loader runs epoch 0, the next `iter()` epoch 1, ...; a loader resumed (or left by `break`) in the
  middle of an epoch finishes that epoch first, then goes on;
- the position counts whole optimizer steps (`loader.step`); `loader.epoch` is the epoch of the
  next batch. `state_dict()`/`load_state_dict()` carry it, as a global step, across world sizes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from .sampler import GlobalBatchSampler

__all__ = ["EpochBatchSampler", "EpochLoader"]


class EpochBatchSampler(GlobalBatchSampler):
    """`GlobalBatchSampler` whose iteration ends at the end of the epoch its start step is in."""

    def __len__(self) -> int:
        """This rank's micro-batches per epoch (steps per epoch x gradient accumulation steps)."""
        return self.steps_per_epoch * self.grad_accum_steps

    def __iter__(self) -> Iterator[list[int]]:
        start = self._start_step
        yield from self.iter_steps(range(start, (start // self.steps_per_epoch + 1) * self.steps_per_epoch))


class EpochLoader(DataLoader):
    """A DataLoader over an `EpochBatchSampler` that knows how far the loop has got (see the module doc)."""

    def __init__(self, dataset: Any, *, batch_sampler: EpochBatchSampler, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self._consumed = batch_sampler.start_step * batch_sampler.grad_accum_steps  # micro-batches handed out

    @property
    def epoch_sampler(self) -> EpochBatchSampler:
        """The batch sampler, typed."""
        sampler: EpochBatchSampler = self.batch_sampler  # type: ignore[assignment]
        return sampler

    @property
    def grad_accum_steps(self) -> int:
        return self.epoch_sampler.grad_accum_steps

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (`len(self)` is micro-batches: this x grad_accum_steps)."""
        return self.epoch_sampler.steps_per_epoch

    @property
    def global_batch_size(self) -> int:
        return self.epoch_sampler.global_batch_size

    @property
    def micro_batches_consumed(self) -> int:
        """Micro-batches handed to the loop since global step 0 (counting those of earlier runs resumed from)."""
        return self._consumed

    @property
    def step(self) -> int:
        """Whole optimizer steps (global batches) the loop has consumed: the data position."""
        return self._consumed // self.grad_accum_steps

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self.step // self.steps_per_epoch

    @property
    def at_step_boundary(self) -> bool:
        """No optimizer step is half consumed (every micro-batch of the last step was handed out)."""
        return self._consumed % self.grad_accum_steps == 0

    def set_step(self, step: int) -> None:
        """Move the position to global `step` (the next `iter()` starts there)."""
        self.epoch_sampler.set_start_step(step)
        self._consumed = int(step) * self.grad_accum_steps

    def state_dict(self) -> dict[str, int]:
        """The position as a global step plus what must match to resume (dataset length, global batch)."""
        return self.epoch_sampler.state_dict(step=self.step)

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """Resume at `sd`'s global step (saved at any world size); the dataset length and global
        batch size must match (ValueError naming them otherwise)."""
        self.epoch_sampler.load_state_dict(sd)
        self._consumed = int(sd["step"]) * self.grad_accum_steps

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # Start where the loop is (a `break` mid-step restarts that step from its first micro-batch).
        self.set_step(self.step)
        return self._counting(super().__iter__())

    def _counting(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._consumed += 1
            yield batch
