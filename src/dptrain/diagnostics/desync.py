"""Comparing the ranks' collective rings: where they diverge, and whether that is certainly a deadlock.

`find_desync(snapshots, wait_s=)` takes every rank's snapshot (diagnostics/collective_ring.py) and
returns the first point where the ranks disagree, or None. Three kinds, most certain first:

- "mismatch" (certain): the same collective of one group (same sequence number) has a different op,
  or different shapes or dtypes where every rank must pass the same (all_reduce, broadcast, ...): e.g.
  rank 0 in `barrier` #418 while rank 1 is in the backward's `all_reduce` #418.
- "cycle" (certain): ranks blocked in collectives that the others have not called and cannot reach
  (each waits inside a collective, none issued one for `wait_s`): e.g. two groups used in a different
  order on two ranks.
- "absent" (a warning, not certain): ranks wait `wait_s` or more in a collective that another rank has
  not called while that rank is outside any collective, or in one the flight recorder does not record
  (gloo's monitored_barrier). Legal when that rank is only late (evaluating alone, then rejoining).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from dptrain.distributed.collective_calls import DEFAULT_GROUP, Call, describe_call, fingerprint


@dataclass
class Desync:
    """Where the rings diverge: `kind` (mismatch, cycle, absent), whether it is certainly a deadlock or
    corruption, the ranks named, one summary line, and the ring lines around the divergence."""

    kind: str
    certain: bool
    ranks: list[int]
    summary: str
    details: list[str] = field(default_factory=list)
    key: tuple[str, int] = ("", 0)  # (group, sequence number) of the divergence
    found_by: str = ""  # how it was found, when not by a rank that waited (the check mode)


def _calls(snaps: dict[int, dict[str, Any]]) -> dict[int, list[Call]]:
    return {r: [Call(*c) for c in s.get("ring") or []] for r, s in snaps.items()}


def describe_position(s: dict[str, Any]) -> str:
    """Where a rank's main thread is: "checkpointer.py:279 in _all_here, called from train.py:40 (phase save)"."""
    blocked = s.get("blocked_in")
    how = ("in backward: gradient reduction, e.g. DDP's" if blocked == "backward"
           else f"in {blocked}" if blocked else "not in a collective")
    phase = f", phase {s['phase']}" if s.get("phase") and s.get("step") else ""  # step 0: no heartbeats
    label = f", last dptrain collective: {s['label']}" if s.get("label") else ""
    return f"{s.get('site') or s.get('where') or '?'} ({how}{phase}{label})"


def _oldest_pending(calls: list[Call]) -> Call | None:
    pending = [c for c in calls if not c.done and not c.p2p]
    return max(pending, key=lambda c: c.age_s) if pending else None


def _idle_s(calls: list[Call]) -> float:
    """Seconds since the rank issued its last collective (inf with an empty ring)."""
    return min((c.age_s for c in calls), default=float("inf"))


def _members(snaps: dict[int, dict[str, Any]], calls: dict[int, list[Call]], pg: str) -> set[int]:
    members = {r for s in snaps.values() for r in (s.get("groups") or {}).get(pg, [])}
    if not members:
        members = {r for r, cs in calls.items() if any(c.pg == pg for c in cs)}
        if pg == DEFAULT_GROUP:
            members |= set(snaps)
    return members


def find_desync(snaps: dict[int, dict[str, Any]], *, wait_s: float) -> Desync | None:
    """The first point where the ranks' rings disagree (see the module doc), or None when they agree."""
    calls = _calls(snaps)
    return _mismatch(snaps, calls) or _waits(snaps, calls, wait_s)


def _mismatch(snaps: dict[int, dict[str, Any]], calls: dict[int, list[Call]]) -> Desync | None:
    by_key: dict[tuple[str, int], dict[int, Call]] = collections.defaultdict(dict)
    for r, cs in calls.items():
        for c in cs:
            if not c.p2p:
                by_key[(c.pg, c.seq)][r] = c
    bad = [(k, v) for k, v in by_key.items() if len(v) > 1 and len({fingerprint(c) for c in v.values()}) > 1]
    if not bad:
        return None
    key, at = max(bad, key=lambda kv: max(c.age_s for c in kv[1].values()))  # the first one issued
    groups: dict[tuple[Any, ...], list[int]] = collections.defaultdict(list)
    for r, c in sorted(at.items()):
        groups[fingerprint(c)].append(r)
    sizes = sorted((len(v) for v in groups.values()), reverse=True)
    # the ranks outside the one biggest group of agreeing ranks; without one (two ranks): every rank involved
    odd = [r for v in groups.values() if len(v) < sizes[0] for r in v] if sizes[0] > sizes[1] else sorted(at)
    parts = []
    for r, c in sorted(at.items()):
        state = "called" if c.done else "is in"
        pending = _oldest_pending(calls[r])
        where = (f" at {describe_position(snaps[r])}" if pending is not None and pending[:2] == c[:2]
                 else f" at {c.site}" if c.site else "")  # a finished one: the line the flight recorder kept
        parts.append(f"rank {r} {state} {describe_call(c)}{where}")
    group = "" if key[0] == DEFAULT_GROUP else f" of group {key[0]}"
    summary = f"ranks disagree from collective #{key[1]}{group}: " + "; ".join(parts)
    return Desync("mismatch", True, sorted(odd), summary, _ring_lines(snaps, calls, key), key)


