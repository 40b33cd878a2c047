"""World-size-invariant, resumable data order.

The order of samples is defined once, globally, as a function of ``(seed, epoch)`` only;
each data-parallel rank then takes a contiguous slice of every global batch.  Hence the set
of samples in global step ``s`` does not depend on how many ranks there are or how many
micro-batches each accumulates, and a run saved at one world size can resume at another.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import Sampler

from dptrain.config.fields import RANK_SPLITS

__all__ = ["RANK_SPLITS", "GlobalBatchSampler"]



class GlobalBatchSampler(Sampler[list[int]]):
    """Batch sampler yielding this rank's micro-batches, forever, from ``start_step``.

    For epoch ``e`` the global order is ``torch.randperm(dataset_len)`` seeded with
    ``seed + e`` (``arange`` when ``shuffle=False``).  Each epoch has
    ``dataset_len // global_batch_size`` steps (the remainder is dropped).  Global step ``s``
    is batch ``s % steps_per_epoch`` of epoch ``s // steps_per_epoch``; rank ``r`` takes the
    contiguous ``[r*G/W, (r+1)*G/W)`` slice of it (``rank_split="interleaved"``: every W-th sample
    from position ``r``, as torch's DistributedSampler over the same order), and micro-step ``k``
    takes ``[k*mb, (k+1)*mb)`` of that share.  ``__iter__`` yields ``grad_accum_steps`` index lists
    per global step; use it as a DataLoader ``batch_sampler``.  It never ends: the trainer
    decides when to stop.
    """

    def __init__(
        self,
        *,
        dataset_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        start_step: int = 0,
        rank_split: str = "contiguous",
    ) -> None:
        super().__init__()
        if rank_split not in RANK_SPLITS:
            raise ValueError(f"rank_split={rank_split!r} is not valid; choose one of: {', '.join(RANK_SPLITS)}")
        self.rank_split = rank_split
        for name, v in (
            ("global_batch_size", global_batch_size),
            ("micro_batch_size", micro_batch_size),
            ("grad_accum_steps", grad_accum_steps),
            ("dp_world_size", dp_world_size),
        ):
            if int(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank must be in [0, {dp_world_size}), got {dp_rank}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        product = micro_batch_size * grad_accum_steps * dp_world_size
        if global_batch_size != product:
            raise ValueError(
                f"inconsistent batch sizes: global_batch_size ({global_batch_size}) != "
                f"micro_batch_size ({micro_batch_size}) * grad_accum_steps ({grad_accum_steps}) "
                f"* dp_world_size ({dp_world_size}) = {product}"
            )
        if dataset_len < global_batch_size:
            raise ValueError(
                f"dataset has {dataset_len} samples, fewer than one global batch of "
                f"{global_batch_size}; use a smaller batch (micro_batch_size, grad_accum_steps "
                f"or fewer data-parallel ranks) or more data"
            )
        self.dataset_len = int(dataset_len)
        self.global_batch_size = int(global_batch_size)
        self.micro_batch_size = int(micro_batch_size)
        self.grad_accum_steps = int(grad_accum_steps)
        self.dp_rank = int(dp_rank)
        self.dp_world_size = int(dp_world_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self._start_step = int(start_step)
        # Next global step not yet fully handed out by __iter__ (see state_dict).
        self._step = int(start_step)
        # One cached epoch permutation: iteration walks epochs in order, so one is enough.
        self._perm_epoch: int | None = None
        self._perm: torch.Tensor = torch.empty(0, dtype=torch.int64)

    @property
    def steps_per_epoch(self) -> int:
        """Global steps per epoch (``dataset_len // global_batch_size``)."""
        return self.dataset_len // self.global_batch_size

    @property
    def start_step(self) -> int:
        """Global step the next ``iter()`` starts from."""
        return self._start_step

    def epoch_of(self, step: int) -> int:
        """Epoch that global ``step`` belongs to."""
        return step // self.steps_per_epoch

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(self.dataset_len, generator=g)
            else:
                self._perm = torch.arange(self.dataset_len)
            self._perm_epoch = epoch
        return self._perm

    def global_batch_indices(self, step: int) -> list[int]:
        """All ``global_batch_size`` sample indices of global ``step`` (any world size)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, off = divmod(step, self.steps_per_epoch)
        g = self.global_batch_size
        # Keep the permutation as a tensor and convert only one batch: a whole-epoch Python
        # list would cost ~30x the memory for large datasets.
        return self._order(epoch)[off * g : (off + 1) * g].tolist()

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's ``grad_accum_steps`` micro-batches for global ``step``."""
        batch = self.global_batch_indices(step)
        if self.rank_split == "interleaved":  # DistributedSampler's share: every W-th sample from rank r on
            mine = batch[self.dp_rank :: self.dp_world_size]
        else:
            per_rank = self.global_batch_size // self.dp_world_size
            mine = batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        mb = self.micro_batch_size
        return [mine[k * mb : (k + 1) * mb] for k in range(self.grad_accum_steps)]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.iter_steps(itertools.count(self._start_step))  # the start step read at the first next()

    def iter_steps(self, steps: Iterable[int]) -> Iterator[list[int]]:
        """This rank's micro-batches of the global `steps`, in order (`__iter__`: from the start step, forever)."""
        self._step = self._start_step
        for step in steps:
            micro = self.micro_batches(step)
            last = len(micro) - 1
            for k, idx in enumerate(micro):
                if k == last:
                    # Count the step as handed out once its final micro-batch leaves.
                    self._step = step + 1
                yield idx

    def set_start_step(self, step: int) -> None:
        """Make the next ``iter()`` start at global ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._start_step = int(step)
        self._step = int(step)

    def state_dict(self, step: int | None = None) -> dict[str, int]:
        """Resumable position as a GLOBAL step (valid at any world size / accumulation).

        ``step`` defaults to the number of global steps ``__iter__`` has fully handed out.
        With DataLoader workers that count runs ahead of training (prefetching), so a
        trainer should pass the number of optimizer steps it has actually completed.
        """
        return {
            "step": int(self._step if step is None else step),
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """Resume from :meth:`state_dict` output, possibly saved at another world size."""
        for key in ("dataset_len", "global_batch_size"):
            if int(sd[key]) != getattr(self, key):
                raise ValueError(
                    f"cannot resume data order: checkpoint has {key}={sd[key]} but this run has "
                    f"{key}={getattr(self, key)}; the global sample order would differ. Keep the "
                    f"dataset and global batch size fixed when resuming (world size and "
                    f"gradient accumulation may change)."
                )
        saved_seed = int(sd.get("seed", self.seed))
        if saved_seed != self.seed:
            # Resuming means continuing the saved run's order, so its seed wins.
            warnings.warn(f"data seed {self.seed} overridden by checkpoint seed {saved_seed}", stacklevel=2)
            self.seed = saved_seed
            self._perm_epoch = None
        self.set_start_step(int(sd["step"]))

    def __repr__(self) -> str:
        return (
            f"GlobalBatchSampler(dataset_len={self.dataset_len}, global_batch_size="
            f"{self.global_batch_size}, micro_batch_size={self.micro_batch_size}, "
            f"grad_accum_steps={self.grad_accum_steps}, dp_rank={self.dp_rank}, "
            f"dp_world_size={self.dp_world_size}, seed={self.seed}, shuffle={self.shuffle}, "
            f"rank_split={self.rank_split!r}, "
            f"start_step={self._start_step})"
        )
