"""Non-finite policy: every rank skips the same step, or every rank stops, naming step and rank.

Each rank knows only its own loss; the gradient norm is already global (clipping reduces it
over all shards, and DDP's gradients are identical after the all-reduce). One all-reduce of
`world_size + 1` floats tells every rank which ranks' data gave a non-finite loss and whether
the norm is finite, so all ranks take the same decision. That and one device-to-host read are
the whole per-step cost; with `nonfinite=off` the guard does not exist.

Under fp16 loss scaling an infinite gradient norm is the scaler's business (it skips the step
and lowers the scale), so only the loss is checked there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def first_nonfinite_steps(first: int | None, *, device: torch.device, group: Any = None) -> dict[int, int]:
    """{global rank: its first non-finite step} over the ranks of `group` (default: every rank), from each rank's
    own `first` (None: all finite), on every rank of it: one all-reduce. Collective: every rank of the group calls
    it."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {} if first is None else {dist.get_rank() if dist.is_initialized() else 0: first}
    steps = torch.full((dist.get_world_size(group),), math.inf, device=device, dtype=torch.float64)
    if first is not None:
        steps[dist.get_rank(group)] = first
    dist.all_reduce(steps, op=dist.ReduceOp.MIN, group=group)
    return {dist.get_global_rank(group, i) if group is not None else i: int(v)
            for i, v in enumerate(steps.tolist()) if math.isfinite(v)}


def describe_origin(first: dict[int, int]) -> str:
    """', first from the data of rank(s) 1 at step 6; then rank(s) 0 (step 7)': the ranks that went non-finite
    first lead (the others follow once averaged gradients spread it); '' when none is known."""
    if not first:
        return ""
    s0 = min(first.values())
    origin = sorted(r for r, s in first.items() if s == s0)
    later = sorted((s, r) for r, s in first.items() if s != s0)
    then = f"; then {', '.join(f'rank {r} (step {s})' for s, r in later)}" if later else ""
    return f", first from the data of rank(s) {', '.join(map(str, origin))} at step {s0}{then}"


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient under nonfinite=error, or too many consecutive skips."""


class NonFiniteGuard:
    """Decides, identically on every rank, whether this step's update must be skipped."""

    def __init__(self, *, policy: str, max_consecutive: int, rank: int, world_size: int, device: torch.device,
                 check_grad_norm: bool, report: Callable[[str, dict[str, Any], str | None], None]) -> None:
        if policy not in ("skip", "error"):
            raise ValueError(f"NonFiniteGuard policy must be skip or error, got {policy!r}")
        self.policy, self.max_consecutive = policy, max_consecutive
        self.rank, self.world_size, self.device = rank, world_size, device
        self.check_grad_norm, self.report = check_grad_norm, report
        self.consecutive = 0
        self.skipped = 0

    def flags(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> tuple[list[int], bool]:
        """(ranks whose local loss is non-finite, whether the global gradient norm is non-finite)."""
        local = torch.zeros(self.world_size + 1, device=self.device)
        local[self.rank] = (~torch.isfinite(loss.detach().float())).float()
        if self.check_grad_norm and grad_norm is not None:
            local[-1] = (~torch.isfinite(grad_norm.detach().float())).float()
        if self.world_size > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        values = local.tolist()  # the one host-device sync this check adds
        return [r for r in range(self.world_size) if values[r] > 0], values[-1] > 0

    def skip_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """True when every rank must skip `optimizer.step()` for `step`; raises NonFiniteError to stop."""
        ranks, bad_norm = self.flags(loss, grad_norm)
        if not ranks and not bad_norm:
            self.consecutive = 0
            return False
        what = (f"non-finite loss from the data of rank(s) {', '.join(map(str, ranks))}" if ranks
                else "non-finite gradient norm (the loss was finite on every rank)")
        record = {"step": step, "ranks": ranks, "grad_norm_nonfinite": bad_norm}
        if self.policy == "error":
            self.report("nonfinite", {**record, "action": "stopped", "policy": "error"}, None)
            raise NonFiniteError(f"step {step}: {what}; stopping (diagnostics.nonfinite=error)")
        self.consecutive += 1
        self.skipped += 1
        self.report("nonfinite", {**record, "consecutive": self.consecutive, "action": "skipped"},
                    f"step {step}: skipped the update on every rank: {what}")
        if self.consecutive >= self.max_consecutive:
            self.report("nonfinite", {**record, "consecutive": self.consecutive, "action": "stopped",
                                      "policy": "skip"}, None)
            raise NonFiniteError(
                f"step {step}: {self.consecutive} consecutive steps skipped for non-finite values (last: {what}); "
                "stopping (diagnostics.max_consecutive_skips). Lower the learning rate, check the data of the "
                "named rank(s), or use bf16 instead of fp16"
            )
        return True
