"""A rank the kernel's OOM killer ended, told from a `kill -9` (dptrain.launch.oom): the memory cgroups' OOM-kill
counters since the launch, and the kernel log when it is readable. A made-up cgroup tree here; the fault matrix's
`oom` fault (tests/test_fault_matrix.py) has the kernel kill a real rank where cgroups are writable."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from dptrain.launch import oom

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]


def _failures(**codes: int) -> dict[int, SimpleNamespace]:
    return {int(r.removeprefix("r")): SimpleNamespace(exitcode=c, pid=100 + int(r.removeprefix("r")))
            for r, c in codes.items()}


def test_an_oom_kill_counted_in_the_jobs_cgroups_names_the_rank_that_died_of_sigkill(tmp_path, monkeypatch):
    job = tmp_path / "job"
    (job / "rank1").mkdir(parents=True)
    (job / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")  # cgroup v1
    (job / "rank1" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\n")  # cgroup v2
    monkeypatch.setattr(oom, "_own_memory_cgroups", lambda: [job])
    monkeypatch.setattr(oom, "_kernel_log_pids", lambda since_s: set())  # dmesg unreadable, as in most containers
    before = oom.oom_counts()
    assert before == {str(job): 2, str(job / "rank1"): 0}
    failures = _failures(r0=-signal.SIGTERM, r1=-signal.SIGKILL)
    assert oom.oom_kill_line(failures, before) is None  # a SIGKILL with no OOM kill counted: someone's kill -9
    (job / "rank1" / "memory.events").write_text("oom 1\noom_kill 1\n")
    line = oom.oom_kill_line(failures, before)
    assert line is not None and line.startswith("rank 1 (pid 101) was killed by the kernel's OOM killer (SIGKILL): "
                                                f"memory cgroup {job / 'rank1'} counted 1 OOM kill during the run")
    # two ranks SIGKILLed and only a counter to go by: which one is not known, nothing is claimed
    assert oom.oom_kill_line(_failures(r0=-signal.SIGKILL, r1=-signal.SIGKILL), before) is None
    # the kernel log names the pid: that rank, even among two
    monkeypatch.setattr(oom, "_kernel_log_pids", lambda since_s: {100})
    line = oom.oom_kill_line(_failures(r0=-signal.SIGKILL, r1=-signal.SIGKILL), before)
    assert line is not None and line.startswith("rank 0 (pid 100) was killed")
    assert "the kernel log says it killed pid 100" in line
    assert oom.oom_kill_line(_failures(r0=1, r1=-signal.SIGTERM), before) is None  # no SIGKILL at all


def test_the_memory_cgroups_of_this_process_are_found_in_v1_and_v2_layouts(tmp_path, monkeypatch):
    (tmp_path / "memory" / "a" / "b").mkdir(parents=True)
    (tmp_path / "memory" / "a" / "b" / "memory.oom_control").write_text("oom_kill 0\n")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "memory.events").write_text("oom_kill 0\n")
    monkeypatch.setattr(oom, "CGROUP_ROOT", tmp_path)
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/a/b\n3:cpu:/x\n0::/c\n")
    assert oom._own_memory_cgroups(proc) == [tmp_path / "memory" / "a" / "b", tmp_path / "c"]


def test_only_kernel_log_kills_since_the_launch_count(monkeypatch):
    log = ("[  100.5] Memory cgroup out of memory: Killed process 7 (python) total-vm:1kB\n"
           "[ 2000.25] Memory cgroup out of memory: Killed process 8 (python) total-vm:1kB\n[ 2001.0] other\n")
    monkeypatch.setattr(oom.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=log))
    assert oom._kernel_log_pids(0.0) == {7, 8}
    assert oom._kernel_log_pids(1500.0) == {8}  # pid 7's kill came before this launch: a reused pid is no evidence
