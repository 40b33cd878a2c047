"""Length-grouped global batches under a token budget, the same at every world size, resumable.

For variable-length rows (fine-tuning, classification) a fixed number of rows per batch padded to the
longest row of the data set wastes most of the compute on padding. Here each epoch's global batches are
built from the row lengths alone, never from the world size:

1. the epoch's order is ``torch.randperm(n)`` seeded with ``seed + epoch`` (``arange`` without shuffle), as
   in :class:`~dptrain.data.sampler.GlobalBatchSampler`;
2. it is cut into mega-chunks of ``sort_window`` rows, and each chunk is sorted by length, longest first
   (ties: the order of step 1), as Hugging Face's ``LengthGroupedSampler`` does with its mega-batches;
3. walking the sorted rows, a global batch takes rows while ``longest row x rows <= max_tokens`` (the
   padded tokens of the batch), and at least ``min_rows`` rows; a batch that does not fill up at the end of
   a chunk takes rows from the next one; the epoch's last batch, when under ``min_rows`` rows, is dropped;
4. the batches are put in a seeded random order (so long and short batches alternate over the epoch).

Each global batch is then split into ``grad_accum_steps x dp_world_size`` micro-batches of contiguous rows
(longest first) so that the largest padded cost (``longest x rows``) of any micro-batch is as small as
possible; rank ``r`` takes micro-batches ``[r*A, (r+1)*A)``. Every micro-batch is then padded to its own
longest row by the collate function. The split is the only thing the world size changes: the rows of
global step ``s`` are the same at any world size, and with the token rule (``dptrain/train/loss.py``) so is
the step's gradient.

Epochs hold different numbers of batches (their count depends on the epoch's order); global step ``s``
maps to an epoch by the running sum of the epochs' counts, computed as far as needed.
"""

from __future__ import annotations

import hashlib
import itertools
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from dptrain.config import ConfigError

__all__ = ["TokenBudgetSampler", "balanced_split", "plan_epoch"]


def plan_epoch(lengths: np.ndarray, *, max_tokens: int, min_rows: int, sort_window: int, seed: int, epoch: int,
               shuffle: bool = True) -> list[np.ndarray]:
    """The global batches of one epoch (arrays of row indices, longest row first); see the module."""
    n = len(lengths)
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).numpy()
    else:
        order = np.arange(n)
    rows: list[np.ndarray] = []
    for a in range(0, n, sort_window):
        chunk = order[a : a + sort_window]
        # stable sort on -length: ties keep the shuffled order
        rows.append(chunk[np.argsort(-lengths[chunk], kind="stable")])
    flat = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
    batches: list[np.ndarray] = []
    start, longest = 0, 0
    for i in range(len(flat)):
        length = int(lengths[flat[i]])
        taken = i - start
        if taken >= min_rows and max(longest, length) * (taken + 1) > max_tokens:
            batches.append(flat[start:i])
            start, longest = i, 0
        longest = max(longest, length)
    if len(flat) - start >= min_rows:
        batches.append(flat[start:])
    if shuffle:
        g = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 0x6261])))
        batches = [batches[j] for j in g.permutation(len(batches))]
    # longest first inside each batch (the carried-over rows of a chunk may be shorter than the next chunk's)
    return [b[np.argsort(-lengths[b], kind="stable")] for b in batches]


