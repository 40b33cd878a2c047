"""Evaluation data sharded over the data-parallel ranks without dropping a sample.

Batches of `batch_size` in dataset order are dealt to the ranks round by round: in round k rank r
gets samples [k*W*B + r*B, k*W*B + (r+1)*B). The last round holds the R < W*B samples left; each
rank gets ceil(R/W) of them, the few (< W) places past the end repeat samples from the start of
the dataset. So every rank runs the same number of batches with the same sizes round by round
(collectives in an FSDP forward, or an all_gather, line up), and gathering round k over the ranks
in rank order gives samples k*W*B, ... in dataset order with the padding at the end of the last
round, where `EvalLoader.real_in_round` says how many are real (`dptrain.gather_for_metrics`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Sampler

__all__ = ["EvalBatchSampler", "EvalLoader"]


class EvalBatchSampler(Sampler[list[int]]):
    """This rank's evaluation batches (see the module doc). Every pass is the same."""

    def __init__(self, *, dataset_len: int, batch_size: int, rank: int, world_size: int) -> None:
        super().__init__()
        if dataset_len < 1:
            raise ValueError(f"the evaluation dataset is empty (len {dataset_len})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.dataset_len, self.batch_size, self.rank, self.world_size = dataset_len, batch_size, rank, world_size
        self.full_rounds, self.remainder = divmod(dataset_len, batch_size * world_size)
        self.last_size = -(-self.remainder // world_size)  # ceil(R / W): the last round's batch on every rank

    def __len__(self) -> int:
        return self.full_rounds + (1 if self.remainder else 0)

    def batch_size_of(self, k: int) -> int:
        """The size of every rank's batch in round `k`."""
        return self.batch_size if k < self.full_rounds else self.last_size

    def real_in_round(self, k: int) -> int:
        """Real (not padded) samples among round `k`'s gathered W x batch_size_of(k)."""
        return self.batch_size * self.world_size if k < self.full_rounds else self.remainder

    def __iter__(self) -> Iterator[list[int]]:
        w, b, r, n = self.world_size, self.batch_size, self.rank, self.dataset_len
        for k in range(self.full_rounds):
            start = k * w * b + r * b
            yield list(range(start, start + b))
        if self.remainder:
            start = self.full_rounds * w * b + r * self.last_size
            yield [(start + j) % n for j in range(self.last_size)]


class EvalLoader(DataLoader):
    """A DataLoader over an `EvalBatchSampler` that knows which round its last batch was in.
    `group`: the process group the ranks of the sampler form (None: every rank)."""

    def __init__(self, dataset: Any, *, batch_sampler: EvalBatchSampler, group: Any = None, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self.group = group
        self.batch_index = -1  # the round of the batch handed out last; -1 before the first

    @property
    def eval_sampler(self) -> EvalBatchSampler:
        sampler: EvalBatchSampler = self.batch_sampler  # type: ignore[assignment]
        return sampler

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self.batch_index = -1
        return self._counting(super().__iter__())

    def _counting(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self.batch_index += 1
            yield batch
