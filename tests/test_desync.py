"""Collective desync at run time: the ranks' flight-recorder rings compared, verdicts in seconds.

Real 2-rank gloo groups (the fork harness) run own loops under `dptrain.monitor` at default settings
(diagnostics.desync_after_s=5); the `dptrain launch` shim is run as a subprocess. Each real test
measures the seconds from the fault (a mark file written just before the divergent call) to the verdict
and prints them (`pytest -s` shows them).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dptrain
from dptrain.diagnostics import collective_ring, desync_watch
from dptrain.diagnostics.collective_ring import Call
from dptrain.diagnostics.desync import find_desync
from dptrain.diagnostics.watchdog import EXIT_HANG
from support.mp import RankError, in_group, run_ranks
from support.run_helpers import dptrain as dptrain_cli

HERE = Path(__file__).name


def _line(marker: str, path: Path = Path(__file__)) -> int:
    """The line number of the one line of `path` that ends with `# <marker>`."""
    (n,) = [i for i, text in enumerate(path.read_text().splitlines(), 1) if text.rstrip().endswith(f"# {marker}")]
    return n


def _snap(rank: int, calls: list[Call], *, in_collective: bool = True, site: str = "train.py:10 in main",
          blocked: str | None = "all_reduce") -> dict:
    return {"rank": rank, "ring": [list(c) for c in calls], "groups": {"0": [0, 1], "1": [0, 1]}, "site": site,
            "blocked_in": blocked, "in_collective": in_collective, "phase": "train", "recorder": True}


def _c(seq: int, op: str = "all_reduce", *, pg: str = "0", sizes: list | None = None, done: bool = True,
       age: float = 10.0, dtype: str = "Float") -> Call:
    sizes = [[5]] if sizes is None else sizes
    return Call(pg, seq, op, sizes, [dtype] * len(sizes), done, age)


# ---------------------------------------------------------------------------------------- the comparison
@pytest.mark.timeout(30)
def test_a_different_op_at_the_same_collective_is_a_certain_mismatch_naming_both_ranks_ops_and_lines():
    r0 = _snap(0, [_c(1), _c(2, "barrier", sizes=[], done=False, age=6)], site="ckpt.py:3 in save, called from "
               "train.py:312", blocked="barrier")
    r1 = _snap(1, [_c(1), _c(2, done=False, age=6)], site="train.py:30 in main", blocked="backward")
    found = find_desync({0: r0, 1: r1}, wait_s=5)
    assert found is not None and found.certain and found.kind == "mismatch" and found.ranks == [0, 1]
    assert found.key == ("0", 2)
    assert "ranks disagree from collective #2" in found.summary
    assert "rank 0 is in barrier #2 at ckpt.py:3 in save, called from train.py:312 (in barrier" in found.summary
    assert "rank 1 is in all_reduce #2 ([5] Float) at train.py:30 in main (in backward" in found.summary
    # the first divergence is named even while the ranks wait somewhere later
    r0 = _snap(0, [_c(1, "broadcast", sizes=[[3]]), _c(2, done=False)])
    r1 = _snap(1, [_c(1, "broadcast", sizes=[[5]]), _c(2, done=False)])
    found = find_desync({0: r0, 1: r1}, wait_s=5)
    assert found is not None and found.key == ("0", 1) and "rank 0 called broadcast #1 ([3] Float)" in found.summary
    # dtype alone differs: a mismatch too; ops whose inputs may differ (gather) compare the op only
    assert find_desync({0: _snap(0, [_c(1)]), 1: _snap(1, [_c(1, dtype="Long")])}, wait_s=5) is not None
    assert find_desync({0: _snap(0, [_c(1, "gather", sizes=[[2]])]),
                        1: _snap(1, [_c(1, "gather", sizes=[[2], [2]])])}, wait_s=5) is None


@pytest.mark.timeout(30)
def test_three_ranks_name_the_odd_one_out():
    calls = [_c(1), _c(2, done=False)]
    odd = [_c(1), _c(2, "barrier", sizes=[], done=False)]
    found = find_desync({0: _snap(0, calls), 1: _snap(1, odd), 2: _snap(2, calls)}, wait_s=5)
    assert found is not None and found.ranks == [1]


@pytest.mark.timeout(30)
def test_two_groups_in_a_different_order_are_a_certain_cycle():
    # rank 0: group 1's all_reduce #4 first; rank 1: the default group's #7 first: each waits for the other
    r0 = _snap(0, [_c(6), _c(3, pg="1"), _c(4, pg="1", done=False, age=6)])
    r1 = _snap(1, [_c(6), _c(3, pg="1"), _c(7, done=False, age=6)])
    found = find_desync({0: r0, 1: r1}, wait_s=5)
    assert found is not None and found.certain and found.kind == "cycle" and found.ranks == [0, 1]
    assert "rank 0 is in all_reduce #4 on group 1" in found.summary
    assert "rank 1 is in all_reduce #7 ([5] Float)" in found.summary and "have not called" in found.summary
    # one of them still issuing collectives (idle < wait_s): not certain yet
    r1_busy = _snap(1, [_c(6), _c(3, pg="1"), _c(7, done=False, age=6), _c(8, done=True, age=1)])
    found = find_desync({0: r0, 1: r1_busy}, wait_s=5)
    assert found is None or not found.certain


@pytest.mark.timeout(30)
def test_a_rank_outside_the_collective_is_only_a_warning_and_agreement_is_nothing():
    waiting = _snap(1, [_c(1), _c(2, done=False, age=6)])
    away = _snap(0, [_c(1)], in_collective=False, site="train.py:50 in evaluate", blocked=None)
    found = find_desync({0: away, 1: waiting}, wait_s=5)
    assert found is not None and not found.certain and found.kind == "absent" and found.ranks == [0]
    assert found.summary.startswith("rank(s) 0 have not called all_reduce #2")
    assert "which rank(s) 1 wait in (6s so far, at" in found.summary
    assert "rank 0 is at train.py:50 in evaluate (not in a collective" in found.summary
    # not yet waited wait_s: nothing
    assert find_desync({0: away, 1: _snap(1, [_c(1), _c(2, done=False, age=2)])}, wait_s=5) is None
    # slow but agreed: every rank in the same collective, however long: nothing
    slow = [_c(1), _c(2, done=False, age=120)]
    assert find_desync({0: _snap(0, slow), 1: _snap(1, slow)}, wait_s=5) is None
    # the ring lines show each rank around the divergence
    found = find_desync({0: away, 1: waiting}, wait_s=5)
    assert found is not None and any(line.startswith("rank 1: all_reduce #1") for line in found.details)


# ---------------------------------------------------------------------------------------- real ranks
def _model() -> nn.Module:
    torch.manual_seed(0)
    return dptrain.parallelize(nn.Linear(4, 1)).module


def _save_alone(out: Path, mark: Path, model: nn.Module) -> None:
    torch.save(model.state_dict(), out / "model.pt")
    mark.write_text(str(time.time()))
    dptrain.barrier()  # rank-0-barrier


def _rank0_saves_alone(rank: int, out: Path, mark: Path) -> None:
    def body() -> None:
        model = _model()
        with dptrain.monitor(out, log_every_steps=1000) as mon:
            for step in range(1, 60):
                model(torch.ones(2, 4)).sum().backward()  # rank-1-backward
                if step == 3 and rank == 0:
                    _save_alone(out, mark, model)
                mon.step(step)

    in_group(body)


def _verdict_seconds(out: Path, mark: Path) -> float:
    return (out / "hang_report.txt").stat().st_mtime - float(mark.read_text())


def _job_ended_by_the_watchdog(fn, tmp_path: Path, what: str) -> tuple[str, str, float]:
    """Run `fn` on 2 ranks (it writes the fault's mark); the job must end with the hang watchdog's exit. Returns the
    hang report, its summary line, and the seconds from the fault to the report (printed: `pytest -s`)."""
    mark = tmp_path / "fault"
    with pytest.raises(RankError) as e:
        run_ranks(fn, 2, tmp_path, mark, timeout=45)
    assert f"exited with code {EXIT_HANG}" in str(e.value), str(e.value)[-3000:]
    report = (tmp_path / "hang_report.txt").read_text()
    seconds = _verdict_seconds(tmp_path, mark)
    print(f"\n{what}: verdict {seconds:.1f}s after the fault")
    return report, report.splitlines()[2], seconds


@pytest.mark.timeout(60)
def test_rank0_only_save_barrier_against_the_ddp_backward_is_named_within_seconds(tmp_path):
    t0 = time.monotonic()
    report, summary, seconds = _job_ended_by_the_watchdog(_rank0_saves_alone, tmp_path,
                                                          "rank-0-only save barrier vs DDP backward")
    assert "collective desync (mismatch)" in report and "desync_after_s=5" in report, report
    assert "suspect rank(s): rank 0 (" in report and "rank 1 (" in summary, report
    assert re.search(r"rank 0 is in barrier #(\d+) at collectives\.py:\d+ in barrier, called from "
                     rf"{HERE}:{_line('rank-0-barrier')}", summary), summary
    assert re.search(rf"rank 1 is in all_reduce #\d+ \(\[\d+\] Float\) at {HERE}:{_line('rank-1-backward')} .*"
                     r"in backward", summary), summary
    assert re.search(r"ranks disagree from collective #(\d+)", summary)
    assert seconds < 30 and time.monotonic() - t0 < 60  # seconds, not hang_timeout_s (bounds for a loaded CI)


def _late_evaluator(rank: int, out: Path, mark: Path, late_s: float) -> list[float]:
    def body() -> list[float]:
        model = _model()
        with dptrain.monitor(out, log_every_steps=1000) as mon:
            for step in range(1, 6):
                if step == 3 and rank == 0:
                    mark.write_text(str(time.time()))
                    time.sleep(late_s)  # rank-0-evaluates-alone
                model(torch.ones(2, 4)).sum().backward()
                mon.step(step)
        return [p.detach().sum().item() for p in model.parameters()]

    return in_group(body)


@pytest.mark.timeout(60)
def test_a_rank_late_outside_any_collective_is_warned_about_within_seconds_and_the_job_goes_on(tmp_path, capfd):
    mark = tmp_path / "fault"
    results = run_ranks(_late_evaluator, 2, tmp_path, mark, 9.0, timeout=50)  # the warning came within 9 s
    assert results[0] == results[1]  # it rejoined: training went on, nothing was ended
    err = capfd.readouterr().err
    warning = next((line for line in err.splitlines() if "dptrain watchdog: WARNING" in line), "")
    print("\n" + warning)
    assert "WARNING: rank(s) 0 have not called all_reduce #" in warning and "which rank(s) 1 wait in (" in warning, err
    assert (f"): rank 0 is at {HERE}:{_line('rank-0-evaluates-alone')} in body "
            "(not in a collective") in warning, warning
    assert "ends the job after diagnostics.hang_timeout_s=300s" in warning  # the monitor's default
    assert not (tmp_path / "hang_report.txt").exists()


def _rank0_checkpoints_alone(rank: int, out: Path, mark: Path) -> None:
    def body() -> None:
        model = _model()
        ckpt = dptrain.Checkpointer(out / "ckpt", model, torch.optim.SGD(model.parameters(), lr=0.1))
        with dptrain.monitor(out, log_every_steps=1000) as mon:
            for step in range(1, 60):
                model(torch.ones(2, 4)).sum().backward()
                if step == 3 and rank == 0:
                    mark.write_text(str(time.time()))
                    ckpt.save(step)  # rank-0-ckpt-save
                mon.step(step)

    in_group(body)


@pytest.mark.timeout(60)
def test_rank0_only_checkpointer_save_is_named_before_its_own_save_timeout(tmp_path, capfd):
    """The issue's own loop: `ckpt.save` on rank 0 only. Its monitored barrier (not in the flight recorder) ends
    rank 0 with a CheckpointError after save_timeout_s=10; the watchdog names both ranks before that."""
    mark = tmp_path / "fault"
    with pytest.raises(RankError) as e:
        run_ranks(_rank0_checkpoints_alone, 2, tmp_path, mark, timeout=45)
    assert "CheckpointError" in e.value.failed.get(0, ""), str(e.value)[-3000:]
    err = capfd.readouterr().err
    warning = next((line for line in err.splitlines() if "dptrain watchdog: WARNING" in line), "")
    print("\n" + warning)
    assert re.search(rf"rank\(s\) 0 have not called all_reduce #\d+ \(\[\d+\] Float\), which rank\(s\) 1 wait in "
                     rf"\(\d+s so far, at {HERE}:\d+ in body \(in backward", warning), err[-3000:]
    source = (Path(dptrain.__file__).parent / "api" / "checkpointer.py").read_text().splitlines()
    (barrier,) = [i for i, text in enumerate(source, 1) if "dist.monitored_barrier(" in text]
    assert (f"rank 0 is at checkpointer.py:{barrier} in _all_here, called from {HERE}:{_line('rank-0-ckpt-save')} "
            "(in monitored_barrier") in warning, warning


def _two_groups_swapped(rank: int, out: Path, mark: Path) -> None:
    def body() -> None:
        other = dist.new_group(backend="gloo")
        with dptrain.monitor(out, log_every_steps=1000):
            x = torch.ones(3)
            dist.all_reduce(x)
            mark.write_text(str(time.time()))
            if rank == 0:
                dist.all_reduce(x, group=other)  # rank-0-other-group
                dist.all_reduce(x)
            else:
                dist.all_reduce(x)  # rank-1-default-group
                dist.all_reduce(x, group=other)

    in_group(body)


@pytest.mark.timeout(60)
def test_two_groups_called_in_a_different_order_end_the_job_within_seconds(tmp_path):
    report, summary, seconds = _job_ended_by_the_watchdog(_two_groups_swapped, tmp_path,
                                                          "two groups in a different order")
    assert "collective desync: ranks wait in collectives the others have not called" in summary, report
    assert re.search(rf"rank 0 is in all_reduce #1 on group \d+ \(\[3\] Float\) at {HERE}:"
                     rf"{_line('rank-0-other-group')}", summary), summary
    assert re.search(rf"rank 1 is in all_reduce #2 \(\[3\] Float\) at {HERE}:{_line('rank-1-default-group')}",
                     summary), summary
    assert seconds < 30  # seconds, not hang_timeout_s (the figure is printed; the bound allows a loaded CI)


def _broadcast_shapes_differ(rank: int, out: Path, mark: Path) -> None:
    def body() -> None:
        with dptrain.monitor(out, log_every_steps=1000, collective_check_every_steps=1) as mon:
            for step in range(1, 120):  # ends at the verdict (about 1 s after step 3); room for a loaded machine
                if step == 3:
                    mark.write_text(str(time.time()))
                    # gloo completes it: silent corruption
                    dist.broadcast(torch.zeros(3 if rank == 0 else 5), 0)  # broadcast-differs
                x = torch.ones(2)
                dist.all_reduce(x)
                mon.step(step)
                time.sleep(0.2)

    in_group(body)


@pytest.mark.timeout(60)
def test_the_check_mode_catches_a_broadcast_with_different_shapes_that_completed(tmp_path):
    report, summary, seconds = _job_ended_by_the_watchdog(
        _broadcast_shapes_differ, tmp_path, "broadcast with different shapes (check mode, every step)")
    at = rf"at {HERE}:{_line('broadcast-differs')} in body"  # each finished call's line, as the recorder kept it
    assert re.search(rf"ranks disagree from collective #\d+: rank 0 called broadcast #\d+ \(\[3\] Float\) {at}; "
                     rf"rank 1 called broadcast #\d+ \(\[5\] Float\) {at}", summary), report
    assert re.search(r"found by the collective check at step \d+ \(diagnostics.collective_check_every_steps\)", report)
    assert seconds < 30  # seconds, not hang_timeout_s (the figure is printed; the bound allows a loaded CI)


def _agreed_but_slow(rank: int, out: Path, mark: Path) -> None:
    # every rank in the same all_reduce, for ever longer
    def slow_ring(now_ns: int | None = None, *, sites: bool = False) -> list[Call]:
        if not mark.exists():
            return []
        return [Call("0", 1, "all_reduce", [[5]], ["Float"], False, time.time() - float(mark.read_text()) + 6)]

    desync_watch.read_calls = collective_ring.read_calls = slow_ring  # this forked rank only
    desync_watch.main_thread_position = lambda: ("distributed_c10d.py:1 in all_reduce", True)

    def body() -> None:
        with dptrain.monitor(out, hang_timeout_s=12, log_every_steps=1000) as mon:
            mon.step(1)
            mark.write_text(str(time.time()))
            time.sleep(40)

    in_group(body)


@pytest.mark.timeout(60)
def test_a_slow_collective_the_ranks_agree_on_waits_for_hang_timeout_s(tmp_path, capfd):
    mark = tmp_path / "fault"
    with pytest.raises(RankError):
        run_ranks(_agreed_but_slow, 2, tmp_path, mark, timeout=45)
    seconds = _verdict_seconds(tmp_path, mark)
    report = (tmp_path / "hang_report.txt").read_text()
    assert "no progress for 12s (diagnostics.hang_timeout_s)" in report and "collective desync" not in report
    assert 12 <= seconds < 40, seconds  # never before hang_timeout_s=12
    assert "WARNING" not in capfd.readouterr().err


LAUNCHED = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
for step in range(1, 60):
    model(torch.ones(2, 4)).sum().backward()  # launched-backward
    if step == 3 and rank == 0:
        open(sys.argv[1], "w").write(str(time.time()))
        dist.barrier()  # launched-barrier
"""


@pytest.mark.timeout(90)
def test_dptrain_launch_of_a_plain_torch_loop_names_the_desync_without_any_monitor(tmp_path):
    script, mark = tmp_path / "train.py", tmp_path / "fault"
    script.write_text(LAUNCHED)
    t0 = time.monotonic()
    r = dptrain_cli("launch", "--nproc-per-node", "2", str(script), str(mark), timeout=80,
                    env={"OMP_NUM_THREADS": "1"})
    ended = time.time()
    assert r.returncode == EXIT_HANG, r.stderr[-3000:]
    out = r.stdout + r.stderr
    seconds = ended - float(mark.read_text())
    print(f"\ndptrain launch, no monitor: job ended {seconds:.1f}s after the fault ({time.monotonic() - t0:.0f}s run)")
    summary = next(line for line in out.splitlines() if line.startswith("suspect rank(s)"))
    assert re.search(rf"rank 0 is in barrier #\d+ at train\.py:{_line('launched-barrier', script)} in <module>",
                     summary), out[-4000:]
    assert re.search(rf"rank 1 is in all_reduce #\d+ .* at train\.py:{_line('launched-backward', script)} in "
                     r"<module> \(in backward", summary), summary
    assert "stopped by the hang watchdog" in out and "see the report above" in out
    assert "Connection closed by peer" not in out and "Traceback" not in out  # no victim's traceback after it
    assert seconds < 30  # the verdict, then every rank's exit and the launcher's own teardown


@pytest.mark.timeout(30)
def test_workers_get_a_small_flight_recorder_unless_the_user_chose_one():
    from dptrain.distributed.flight_recorder import DEFAULT_ENTRIES, FR_BUFFER_ENV, enable_by_default

    env: dict[str, str] = {}
    enable_by_default(env)
    assert env == {FR_BUFFER_ENV: str(DEFAULT_ENTRIES)}
    env = {FR_BUFFER_ENV: "0"}
    enable_by_default(env)
    assert env == {FR_BUFFER_ENV: "0"}  # off stays off
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}
    enable_by_default(env)
    assert FR_BUFFER_ENV not in env  # torch's older name counts as the user's choice