def balanced_split(sorted_lengths: Sequence[int], parts: int) -> list[int]:
    """Cut points of `sorted_lengths` (longest first) into `parts` non-empty contiguous pieces minimising the
    largest padded cost ``piece[0] x len(piece)``. Returns ``parts + 1`` offsets (0 ... len)."""
    n = len(sorted_lengths)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} rows into {parts} non-empty micro-batches")

    def greedy(limit: int) -> list[int]:
        cuts, start = [0], 0
        for i in range(1, n + 1):
            if i == n:
                break
            if sorted_lengths[start] * (i + 1 - start) > limit:
                cuts.append(i)
                start = i
        return [*cuts, n]

    lo, hi = max(int(x) for x in sorted_lengths), int(sorted_lengths[0]) * n
    while lo < hi:  # the smallest limit whose greedy cut needs at most `parts` pieces
        mid = (lo + hi) // 2
        if len(greedy(mid)) - 1 <= parts:
            hi = mid
        else:
            lo = mid + 1
    cuts = greedy(lo)
    while len(cuts) - 1 < parts:  # more pieces: split the piece with the most rows (costs only go down)
        sizes = [cuts[j + 1] - cuts[j] for j in range(len(cuts) - 1)]
        j = int(np.argmax(sizes))
        cuts.insert(j + 1, cuts[j] + sizes[j] // 2)
    return cuts


class TokenBudgetSampler(Sampler[list[int]]):
    """Batch sampler: this rank's ``grad_accum_steps`` micro-batches per global step, forever, from ``start_step``
    (see the module). The same interface as :class:`~dptrain.data.sampler.GlobalBatchSampler`, so the Trainer
    and the checkpoint's data position use it unchanged."""

    def __init__(self, lengths: Sequence[int] | np.ndarray, *, max_tokens: int, min_rows: int = 8,
                 sort_window: int = 1024, grad_accum_steps: int = 1, dp_rank: int = 0, dp_world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, start_step: int = 0) -> None:
        super().__init__()
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or len(self.lengths) == 0 or int(self.lengths.min()) < 1:
            raise ValueError("lengths must be a non-empty list of positive row lengths")
        parts = int(grad_accum_steps) * int(dp_world_size)
        if int(min_rows) < parts:
            raise ConfigError(
                f"data.kwargs.min_rows={min_rows} is fewer than the micro-batches of one step (grad_accum_steps "
                f"{grad_accum_steps} x data-parallel ranks {dp_world_size} = {parts}); every micro-batch needs a row: "
                f"raise min_rows to at least {parts} (keep it when the world size changes: it shapes the batches)"
            )
        longest = int(self.lengths.max())
        if int(max_tokens) < longest * int(min_rows):
            raise ConfigError(
                f"data.kwargs.max_tokens={max_tokens} holds fewer than min_rows={min_rows} rows of the longest "
                f"({longest} tokens): raise max_tokens to at least {longest * int(min_rows)}, lower min_rows, or "
                "truncate rows (data.kwargs.seq_len)"
            )
        if int(sort_window) < 1:
            raise ConfigError(f"data.kwargs.sort_window must be >= 1, got {sort_window}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank must be in [0, {dp_world_size}), got {dp_rank}")
        self.max_tokens, self.min_rows, self.sort_window = int(max_tokens), int(min_rows), int(sort_window)
        self.grad_accum_steps, self.dp_rank = int(grad_accum_steps), int(dp_rank)
        self.dp_world_size = int(dp_world_size)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.dataset_len = len(self.lengths)
        self.lengths_sha256 = hashlib.sha256(self.lengths.tobytes()).hexdigest()
        self._counts: list[int] = []  # batches per epoch, computed in order as far as needed
        self._plan_epoch: int | None = None
        self._plan: list[np.ndarray] = []
        if start_step < 0:
            raise ValueError(f"step must be >= 0, got {start_step}")
        self._start_step = self._step = int(start_step)
        if self.epoch_batches(0) == 0:
            raise ConfigError(
                f"the {self.dataset_len} rows make no global batch of min_rows={self.min_rows}: lower min_rows or "
                "give more data"
            )

    # ------------------------------------------------------------- the plan
    def plan(self, epoch: int) -> list[np.ndarray]:
        if self._plan_epoch != epoch:
            self._plan = plan_epoch(self.lengths, max_tokens=self.max_tokens, min_rows=self.min_rows,
                                    sort_window=self.sort_window, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
            self._plan_epoch = epoch
        return self._plan

    def epoch_batches(self, epoch: int) -> int:
        """Global batches (steps) of `epoch`."""
        while len(self._counts) <= epoch:
            e = len(self._counts)
            self._counts.append(len(self.plan(e)))
        return self._counts[epoch]

    @property
    def steps_per_epoch(self) -> int:
        """Global steps of the first epoch (later epochs may hold a few batches more or fewer)."""
        return self.epoch_batches(0)

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, batch within it) of global `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch = 0
        while step >= self.epoch_batches(epoch):
            step -= self.epoch_batches(epoch)
            epoch += 1
        return epoch, step

    def epoch_of(self, step: int) -> int:
        return self.locate(step)[0]

    def global_batch_indices(self, step: int) -> list[int]:
        """The rows of global `step`, longest first (any world size)."""
        epoch, k = self.locate(step)
        return self.plan(epoch)[k].tolist()

    def rows_of_step(self, step: int) -> int:
        """Rows (samples) in global `step`, at any world size: what the log counts as samples trained."""
        epoch, k = self.locate(step)
        return len(self.plan(epoch)[k])

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's `grad_accum_steps` micro-batches of global `step`."""
        rows = self.global_batch_indices(step)
        parts = self.grad_accum_steps * self.dp_world_size
        cuts = balanced_split(self.lengths[rows].tolist(), parts)
        first = self.dp_rank * self.grad_accum_steps
        return [rows[cuts[j] : cuts[j + 1]] for j in range(first, first + self.grad_accum_steps)]

    # ------------------------------------------------------------- iteration and state (as GlobalBatchSampler)
    @property
    def start_step(self) -> int:
        return self._start_step

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.iter_steps(itertools.count(self._start_step))

    def iter_steps(self, steps: Iterable[int]) -> Iterator[list[int]]:
        self._step = self._start_step
        for step in steps:
            micro = self.micro_batches(step)
            for k, idx in enumerate(micro):
                if k == len(micro) - 1:
                    self._step = step + 1
                yield idx

    def set_start_step(self, step: int) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._start_step = self._step = int(step)

    def _shape(self) -> dict[str, Any]:
        return {"dataset_len": self.dataset_len, "max_tokens": self.max_tokens, "min_rows": self.min_rows,
                "sort_window": self.sort_window, "shuffle": self.shuffle, "lengths_sha256": self.lengths_sha256}

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The position as a GLOBAL step (valid at any world size), and what the batches are built from."""
        return {"step": int(self._step if step is None else step), "seed": self.seed, **self._shape()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for key, mine in self._shape().items():
            if key not in sd or sd[key] != mine:
                raise ValueError(
                    f"cannot resume data order: checkpoint has {key}={sd.get(key)!r} but this run has {key}={mine!r}; "
                    "the global batches would differ. Keep the data, max_tokens, min_rows and sort_window fixed when "
                    "resuming (world size and gradient accumulation may change)."
                )
        saved_seed = int(sd.get("seed", self.seed))
        if saved_seed != self.seed:
            warnings.warn(f"data seed {self.seed} overridden by checkpoint seed {saved_seed}", stacklevel=2)
            self.seed, self._counts, self._plan_epoch = saved_seed, [], None
        self.set_start_step(int(sd["step"]))

    def __repr__(self) -> str:
        return (f"TokenBudgetSampler(rows={self.dataset_len}, max_tokens={self.max_tokens}, min_rows={self.min_rows}, "
                f"sort_window={self.sort_window}, grad_accum_steps={self.grad_accum_steps}, dp_rank={self.dp_rank}, "
                f"dp_world_size={self.dp_world_size}, seed={self.seed}, start_step={self._start_step})")
