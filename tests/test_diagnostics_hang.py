"""Hang watchdog, end to end through `dptrain run` and torchrun: one rank sleeps forever."""

from __future__ import annotations

import re
import time

import pytest

from dptrain.diagnostics.watchdog import EXIT_HANG, find_suspects
from support.diag_helpers import TOY, processes_mentioning
from support.run_helpers import dptrain


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_that_sleeps_forever_is_named_with_every_rank_stack(tmp_path, strategy):
    out, mark = tmp_path / "run", tmp_path / "hang-started"
    timeout_s = 3.0
    r = dptrain("run", *TOY, "train.max_steps=1000", "train.loss=support.diag_helpers:sleepy_loss",
                f"parallel.strategy={strategy}", f"diagnostics.hang_timeout_s={timeout_s}",
                "--nproc-per-node", "2", "--out", str(out),
                env={"HANG_RANK": "1", "HANG_STEP": "3", "HANG_MARK": str(mark)})
    ended = time.time()
    assert r.returncode != 0, r.stdout[-2000:]
    # the launcher and rank 0 say where the (unauthenticated) store listens
    assert "standalone rendezvous on this node" in r.stdout and "unauthenticated" in r.stdout
    assert re.search(r"rendezvous store: [\w.-]+:\d+ \(torch.distributed's TCPStore is unauthenticated", r.stdout)
    assert f"exit {EXIT_HANG}" in r.stderr  # both ranks left through the watchdog, not a collective timeout
    report = (out / "hang_report.txt").read_text()
    assert "suspect rank(s): rank 1 (" in report, report
    assert "sleepy_loss" in report  # the sleeping rank's stack, in the report itself
    stacks = {rank: (out / "stacks" / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    assert "in sleepy_loss" in stacks[1] and "at step 3, phase forward" in stacks[1]
    # ddp: the other rank waits in backward's gradient reduction; fsdp: in forward's all-gather,
    # the same phase as the sleeper, which is then told apart by not being inside torch.distributed
    assert f"at step 3, phase {'backward' if strategy == 'ddp' else 'forward'}" in stacks[0]
    where = dict(re.findall(r"^\s+(\d+)\s+\S+\s+\d+\s+3\s+\w+.*\n\s+at (.+)$", report, re.M))
    assert re.search(r"torch/(distributed|autograd)/", where["0"]), report  # waiting for rank 1
    assert where["1"].endswith("in sleepy_loss"), report
    detected = (out / "hang_report.txt").stat().st_mtime - float(mark.read_text())
    print(
        f"\nhang detected {detected:.2f}s after the rank fell asleep; "
        f"job ended {ended - float(mark.read_text()):.2f}s after"
    )
    assert timeout_s <= detected < timeout_s + 4
    assert ended - float(mark.read_text()) < timeout_s + 10
    assert processes_mentioning(str(out)) == []  # no orphan worker


@pytest.mark.timeout(30)
def test_suspects_are_the_ranks_not_where_the_others_are():
    def at(step: int, seq: int) -> dict:
        return {"step": step, "seq": seq}

    # two ranks: no majority, the one behind is named (the other waits for it)
    assert find_suspects({0: at(3, 3), 1: at(3, 2)})[0] == [1]
    # a majority names the odd one out, even when it is ahead (it took another code path)
    assert find_suspects({0: at(5, 2), 1: at(5, 2), 2: at(5, 4), 3: at(5, 2)})[0] == [2]
    # a rank that sent nothing is always named
    suspects, why = find_suspects({0: at(5, 2), 1: None})
    assert suspects == [1] and "did not answer" in why
    # ... and so is one whose last heartbeat is known but which sent no stack (frozen holding the GIL)
    assert find_suspects({0: at(5, 3), 1: {**at(5, 4), "answered": False}})[0] == [1]
    # same point, but one rank is not inside torch.distributed/autograd: the others wait for it
    inside, outside = {"in_collective": True}, {"in_collective": False}
    suspects, why = find_suspects({0: {**at(5, 2), **inside}, 1: {**at(5, 2), **outside}, 2: {**at(5, 2), **inside}})
    assert suspects == [1] and "not inside torch.distributed" in why
    # everybody at the same point: nobody is singled out, the report says so
    suspects, why = find_suspects({0: at(5, 2), 1: at(5, 2)})
    assert suspects == [] and "same point" in why


@pytest.mark.timeout(120)
def test_a_rank_frozen_holding_the_gil_is_named_for_not_answering(tmp_path):
    out, mark = tmp_path / "run", tmp_path / "hang-started"
    r = dptrain(
        "run",
        *TOY,
        "train.max_steps=1000",
        "train.loss=support.diag_helpers:gil_holding_loss",
        "diagnostics.hang_timeout_s=2",
        "--nproc-per-node",
        "2",
        "--out",
        str(out),
        env={"HANG_RANK": "0", "HANG_STEP": "2", "HANG_MARK": str(mark)},
    )
    ended = time.time()
    assert r.returncode != 0
    report = (out / "hang_report.txt").read_text()
    assert "suspect rank(s): rank 0 " in report and "did not answer the alarm" in report, report
    assert "rank 1" not in report.splitlines()[2]  # only the frozen rank is a suspect
    assert (out / "stacks" / "rank1.txt").exists() and not (out / "stacks" / "rank0.txt").exists()
    print(f"\nfrozen rank named; job ended {ended - float(mark.read_text()):.2f}s after it froze")
    assert ended - float(mark.read_text()) < 2 + 15
    assert processes_mentioning(str(out)) == []
