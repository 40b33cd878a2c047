"""One collective as the ranks' rings record it, and how two ranks' calls are compared and described.

Torch-free (standard library only), so that the launcher compares the failing ranks' records (launch/culprit.py)
without importing torch; diagnostics/collective_ring.py fills `Call`s from torch's flight recorder and
diagnostics/desync.py compares them.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Call(NamedTuple):
    """One collective of the ring, JSON-able as a list (`Call(*row)` reads it back)."""

    pg: str  # the process group's name: "0" is the default group; the same on every rank
    seq: int  # its sequence number in that group (1, 2, ...): one collective has the same number on every rank
    op: str  # "all_reduce", "barrier", "broadcast", ... (without the backend's "gloo:"/"nccl:")
    sizes: list[list[int]]
    dtypes: list[str]
    done: bool  # finished (retired) on this rank
    age_s: float  # seconds since this rank issued it
    p2p: bool = False  # send/recv: no group sequence number to compare
    site: str = ""  # the line that called it ("losses.py:81 in sync"), when read with `sites`


# Ops whose inputs have the same shapes and dtypes on every rank (gather/scatter/all_to_all and
# list all_gather/reduce_scatter may differ legally; only their op is compared).
SAME_INPUT_OPS = frozenset({
    "all_reduce", "allreduce", "broadcast", "reduce", "barrier", "_allgather_base", "all_gather_into_tensor",
    "_reduce_scatter_base", "reduce_scatter_tensor", "allreduce_coalesced", "all_reduce_coalesced",
})
DEFAULT_GROUP = "0"


def fingerprint(c: Call) -> tuple[Any, ...]:
    return (c.op, str(c.sizes), str(c.dtypes)) if c.op in SAME_INPUT_OPS else (c.op,)


def describe_call(c: Call) -> str:
    """"all_reduce #418 ([5] Float)", "barrier #418", with " on group 3" off the default group."""
    shapes = ", ".join(str(s) for s in c.sizes)
    types = "/".join(sorted(set(c.dtypes)))
    args = f" ({shapes} {types})" if c.sizes else ""
    group = "" if c.pg == DEFAULT_GROUP else f" on group {c.pg}"
    return f"{c.op} #{c.seq}{group}{args}"
