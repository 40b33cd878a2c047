"""The fault matrix (benchmarks/acceptance/fault_matrix.py): its verdicts on made-up output, and a cheap subset
run for real.

The verdict logic must be able to fail: a wrong expected rank, a victim named instead of the culprit, a name without
its op or place are each reported as not named right."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from support import ROOT, subprocess_env

sys.path.insert(0, str(ROOT / "benchmarks" / "acceptance"))

from faults.verdict import Event, Expect, claims, judge  # noqa: E402

T0 = 1000.0


def events(*lines: str, source: str = "stderr", start: float = T0 + 1, step: float = 0.1) -> list[Event]:
    return [Event(start + i * step, source, line) for i, line in enumerate(lines)]


TORCHRUN_REPORT = [  # rank 1 was SIGKILLed, torchrun's Root Cause names rank 0 (the whole-second tie)
    "dptrain: rank 0: lost a peer rank during step 4 (RuntimeError: Connection closed by peer)",
    "E1205 02:46:50.916000 8433 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) "
    "local_rank: 1 (pid: 8559) of binary: python",
    "============================================================",
    "dptrain.launch.worker FAILED",
    "------------------------------------------------------------",
    "Failures:",
    "[0]:",
    "  rank      : 1 (local_rank: 1)",
    "  exitcode  : -9 (pid: 8559)  (SIGKILL)",
    "------------------------------------------------------------",
    "Root Cause (first observed failure):",
    "[1]:",
    "  rank      : 0 (local_rank: 0)",
    "  exitcode  : 1 (pid: 8558) ",
    "============================================================",
    "dptrain: worker(s) failed: rank 0 (exit 1), rank 1 (exit -9)",
]
KILLED = dict(what=r"SIGKILL|signal 9|exit(?:code)?\s*:?\s*-9")


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_speakers_listings_and_other_failures_are_not_claims_the_root_cause_is():
    found = claims(events(*TORCHRUN_REPORT))
    assert [c.named for c in found] == [(0,)]  # only torchrun's Root Cause row
    assert "Root Cause: rank 0" in found[0].text
    lines = ["[rank0]:[E1205 02:49:44.5 ProcessGroupGloo.cpp:2901] [Rank 0]: Rank 1 failed to pass monitoredBarrier",
             "suspect rank(s): rank 1 (vm, pid 32049), rank 3 (vm, pid 32051) -- behind the others",
             "no progress for 3s (diagnostics.hang_timeout_s); detected by rank 0 at 2026-11-29 15:20:34",
             "dptrain watchdog: rank 0 (vm): no progress for 300.1s at step 4, phase forward",
             "dptrain: waiting 30s at the rendezvous h0:29611: this is node_rank 0; node_rank(s) 1 have not all joined"]
    assert [c.named for c in claims(events(*lines))] == [(1,), (1, 3)]
    assert [c.named for c in claims(events(*lines), kind="node")] == [(1,)]


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_a_victim_named_as_the_root_cause_is_not_named_right_and_a_wrong_expectation_fails():
    lines = events(*TORCHRUN_REPORT)
    victim_named = judge(lines, Expect(frozenset({1}), **KILLED), injected=T0)
    assert not victim_named.named_right and not victim_named.rank_right
    assert victim_named.cell() == "no: named rank 0"
    # the same lines judged against rank 0 as the culprit: right (what a wrong expectation would let through)
    assert judge(lines, Expect(frozenset({0}), **KILLED), injected=T0).named_right
    # lines that arrived before the fault are no name of it
    assert judge(lines, Expect(frozenset({0}), **KILLED), injected=T0 + 60).cell() == "no: nothing named"


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_a_name_needs_its_op_and_place_and_a_desync_needs_both_sides():
    report = events("dptrain hang report", "suspect rank(s): rank 1 (vm, pid 9) -- behind the others",
                    "      at .../faults/losses.py:51 in stuck_in_python", source="hang_report.txt", start=T0 + 300)
    stuck = Expect(frozenset({1}), what=r"forward|loss|sleep", where=r"stuck_in_python")
    v = judge(report, stuck, injected=T0)
    assert v.named_right and v.seconds == pytest.approx(300.1)
    assert not judge(report[:2], stuck, injected=T0).named_right  # the suspect line alone: no stack, no op
    assert judge(report[:2], stuck, injected=T0).cell() == "partly: rank right, no op/phase or stack or file:line"
    both = Expect(frozenset({0, 1}), what=r"all_gather[\s\S]*all_reduce", where=r"sync_metrics", rule="all")
    one_side = events("rank 1 is in all_gather, the others in all_reduce (sync_metrics)", start=T0 + 2)
    assert not judge(one_side, both, injected=T0).named_right
    two_sides = events("rank 0 is in all_gather (sync_metrics); rank 1 is in all_reduce (sync_metrics)", start=T0 + 2)
    assert judge(two_sides, both, injected=T0).named_right


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_a_wrong_name_read_first_is_reported():
    lines = [*events("Rank 0 failed to pass monitoredBarrier", start=T0 + 1),
             *events("error on rank 1: SIGKILL", start=T0 + 5)]
    v = judge(lines, Expect(frozenset({1}), **KILLED), injected=T0)
    assert v.named_right and v.wrong_first and v.seconds == pytest.approx(5)
    assert v.cell() == "yes (after a wrong name first: rank 0)"


@pytest.mark.timeout(230)
def test_the_harness_times_and_judges_a_kill_and_a_memory_exhaustion(tmp_path):
    from faults.cgroup import unavailable

    out = tmp_path / "matrix.json"
    oom = unavailable() is None  # the kernel's OOM killer, where this machine lets a rank make a memory cgroup
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "acceptance" / "fault_matrix.py"), "--only",
                        "kill,memory" + (",oom" if oom else ""),
                        "--seed", "3", "--deadline", "40", "--json", str(out), "--workdir", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=220, cwd=ROOT, env=subprocess_env(tests=False))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("| fault | named right | seconds to the name | what the user reads |"), r.stdout
    rows = {row["fault"]: row for row in json.loads(out.read_text())["rows"]}
    for row in rows.values():
        assert row["culprit"] == 1 and 3 <= row["step"] <= 6  # two ranks: the culprit is never rank 0
        assert row["injected_at"] is not None and not row["timed_out"] and row["exit_codes"][0] != 0, row
    memory = rows["memory"]  # an exception on the culprit: named with its error and the fault's own line
    assert memory["named_right"], memory
    assert 0 <= memory["seconds"] < 30 and "rank 1" in memory["reads"]
    assert memory["claim"]["named"][0] == 1
    # the kill's recorded lines, judged again against a deliberately wrong rank, are not named right
    kill = rows["kill"]
    lines = [Event(**e) for e in kill["lines"]]
    wrong = judge(lines, Expect(frozenset({0}), what=r".", where=None), injected=kill["injected_at"])
    right = judge(lines, Expect(frozenset({1}), what=r".", where=None), injected=kill["injected_at"])
    assert kill["first_claim"] is not None, kill["lines"][-20:]  # the user was told some rank
    assert wrong.rank_right != right.rank_right  # one rank is named first: the wrong expectation is not met
    assert right.rank_right == (kill["cell"].startswith(("yes", "partly")))
    for line in r.stdout.splitlines()[2:4]:
        assert line.count(" | ") == 3, line  # one row per fault, four cells
    if oom:  # SIGKILL from the kernel, told from a kill -9 by the cgroup's OOM-kill counter
        row = rows["oom"]
        assert row["named_right"] and row["claim"]["named"][0] == 1, row["cell"]
        assert any(re.match(r"dptrain: rank 1 \(pid \d+\) was killed by the kernel's OOM killer \(SIGKILL\): memory "
                            r"cgroup \S+ counted 1 OOM kill during the run", e["text"]) for e in row["lines"])


@pytest.mark.timeout(120)
def test_the_matrix_names_both_sides_of_a_shape_mismatch_that_gloo_aborts(tmp_path):
    """Two ranks all-reduce 4 and 6 floats: gloo aborts the receiving rank at once (SIGABRT); the launcher's last line
    names the rank whose shape differs (the drawn culprit, rank 1) with both shapes and lines, not the aborted rank."""
    out = tmp_path / "matrix.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "acceptance" / "fault_matrix.py"), "--only", "shape",
                        "--seed", "0", "--deadline", "60", "--json", str(out), "--workdir", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=110, cwd=ROOT, env=subprocess_env(tests=False))
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["culprit"] == 1 and not row["timed_out"], row
    texts = [e["text"] for e in row["lines"]]
    assert any("Received data size doesn't match expected size" in t for t in texts)  # gloo's abort: a real fault
    last = [t for t in texts if t.strip()][-1]
    assert re.match(r"dptrain: collective mismatch: rank 1 called all_reduce #\d+ \(\[6\] Float\) at losses\.py:\d+ "
                    r"in collective_shape_differs; rank 0 called all_reduce #\d+ \(\[4\] Float\) at losses\.py:\d+ in "
                    r"collective_shape_differs: rank 1 differs in its shapes from rank 0", last), texts[-30:]
    assert "Root Cause: rank 1" in " ".join(c.text for c in claims([Event(**e) for e in row["lines"]]))
    assert row["named_right"] and 0 <= row["seconds"] < 30, row["cell"]  # about 1 s; the bound allows a loaded CI