def _waits(snaps: dict[int, dict[str, Any]], calls: dict[int, list[Call]], wait_s: float) -> Desync | None:
    """Ranks waiting in a collective that another rank has not called: a cycle of blocked ranks (certain), or
    a rank outside the collective the others wait in (a warning)."""
    last: dict[int, dict[str, int]] = {r: {} for r in calls}
    for r, cs in calls.items():
        for c in cs:
            last[r][c.pg] = max(last[r].get(c.pg, 0), c.seq)
    waiting: dict[int, Call] = {}
    for r, cs in calls.items():
        p = _oldest_pending(cs)
        if p is not None and p.age_s >= wait_s:
            waiting[r] = p
    if not waiting and not any(s.get("p2p") for s in snaps.values()):
        return None
    waits_for = {r: sorted(q for q in _members(snaps, calls, p.pg) if q != r and q in snaps
                           and last[q].get(p.pg, 0) < p.seq) for r, p in waiting.items()}
    stuck = {r for r in waiting if snaps[r].get("in_collective") and _idle_s(calls[r]) >= wait_s}
    # a rank blocked in send/recv waits for its peer (not in the ring: gloo's point-to-point calls are not recorded)
    p2p = {r: s["p2p"] for r, s in snaps.items() if s.get("p2p") and s.get("in_collective") and r not in waiting
           and s["p2p"].get("peer") in snaps}
    graph = {r: [q for q in qs if q in stuck or q in p2p] for r, qs in waits_for.items() if r in stuck}
    graph.update({r: [w["peer"]] for r, w in p2p.items()})
    cycle = _find_cycle(graph)
    if cycle and not set(cycle) & stuck and min(_idle_s(calls[r]) for r in cycle) < wait_s:
        cycle = []  # only send/recv, not yet waited wait_s: the snapshots, taken at different times, may be stale
    if cycle:
        parts = [f"rank {r} is in {describe_call(waiting[r])} at {describe_position(snaps[r])}, which rank(s) "
                 f"{', '.join(map(str, waits_for[r]))} have not called" if r in waiting else _describe_p2p(r, snaps[r])
                 for r in cycle]
        summary = "ranks wait in collectives the others have not called and cannot reach: " + "; ".join(parts)
        first = waiting[next(r for r in cycle if r in waiting)] if set(cycle) & set(waiting) else None
        key = (first.pg, first.seq) if first is not None else ("p2p", 0)
        return Desync("cycle", True, sorted(cycle), summary, _ring_lines(snaps, calls, key), key)
    for r, p in sorted(waiting.items(), key=lambda kv: -kv[1].age_s):
        absent = [q for q in waits_for[r] if q not in stuck]
        if not absent:
            continue
        who = ", ".join(f"rank {q} is at {describe_position(snaps[q])}" for q in absent)
        waiters = sorted(w for w, c in waiting.items() if c[:2] == p[:2])
        # the rank(s) at fault first: a reader (and a log parser) takes the first rank a line names as its subject
        summary = (f"rank(s) {', '.join(map(str, absent))} have not called {describe_call(p)}, which rank(s) "
                   f"{', '.join(map(str, waiters))} wait in ({p.age_s:.0f}s so far, at {describe_position(snaps[r])}): "
                   f"{who}")
        return Desync("absent", False, absent, summary, _ring_lines(snaps, calls, (p.pg, p.seq)), (p.pg, p.seq))
    return None


def _describe_p2p(r: int, s: dict[str, Any]) -> str:
    w = s["p2p"]
    args = f" ({', '.join(str(x) for x in w.get('sizes') or [])} {w.get('dtype', '')})" if w.get("sizes") else ""
    frm, verb = ("from", "sent") if w["op"] == "recv" else ("to", "received")
    return (f"rank {r} is in {w['op']} {frm} rank {w['peer']}{args} at {describe_position(s)}, which rank "
            f"{w['peer']} has not {verb} (point-to-point: not in the flight recorder, read from the stack)")


def _find_cycle(graph: dict[int, list[int]]) -> list[int]:
    """Some cycle of `graph` (node -> nodes it waits for), as its nodes in order; [] when there is none."""
    state: dict[int, int] = {}  # 1: on the current path, 2: done
    path: list[int] = []

    def visit(n: int) -> list[int]:
        state[n] = 1
        path.append(n)
        for m in graph.get(n, []):
            if state.get(m) == 1:
                return path[path.index(m):]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        path.pop()
        return []

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return sorted(found)
    return []


def _ring_lines(snaps: dict[int, dict[str, Any]], calls: dict[int, list[Call]], key: tuple[str, int]) -> list[str]:
    """Each rank's ring around `key` (its group, two calls before to two after) and its main thread's position."""
    pg, seq = key
    lines = []
    for r in sorted(calls):
        near = [c for c in calls[r] if c.pg == pg and seq - 2 <= c.seq <= seq + 2]
        ring = "; ".join(f"{describe_call(c)} {'done' if c.done else f'waiting {c.age_s:.1f}s'}" for c in near)
        if not snaps[r].get("recorder", True):
            ring = "(flight recorder off: TORCH_FR_BUFFER_SIZE=0)"
        lines.append(f"rank {r}: {ring or '(no collective of this group near #' + str(seq) + ')'}")
        lines.append(f"        main thread at {describe_position(snaps[r])}")
    return lines
