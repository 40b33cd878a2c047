"""A collective called with different shapes on the ranks, named from the ranks' own records (diagnostics/
collective_record.py, launch/culprit.py `collective_mismatch`).

gloo aborts the rank that receives data of another size at once (SIGABRT), so no watchdog gets to compare rings:
each failing rank, the aborted one through its SIGABRT hook, leaves its last collectives with the lines that called
them, and the launcher's last line names the rank that differs, not the victim of the abort. The fault matrix runs
the same fault under `dptrain run` (tests/test_fault_matrix.py)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from dptrain.diagnostics.collective_ring import DPTRAIN_DIR, frames_site
from support.run_helpers import dptrain as dptrain_cli

MISMATCH = """
import sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(1, 4):
    dist.all_reduce(torch.ones(2))
time.sleep(1)  # the launch shim arms its hooks once the group exists
open(sys.argv[1] + f".{rank}", "w").write(str(time.time()))
dist.all_reduce(torch.ones(6 if rank == 1 else 4))  # the-mismatch
"""


def _line(script: Path) -> int:
    return next(i for i, text in enumerate(script.read_text().splitlines(), 1) if text.endswith("# the-mismatch"))


@pytest.mark.timeout(90)
def test_dptrain_launch_names_the_rank_whose_shape_differs_not_the_rank_gloo_aborted(tmp_path):
    script, mark = tmp_path / "train.py", tmp_path / "fault"
    script.write_text(MISMATCH)
    r = dptrain_cli("launch", "--nproc-per-node", "2", str(script), str(mark), timeout=80,
                    env={"OMP_NUM_THREADS": "1"})
    ended = time.time()
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "Received data size doesn't match expected size" in out  # gloo aborted a rank (the fault is real)
    last = r.stderr.strip().splitlines()[-1]
    line = _line(script)
    assert re.fullmatch(
        rf"dptrain: collective mismatch: rank 1 called all_reduce #4 \(\[6\] Float\) at train\.py:{line} in "
        rf"<module>; rank 0 called all_reduce #4 \(\[4\] Float\) at train\.py:{line} in <module>: rank 1 differs "
        r"in its shapes from rank 0 at collective #4; rank 0 only died of it .*: not the cause", last), out[-4000:]
    assert "your script was killed by SIGABRT on rank 0" not in out  # the victim is not the root cause
    seconds = ended - min(float(p.read_text()) for p in tmp_path.glob("fault.*"))
    print(f"\nshape mismatch under dptrain launch: named {seconds:.1f}s after the fault (the launcher's exit)")
    assert seconds < 30  # the abort is immediate; the bound allows a loaded CI


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_a_collective_is_placed_at_the_first_frame_outside_torch_and_dptrains_own_names_its_caller():
    torch_dir = __import__("torch").__file__.rsplit("/", 1)[0]
    frames = [{"name": "all_reduce", "filename": f"{torch_dir}/distributed/distributed_c10d.py", "line": 3245},
              {"name": "mean", "filename": f"{DPTRAIN_DIR}distributed/collectives.py", "line": 41},
              {"name": "main", "filename": "/home/me/train.py", "line": 30}]
    assert frames_site(frames) == "collectives.py:41 in mean, called from train.py:30 in main"
    assert frames_site(frames[2:]) == "train.py:30 in main"
    assert frames_site(frames[:1]) == ""  # only torch's frames (DDP's reducer): no line


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_a_restarted_rank_clears_its_earlier_attempts_record(tmp_path, monkeypatch):
    """Under torchrun's restarts a rank's record from an earlier attempt (other sequence numbers) must not meet the
    next attempt's records in the launcher's comparison."""
    from dptrain.distributed.exit_marks import EXIT_MARKS_ENV, clear_exit_mark
    from dptrain.launch.culprit import read_collective_records

    monkeypatch.setenv(EXIT_MARKS_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    for rank in (0, 1):
        (tmp_path / f"collective_rank_{rank}.json").write_text(json.dumps({"rank": rank, "calls": []}))
    assert sorted(read_collective_records(tmp_path)) == [0, 1]
    clear_exit_mark()
    assert sorted(read_collective_records(tmp_path)) == [0]  # only this rank's own
