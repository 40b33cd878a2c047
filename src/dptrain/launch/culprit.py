"""Which of the failed ranks torchrun reports caused the others to fail.

torchrun names as root cause the failure with the earliest timestamp, which its error files keep in whole seconds,
ties going to the lowest rank. When one rank raises, its peers fail within the same second in the collective that
rank left ("Connection closed by peer"), or are terminated by torchrun (SIGTERM), so rank 0 was named for rank 1's
error whenever a peer's own failure was observed first. Here a rank is a victim when its failure only says that a
peer went away; the root cause is the earliest failure that is not a victim's, then the earliest of all.

A collective called differently on the ranks (another shape, dtype or op at the same sequence number) is named from
the ranks' own records (diagnostics/collective_record.py: what each failing rank had unfinished, and where it called
it): `collective_mismatch`. gloo aborts the rank that *receives* data of another size, so without them the victim of
the abort was named."""

from __future__ import annotations

import collections
import contextlib
import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptrain.distributed.collective_calls import Call, describe_call, fingerprint
from dptrain.distributed.exit_marks import COLLECTIVE_RECORD_PREFIX

PEER_LOST_MARK = "lost peer"
"""The exit mark's reason (distributed/exit_marks.py) of a dptrain worker that stopped because another rank died."""

PEER_LOST_ERRORS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
    r"NCCL communicator was aborted|ProcessGroupNCCL.*(aborted|Watchdog caught collective)|"
    r"Socket Timeout|DistNetworkError|recvBytes|sendBytes|remote worker crashing",
    re.IGNORECASE,
)
"""What a rank's error reads when it failed only because a peer left the collective (gloo, NCCL, the TCP store): the
launcher never names such a rank as the root cause, and a dptrain worker says it in one line (launch/worker.py)."""


def message(failure: Any) -> str:
    """The failure's error text: the error file's message (a string, or torchelastic's dict form), else ''."""
    msg = getattr(failure, "message", "") or ""
    if isinstance(msg, dict):
        return str(msg.get("message", "")) + "\n" + str(msg.get("extraInfo", {}).get("py_callstack", ""))
    return str(msg)


def is_victim(failure: Any) -> bool:
    """The rank failed because another did: torchrun terminated it, or its error says that a peer went away."""
    if failure.exitcode == -signal.SIGTERM:
        return True
    return bool(PEER_LOST_ERRORS.search(message(failure)))


def root_cause(failures: dict[int, Any], *, victims: set[int] | frozenset[int] = frozenset()) -> int:
    """The rank whose failure caused the others' (module docstring); `victims`: ranks known to have stopped because
    another did (a dptrain worker's exit mark says so: PEER_LOST_MARK)."""
    causes = [rank for rank, f in failures.items() if rank not in victims and not is_victim(f)] or list(failures)
    return min(causes, key=lambda rank: (failures[rank].timestamp, rank))


def name_root_cause(error: Any, marks: dict[int, dict[str, Any]] | None = None, *,
                    cause: int | None = None) -> tuple[int, Any]:
    """Make torchrun's ChildFailedError report (format_msg's 'Root Cause') name `root_cause` (or `cause`, a rank
    known otherwise, e.g. by `collective_mismatch`); returns it. `marks`: the workers' exit marks (read_exit_marks)."""
    victims = {rank for rank, mark in (marks or {}).items() if mark.get("reason") == PEER_LOST_MARK}
    rank = cause if cause is not None and cause in error.failures else root_cause(error.failures, victims=victims)
    error.get_first_failure = lambda: (rank, error.failures[rank])
    return rank, error.failures[rank]


# ------------------------------------------------------------------------------------------ collective mismatch


def read_collective_records(folder: str | Path | None) -> dict[int, dict[str, Any]]:
    """{rank: record} of the failing ranks' records (diagnostics/collective_record.py) in the exit-marks folder."""
    out: dict[int, dict[str, Any]] = {}
    if folder is None or not Path(folder).is_dir():
        return out
    for p in Path(folder).glob(f"{COLLECTIVE_RECORD_PREFIX}*.json"):
        try:
            out[int(p.stem.removeprefix(COLLECTIVE_RECORD_PREFIX))] = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
    return out


