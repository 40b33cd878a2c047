"""Per-bucket hook state that survives DDP's bucket rebuild and a restart.

A DDP communication hook sees gradient *buckets*: flat buffers holding several parameters' gradients.
Stateful hooks (PowerSGD, onebit) keep one flat tensor per bucket index (error feedback, P/Q
memories). DDP lays its buckets out twice: at construction in the parameters' order, and once more
after the first iteration in the order gradients became ready. A run resumed at step k therefore
sees the constructor's layout at step k+1, while the uninterrupted run sees the rebuilt one, so a
flat per-bucket tensor saved at step k would be added to the wrong elements.

`BucketLayout` makes the saved state layout-free: it names each parameter by where it sat in the
first layout this process's hook saw (deterministic: a fresh DDP with the same model, bucket cap and
micro-step pattern sees the same one), splits flat per-bucket tensors into per-parameter pieces
under those names on save, and joins the pieces in the layout of the moment when the hook next
sees that bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Pieces = list[tuple[str, int]]
"""(parameter name, element count) of each piece of a flat per-bucket tensor, in its order."""


class BucketLayout:
    """Which parameters each bucket holds now, and a stable name for each parameter."""

    def __init__(self) -> None:
        self.params: dict[int, list[torch.Tensor]] = {}
        """bucket index -> its parameters in buffer order, as last seen by the hook."""
        self._names: dict[int, str] = {}  # id(parameter) -> "<first bucket index>.<position>"
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        """Per-parameter pieces (field -> name -> tensor), loaded or parked, not yet joined into a bucket."""

    def observe(self, bucket: dist.GradBucket, *, park: Callable[[], None] | None = None) -> list[str]:
        """Record `bucket`'s parameters (call at the start of every hook call); their names in order.
        When DDP has laid the bucket out anew (its rebuild after the first iteration), `park` runs
        first, while the old layouts are still recorded: it should `park` every flat tensor."""
        params, index = bucket.parameters(), bucket.index()
        old = self.params.get(index)
        if park is not None and old is not None and [id(p) for p in old] != [id(p) for p in params]:
            park()
        for pos, p in enumerate(params):
            self._names.setdefault(id(p), f"{index}.{pos}")
        self.params[index] = params
        if sum(p.numel() for p in params) != bucket.buffer().numel():
            raise RuntimeError(f"DDP bucket {index}: its buffer holds {bucket.buffer().numel()} elements, its "
                               f"parameters {sum(p.numel() for p in params)}; hook state cannot be split per parameter")
        return [self._names[id(p)] for p in params]

    def names(self, index: int) -> list[str]:
        """The stable names of bucket `index`'s parameters, in its current order."""
        return [self._names[id(p)] for p in self.params[index]]

    def element_pieces(self, index: int) -> Pieces:
        """Pieces of a tensor laid out like the bucket's buffer (one per parameter, all its elements)."""
        return list(zip(self.names(index), (p.numel() for p in self.params[index]), strict=True))

    def _split(self, field: str, flats: dict[int, torch.Tensor], pieces_of: Callable[[int], Pieces]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for index, flat in flats.items():
            offset = 0
            for name, n in pieces_of(index):
                out[name] = flat[offset:offset + n].detach().clone()
                offset += n
            if offset != flat.numel():
                raise RuntimeError(f"bucket {index}: {field} holds {flat.numel()} elements, its pieces {offset}")
        return out

    def export(self, field: str, flats: dict[int, torch.Tensor], pieces_of: Callable[[int], Pieces]) -> dict[str, Any]:
        """Flat per-bucket tensors -> {name: piece} (CPU copies, for a checkpoint), plus parked pieces."""
        pieces = {**self.pending.get(field, {}), **self._split(field, flats, pieces_of)}
        return {name: t.cpu() for name, t in pieces.items()}

    def park(self, field: str, flats: dict[int, torch.Tensor], pieces_of: Callable[[int], Pieces]) -> None:
        """Move flat per-bucket tensors (in the layouts recorded now) into `pending`, per parameter;
        `join` puts them back in whatever layout each bucket has when the hook next sees it."""
        self.pending.setdefault(field, {}).update(self._split(field, flats, pieces_of))
        flats.clear()

    def join(self, field: str, pieces: Pieces, like: torch.Tensor) -> torch.Tensor | None:
        """Take the loaded pieces named in `pieces` out of `pending` as one flat tensor (dtype and
        device of `like`); None when this field has nothing loaded for them. A partial or mis-sized
        match (another model or bucket cap than the checkpoint's) raises."""
        loaded = self.pending.get(field, {})
        found = [name for name, _ in pieces if name in loaded]
        if not found:
            return None
        bad = [name for name, n in pieces if name not in loaded or loaded[name].numel() != n]
        if bad:
            raise ValueError(f"the checkpoint's {field} state of the gradient compression does not fit this run's "
                             f"DDP buckets (parameter slots {bad[:4]}); resume with the run's own model and "
                             "parallel.bucket_cap_mb, or with parallel.grad_compression=none")
        parts = [loaded.pop(name).to(device=like.device, dtype=like.dtype) for name, _ in pieces]
        return torch.cat(parts) if parts else like.new_empty(0)

    def load(self, fields: dict[str, dict[str, torch.Tensor]]) -> None:
        """Keep loaded per-parameter pieces until the hook next sees each bucket."""
        self.pending = {field: dict(pieces) for field, pieces in fields.items()}
