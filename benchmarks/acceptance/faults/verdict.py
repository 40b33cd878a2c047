"""What the user read after a fault, and whether it named the culprit: the fault matrix's parsing and verdicts.

The harness (benchmarks/acceptance/fault_matrix.py) turns everything the user can read into `Event`s as they
arrive: every line of the launchers' stdout and stderr, and every line of a report file the run writes
(`RUN_DIR/*report*`).
`claims` picks the lines that *name* a rank or a node as the cause; `judge` compares them with the fault's
`Expect`ation. Torch-free, so the test of the harness can check it on made-up lines.

A claim is a line that names `rank N` (or `node_rank N`, `node N`) other than as its speaker: the `[rankN]:`
prefix torch puts on a worker's lines, `dptrain: rank N:`, `dptrain watchdog: rank N (host):` (each rank's own
line), `[Rank N]:`, `detected by rank N` and `this is node_rank N` say who speaks,
not who is at fault. torchrun's failure report names its "Root Cause" rank (a claim) and lists "Other Failures"
(not one); dptrain's `worker(s) failed: rank 0 (exit 1), rank 1 (exit -9)` lists every exit (not one either).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SPEAKERS = re.compile(
    r"^\[rank\d+\]:\s*|^dptrain: rank \d+:\s*|^dptrain watchdog: rank \d+ \([^)]*\):\s*|\[Rank \d+\]:\s*"
    r"|this is node_rank \d+;?\s*|detected by rank \d+",
    re.I,
)
LOG_HEADER = re.compile(r"^\[?[WEIC]\d{4} [\d:.]+ \d+ [^\]]+\]\s*")  # torch's glog/c10 prefix: W1205 02:47:26.58 ...]
RANK = re.compile(r"\branks?\s*(?:\(s\))?\s*:?\s*(\d+(?:\s*(?:,|and)\s*(?:rank\s*)?\d+)*)", re.I)
NODE = re.compile(r"\bnode_rank(?:\(s\))?\s*[=:]?\s*(\d+(?:\s*,\s*\d+)*)|\bnode (\d+)\b", re.I)
LISTING = re.compile(r"worker\(s\) failed:|^Failures:|^\s*\[\d+\]:\s*$")
WINDOW_S = 5.0
"""What a claim says is read together with the lines its own launcher printed, and the report files' lines, that
arrived from a second before it to this many seconds after it (a hang report's stacks, the traceback printed next to
the error): that is where its op, phase and file:line are looked for."""


@dataclass(frozen=True)
class Event:
    t: float
    """time.time() when the line arrived."""
    source: str
    """"stdout", "stderr", "node1:stderr", a report file's name, ..."""
    text: str


@dataclass(frozen=True)
class Expect:
    """Who must be named and with what. `culprits`: the ranks (or, with `kind="node"`, node ranks) at fault.
    `rule="first"`: a claim is right when the first rank it names is a culprit (a line may go on to name the
    victims); `rule="all"`: when it names every culprit (a desync between two ranks names both sides).
    `what`: the op or phase (regex), `where`: a stack frame or file:line of the fault (regex; None: none exists,
    e.g. for a process killed by a signal)."""

    culprits: frozenset[int]
    what: str
    where: str | None = None
    rule: str = "first"
    kind: str = "rank"


@dataclass(frozen=True)
class Claim:
    t: float
    source: str
    named: tuple[int, ...]
    text: str


@dataclass
class Verdict:
    named_right: bool
    rank_right: bool
    what_found: bool
    where_found: bool | None
    seconds: float | None
    """From the fault's injection to the first right claim (to the first claim if none was right)."""
    claim: Claim | None
    first_claim: Claim | None
    wrong_first: bool
    """A claim naming another rank came first (more than a second before the right one): the user read a wrong
    name first."""
    reads: str
    notes: list[str] = field(default_factory=list)

    def cell(self) -> str:
        """The table's "named right" cell."""
        if self.first_claim is None:
            return "no: nothing named"
        if not self.rank_right:
            return f"no: named {_names(self.first_claim.named)}"
        missing = [w for w, ok in (("op/phase", self.what_found), ("stack or file:line", self.where_found))
                   if ok is False]
        verdict = "yes" if not missing else f"partly: rank right, no {' or '.join(missing)}"
        if self.wrong_first and self.first_claim is not None:
            verdict += f" (after a wrong name first: {_names(self.first_claim.named)})"
        return verdict