def mismatch_in(folder: str | Path | None) -> Mismatch | None:
    """`collective_mismatch` of the records in the exit-marks folder (None too when they cannot be compared)."""
    try:
        return collective_mismatch(read_collective_records(folder))
    except Exception:  # a verdict's courtesy: torchrun's own report stands without it
        return None


@dataclass(frozen=True)
class Mismatch:
    """The ranks whose collective differs from the others' (the largest group of agreeing ranks, or rank 0's side
    when no group is largest), and the line that says who called what, how and where."""

    odd: list[int]
    line: str


def collective_mismatch(records: dict[int, dict[str, Any]]) -> Mismatch | None:
    """The first collective (group, sequence number) that the records show called with another op, shape or dtype
    on some rank, or None."""
    at: dict[tuple[str, int], dict[int, Call]] = collections.defaultdict(dict)
    for rank, rows in _rings(records).items():
        for row in rows:
            with contextlib.suppress(TypeError, ValueError):  # a record of another version
                call = Call(*row)
                if not call.p2p:
                    at[(call.pg, call.seq)][rank] = call
    for key, calls in sorted(at.items(), key=lambda kv: (kv[0][0] != "0", kv[0][1], kv[0][0])):
        sides: dict[tuple[Any, ...], list[int]] = collections.defaultdict(list)
        for rank, call in sorted(calls.items()):
            sides[fingerprint(call)].append(rank)
        if len(sides) > 1:
            return _mismatch(key, calls, list(sides.values()), records)
    return None


def _rings(records: dict[int, dict[str, Any]]) -> dict[int, list[list[Any]]]:
    """Each rank's last collectives: from its own record, else from the snapshot a rank the backend aborted asked it
    for just before it died (its "peers")."""
    rings = {rank: list(rec.get("calls") or []) for rank, rec in records.items()}
    for rec in records.values():
        for rank, snap in (rec.get("peers") or {}).items():
            with contextlib.suppress(ValueError):
                rings.setdefault(int(rank), list(snap.get("ring") or []))
    return rings


def _mismatch(key: tuple[str, int], calls: dict[int, Call], sides: list[list[int]],
              records: dict[int, dict[str, Any]]) -> Mismatch:
    sizes = sorted((len(s) for s in sides), reverse=True)
    base = (max(sides, key=len) if sizes[0] > sizes[1] else next(s for s in sides if min(calls) in s))
    odd = sorted(r for r in calls if r not in base)

    def side(ranks: list[int]) -> str:
        call = calls[ranks[0]]
        where = f" at {call.site}" if call.site else ""
        return f"{_ranks(ranks)} called {describe_call(call)}{where}"

    first, other = calls[odd[0]], calls[base[0]]
    what = ("op" if first.op != other.op else "shapes" if str(first.sizes) != str(other.sizes) else "dtypes")
    parts = [side(s) for s in sides if s is not base] + [side(base)]  # the odd ones first: the line's subject
    aborted = [r for r in sorted(calls) if str(records.get(r, {}).get("why", "")).startswith("aborted")
               and r not in odd]
    victims = ""
    if aborted:
        who = ", ".join(map(str, aborted))
        victims = (f"; rank{'s' if len(aborted) > 1 else ''} {who} only died of it (the backend aborts a rank that "
                   f"receives data of another size): not the cause")
    differs = "differs" if len(odd) == 1 else "differ"
    line = (f"collective mismatch: {'; '.join(parts)}: {_ranks(odd)} {differs} in its {what} from "
            f"{'the others' if sizes[0] > sizes[1] else _ranks(base)} at collective #{key[1]}"
            f"{'' if key[0] == '0' else ' of group ' + key[0]}{victims}")
    return Mismatch(odd, line)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
