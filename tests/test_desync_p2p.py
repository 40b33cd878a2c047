"""Point-to-point calls in the desync verdict: gloo's send/recv are not in torch's flight recorder (2.13), so a rank
blocked in one is read from its stack (diagnostics/collective_ring.py `p2p_wait`) and joins the wait-for graph
(diagnostics/desync.py): a pipeline stage that never sends is named within seconds, not at hang_timeout_s."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dptrain
from dptrain.diagnostics.collective_ring import Call, p2p_wait
from dptrain.diagnostics.desync import find_desync
from dptrain.diagnostics.watchdog import EXIT_HANG
from support.mp import RankError, in_group, run_ranks


def _snap(rank: int, calls: list[Call], *, p2p: dict | None = None, in_collective: bool = True,
          site: str = "pipe.py:9 in stage") -> dict:
    return {"rank": rank, "ring": [list(c) for c in calls], "groups": {"0": [0, 1, 2]}, "site": site,
            "blocked_in": p2p["op"] if p2p else "all_reduce", "in_collective": in_collective, "p2p": p2p,
            "phase": "train", "recorder": True}


def _c(seq: int, *, done: bool = True, age: float = 10.0) -> Call:
    return Call("0", seq, "all_reduce", [[5]], ["Float"], done, age)


def _recv(peer: int) -> dict:
    return {"op": "recv", "peer": peer, "sizes": [[4]], "dtype": "Float"}


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_a_rank_in_recv_from_a_rank_that_went_on_to_a_collective_is_a_certain_cycle():
    # rank 1 never sent to rank 2 and waits in the next all_reduce; rank 2 waits in recv from rank 1; rank 0 waits too
    snaps = {0: _snap(0, [_c(13), _c(14, done=False, age=6)]), 1: _snap(1, [_c(13), _c(14, done=False, age=6)]),
             2: _snap(2, [_c(13, age=7)], p2p=_recv(1))}
    found = find_desync(snaps, wait_s=5)
    assert found is not None and found.certain and found.kind == "cycle" and found.ranks == [1, 2]
    assert "rank 2 is in recv from rank 1 ([4] Float) at pipe.py:9 in stage" in found.summary
    assert "which rank 1 has not sent" in found.summary and "rank 1 is in all_reduce #14" in found.summary
    # two stages each waiting to receive from the other: a cycle with no collective at all
    both = {0: _snap(0, [_c(3, age=8)], p2p=_recv(1)), 1: _snap(1, [_c(3, age=8)], p2p=_recv(0))}
    found = find_desync(both, wait_s=5)
    assert found is not None and found.certain and found.ranks == [0, 1]


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_a_recv_whose_peer_is_busy_elsewhere_or_fresh_is_no_certain_verdict():
    waiting = _snap(0, [_c(13), _c(14, done=False, age=6)])
    busy = _snap(1, [_c(13)], in_collective=False, site="pipe.py:20 in compute")  # may still send
    found = find_desync({0: waiting, 1: busy, 2: _snap(2, [_c(13, age=7)], p2p=_recv(1))}, wait_s=5)
    assert found is None or not found.certain
    # only send/recv, and not yet for wait_s (their last collectives a second ago): snapshots may be stale
    fresh = {0: _snap(0, [_c(3, age=1)], p2p=_recv(1)), 1: _snap(1, [_c(3, age=1)], p2p=_recv(0))}
    assert find_desync(fresh, wait_s=5) is None
    # but a rank in recv from one stuck in a collective it has not called is a deadlock however fresh its recv
    stuck = {0: waiting, 1: _snap(1, [_c(13), _c(14, done=False, age=6)]), 2: _snap(2, [_c(13, age=1)], p2p=_recv(1))}
    found = find_desync(stuck, wait_s=5)
    assert found is not None and found.certain and found.ranks == [1, 2]


def _stage_skips_its_send(rank: int, out: Path, mark: Path) -> None:
    def body() -> None:
        with dptrain.monitor(out, log_every_steps=1000) as mon:
            for step in range(1, 4):
                dist.all_reduce(torch.ones(2))
                mon.step(step)
            mark.write_text(str(time.time()))
            if rank == 0:
                dist.all_reduce(torch.ones(2))  # rank-0-forgot-to-send
            else:
                dist.recv(torch.zeros(3), src=0)  # rank-1-recv

    in_group(body)


@pytest.mark.timeout(60)
def test_a_stage_that_never_sends_is_named_within_seconds(tmp_path):
    mark = tmp_path / "fault"
    with pytest.raises(RankError) as e:
        run_ranks(_stage_skips_its_send, 2, tmp_path, mark, timeout=45)
    assert f"exited with code {EXIT_HANG}" in str(e.value), str(e.value)[-3000:]
    report = (tmp_path / "hang_report.txt").read_text()
    seconds = (tmp_path / "hang_report.txt").stat().st_mtime - float(mark.read_text())
    print(f"\na stage that never sends: verdict {seconds:.1f}s after the fault")
    here = Path(__file__)
    lines = {m: next(i for i, t in enumerate(here.read_text().splitlines(), 1) if t.endswith(f"# {m}"))
             for m in ("rank-0-forgot-to-send", "rank-1-recv")}
    summary = report.splitlines()[2]
    assert re.search(rf"rank 0 is in all_reduce #\d+ \(\[2\] Float\) at {here.name}:{lines['rank-0-forgot-to-send']}",
                     summary), summary
    assert re.search(rf"rank 1 is in recv from rank 0 \(\[3\] Float\) at {here.name}:{lines['rank-1-recv']}", summary)
    assert seconds < 30  # seconds, not hang_timeout_s (the bound allows a loaded CI)


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_p2p_wait_reads_the_call_its_peer_and_tensor_from_a_stack():
    import sys

    seen = {}

    def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None):
        seen["wait"] = p2p_wait(sys._getframe())

    recv.__code__ = recv.__code__.replace(co_filename=dist.distributed_c10d.__file__, co_name="recv")
    recv(torch.zeros(2, 3), src=4)
    assert seen["wait"] == {"op": "recv", "peer": 4, "sizes": [[2, 3]], "dtype": "Float"}
    assert p2p_wait(sys._getframe()) is None
