"""Replica drift check: do all data-parallel replicas still hold bit-identical parameters?

The checksum of a parameter is the sum, in int64, of its elements' bit patterns (the tensor
viewed as int8/16/32/64 according to its element size). Integer addition is exact and
order-independent, so identical replicas always give identical checksums (no false positives,
whatever the reduction order or device), and changing any single element always changes the
sum. It is not a cryptographic hash: several changes could in principle cancel out.

Cost per check: one read of every parameter on its own device (an int64 copy of one parameter
at a time) and one `all_gather` of 8 bytes per parameter tensor.

Who is compared: the ranks of the mesh's replica group (its dp_replicate dimension), one
comparison per (dp_shard, tp, pp) coordinate. Under ddp/zero1 that is every data-parallel rank;
under HSDP the replicas of each shard (each rank checksums its local shard); zero2/fsdp over a
single shard group hold one copy of each shard, so there is nothing to compare and the check is off.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaDriftError(RuntimeError):
    """Data-parallel replicas disagree; the message names the parameter(s) and rank(s)."""


def param_checksums(module: nn.Module) -> tuple[list[str], torch.Tensor]:
    """(names, int64 tensor of one checksum per parameter) of `module`'s local parameters."""
    names, sums = [], []
    for name, p in module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor's shard on this rank
        bits = local.detach().reshape(-1).view(_INT_OF_SIZE[local.element_size()])
        names.append(name)
        sums.append(bits.sum(dtype=torch.int64))
    device = sums[0].device if sums else torch.device("cpu")
    return names, torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=device)


def odd_ranks(column: list[int]) -> list[int]:
    """Ranks whose value differs from the strict majority's, or from rank 0's when there is none."""
    value, n = collections.Counter(column).most_common(1)[0]
    ref = value if n * 2 > len(column) else column[0]
    return [r for r, v in enumerate(column) if v != ref]


def find_drift(names: list[str], table: list[list[int]]) -> list[tuple[str, list[int]]]:
    """(parameter, odd ranks) for every parameter whose checksum differs between ranks.
    `table[rank][i]` is rank's checksum of parameter i."""
    found = []
    for i, name in enumerate(names):
        column = [row[i] for row in table]
        if len(set(column)) > 1:
            found.append((name, odd_ranks(column)))
    return found


def check_replicas(module: nn.Module, *, step: int, group: Any = None) -> None:
    """Gather the checksums of every rank of `group` (default: every rank) and raise
    ReplicaDriftError (the same on every member) on a mismatch. Ranks are named globally."""
    names, local = param_checksums(module)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    drift = find_drift(names, [t.tolist() for t in gathered])
    if drift:
        global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        name, ranks = drift[0]
        more = f" ({len(drift)} of {len(names)} parameters differ: " + ", ".join(n for n, _ in drift[:5]) + \
            (", ..." if len(drift) > 5 else "") + ")"
        raise ReplicaDriftError(
            f"replica drift at step {step}: parameter {name!r} differs on rank(s) "
            f"{', '.join(str(global_ranks[r]) for r in ranks)} from the other replicas (ranks "
            f"{', '.join(map(str, global_ranks))}){more}. Replicas must stay bit-identical; look for code that "
            "changes weights on one rank only (rank-dependent updates, non-deterministic custom ops, a bad GPU)"
        )