def _names(ranks: tuple[int, ...]) -> str:
    return ", ".join(f"rank {r}" for r in ranks) or "nobody"


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def claims(events: list[Event], *, kind: str = "rank") -> list[Claim]:
    """Every line in `events` (in arrival order) that names a rank (or node) as the cause."""
    found: list[Claim] = []
    section: dict[str, str] = {}  # per source: inside torchrun's report, "root" or "others"
    for e in events:
        line = LOG_HEADER.sub("", e.text.strip())
        if "Root Cause (first observed failure)" in line:
            section[e.source] = "root"
            continue
        if line.startswith(("Failures:", "Other Failures:")):
            section[e.source] = "others"
            continue
        if line.startswith("====="):
            section.pop(e.source, None)
            continue
        torchrun_rank = re.match(r"^rank\s*:\s*(\d+)", line)
        if torchrun_rank:  # a `rank : N (local_rank: M)` row of torchrun's report
            if section.get(e.source) == "root" and kind == "rank":
                n = int(torchrun_rank.group(1))
                found.append(Claim(e.t, e.source, (n,), f"torchrun's failure report, Root Cause: rank {n}"))
            continue
        if LISTING.search(line):
            continue
        body = SPEAKERS.sub("", line)
        pattern = RANK if kind == "rank" else NODE
        named: list[int] = []
        for m in pattern.finditer(body):
            for n in _numbers(next(g for g in m.groups() if g is not None)):
                if n not in named:
                    named.append(n)
        if named:
            found.append(Claim(e.t, e.source, tuple(named), line))
    return found


def _right(claim: Claim, expect: Expect) -> bool:
    if expect.rule == "all":
        return expect.culprits <= set(claim.named)
    return claim.named[0] in expect.culprits


def _launcher(source: str) -> str | None:
    """Which launcher a line came from ("node1" for "node1:stderr", "" for one launcher); None for a report file."""
    if source.endswith(("stdout", "stderr")):
        return source.rpartition(":")[0]
    return None


def _context(events: list[Event], claim: Claim) -> str:
    """The claim's line with what its own launcher printed around it and the report files written then."""
    own = _launcher(claim.source)
    near = [e for e in events if claim.t - 1.0 <= e.t <= claim.t + WINDOW_S]
    return "\n".join(e.text for e in near if _launcher(e.source) in (own, None))


def judge(events: list[Event], expect: Expect, *, injected: float) -> Verdict:
    """The verdict on what arrived after the fault was injected (at `injected`, a time.time())."""
    after = [e for e in events if e.t >= injected - 0.05]
    found = claims(after, kind=expect.kind)
    if expect.kind == "node":  # a node's own launcher that says what went wrong names that node
        for e in after:
            node = re.match(r"node(\d+):", e.source)
            if node and re.search(expect.what, e.text, re.I):
                found.append(Claim(e.t, e.source, (int(node.group(1)),), e.text.strip()))
        found.sort(key=lambda c: c.t)
    first = found[0] if found else None
    right = [c for c in found if _right(c, expect)]
    if not right:
        return Verdict(False, False, False, None if expect.where is None else False,
                       None if first is None else first.t - injected, None, first, False,
                       reads=_with_report(after, first.text if first else last_words(after, expect.what)))
    best = None
    for c in right:  # the first right claim whose context also says the op and the place
        ctx = _context(after, c)
        what = re.search(expect.what, ctx, re.I) is not None
        where = None if expect.where is None else re.search(expect.where, ctx, re.I) is not None
        if best is None:
            best = (c, what, where)
        if what and where is not False:
            best = (c, what, where)
            break
    assert best is not None
    claim, what, where = best
    wrong_first = first is not None and not _right(first, expect) and claim.t - first.t > 1.0
    return Verdict(what and where is not False, True, what, where, claim.t - injected, claim, first, wrong_first,
                   reads=_with_report(after, claim.text))


def _with_report(events: list[Event], text: str) -> str:
    """`text`, after the verdict line of a report file (a hang report's `suspect rank(s): ...`) when it is another."""
    verdicts = [f"{e.source}: {e.text.strip()}" for e in events if _launcher(e.source) is None
                and re.match(r"suspect|verdict|culprit|ranks? disagree", e.text.strip(), re.I)]
    if not verdicts or verdicts[0].partition(": ")[2] in text:
        return text
    return f"{verdicts[0]}; {text}"


def last_words(events: list[Event], what: str) -> str:
    """With no claim: the first line about the fault (one that says its op or phase), else the last line a user
    would take for the outcome (a dptrain line, an error), else "(nothing)"."""
    lines = [LOG_HEADER.sub("", e.text.strip()) for e in events if e.text.strip()]
    about = [ln for ln in lines if re.search(what, ln, re.I) and not ln.startswith("File ")]
    if about:
        return about[0]
    for pattern in (r"^dptrain: (?!standalone|c10d rendezvous)", r"Error|error|FAILED|failed"):
        hits = [ln for ln in lines if re.search(pattern, ln)]
        if hits:
            return hits[-1]
    return "(nothing)"
