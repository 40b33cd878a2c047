"""The root cause of a multi-rank failure (dptrain.launch.culprit) against torchrun's own failure records: error files
written by torchelastic's ErrorHandler, read back by its ProcessFailure and reported by its ChildFailedError."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler, ProcessFailure

from dptrain.launch.culprit import PEER_LOST_MARK, name_root_cause, root_cause

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]

GLOO_PEER_LOST = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40311"


def _failure(tmp: Path, rank: int, exitcode: int, error: BaseException | None, monkeypatch) -> ProcessFailure:
    """A failure as torchrun records it: the error file that torchelastic's ErrorHandler writes when the rank raised."""
    path = tmp / f"error{rank}.json"
    if error is not None:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        try:
            raise error
        except type(error) as e:
            ErrorHandler().record_exception(e)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_the_rank_that_raised_is_named_not_the_peer_that_lost_it_in_the_same_second(tmp_path, monkeypatch):
    failures = {
        0: _failure(tmp_path, 0, 1, RuntimeError(GLOO_PEER_LOST), monkeypatch),
        1: _failure(tmp_path, 1, 1, RuntimeError("boom on rank 1"), monkeypatch),
    }
    failures[0].timestamp = failures[1].timestamp  # whole seconds: a tie, which torchrun gives to rank 0
    error = ChildFailedError("train.py", failures)
    assert error.get_first_failure()[0] == 0  # torchrun's own pick
    assert name_root_cause(error)[0] == 1
    report = error.format_msg()
    root = report[report.index("Root Cause"):report.index("Other Failures") if "Other Failures" in report else None]
    assert "rank      : 1 (local_rank: 1)" in root and "boom on rank 1" in root


def test_ranks_torchrun_terminated_are_victims_and_a_killed_rank_is_the_cause(tmp_path, monkeypatch):
    failures = {
        0: _failure(tmp_path, 0, -signal.SIGTERM, None, monkeypatch),
        1: _failure(tmp_path, 1, -signal.SIGKILL, None, monkeypatch),  # the OOM killer, or a `kill -9`
        2: _failure(tmp_path, 2, 1, ConnectionError("Connection reset by peer"), monkeypatch),
    }
    for f in failures.values():
        f.timestamp = 100
    assert root_cause(failures) == 1


def test_with_only_victims_or_only_causes_the_earliest_is_named(tmp_path, monkeypatch):
    peers = {r: _failure(tmp_path, r, 1, RuntimeError(GLOO_PEER_LOST), monkeypatch) for r in (0, 1)}
    peers[0].timestamp, peers[1].timestamp = 101, 100
    assert root_cause(peers) == 1
    causes = {r: _failure(tmp_path, r, 1, ValueError(f"bad input on {r}"), monkeypatch) for r in (0, 1, 2)}
    causes[0].timestamp, causes[1].timestamp, causes[2].timestamp = 7, 5, 5
    assert root_cause(causes) == 1  # the earliest; a tie goes to the lowest rank, as torchrun's
    assert os.environ.get("TORCHELASTIC_ERROR_FILE")  # (the records above were real error files)


def test_a_worker_that_marked_itself_a_victim_is_never_the_root_cause(tmp_path, monkeypatch):
    """dptrain's own workers say "lost a peer" on the console and exit 1 without an error file; their exit mark
    (reason PEER_LOST_MARK) is what tells the launcher, when torchrun saw them fail in the same second as the rank
    that was killed."""
    failures = {0: _failure(tmp_path, 0, 1, None, monkeypatch),
                1: _failure(tmp_path, 1, -signal.SIGKILL, None, monkeypatch)}
    failures[0].timestamp = failures[1].timestamp = 100
    error = ChildFailedError("dptrain.launch.worker", failures)
    assert name_root_cause(error)[0] == 0  # unmarked: the tie goes to rank 0
    assert name_root_cause(error, {0: {"code": 1, "reason": PEER_LOST_MARK}})[0] == 1


def test_a_node_whose_rendezvous_endpoint_refuses_connections_says_so_and_names_no_other_node():
    """The wrong rendezvous port on node_rank 1: torch's store client retries for a minute in silence; the wait line
    (NodeWait, first at 5 s) says that nothing listens there. node_rank 0 hosts the store: it names who is awaited."""
    from dptrain.config import LaunchConfig
    from dptrain.launch.rendezvous_wait import refuses_connections, waiting_line
    from support.mp import find_free_port

    endpoint = f"127.0.0.1:{find_free_port()}"  # nothing listens
    assert refuses_connections(endpoint)
    line = waiting_line(LaunchConfig(nnodes=2, node_rank=1, rdzv_endpoint=endpoint), 10)
    assert f"nothing listens at the rendezvous {endpoint} (job id 'dptrain'): this is node_rank 1" in line, line
    assert "node_rank(s)" not in line
    line = waiting_line(LaunchConfig(nnodes=2, node_rank=0, rdzv_endpoint=endpoint), 10)
    assert "this is node_rank 0; node_rank(s) 1 have not all joined" in line, line


def _record(rank: int, why: str, *calls: tuple) -> dict:
    """A failing rank's record (diagnostics/collective_record.py): rows of Call fields plus the calling line."""
    return {"rank": rank, "why": why, "calls": [[pg, seq, op, sizes, ["Float"], done, 0.1, False, site]
                                               for pg, seq, op, sizes, done, site in calls]}


def _snapshot(*calls: tuple) -> dict:
    """What a rank's watchdog publishes when asked (diagnostics/collective_ring.py `snapshot`): its ring."""
    return {"ring": _record(0, "", *calls)["calls"], "site": "x.py:1 in f"}


AGREED = ("0", 13, "all_reduce", [[1732]], True, "comm.py:148 in metered")


def test_a_collective_mismatch_names_the_rank_that_differs_not_the_one_the_backend_aborted():
    from dptrain.launch.culprit import collective_mismatch

    two = {0: _record(0, "aborted (SIGABRT)", AGREED, ("0", 14, "all_reduce", [[4]], False, "loss.py:81 in sync")),
           1: _record(1, "raised", AGREED, ("0", 14, "all_reduce", [[6]], True, "loss.py:81 in sync"))}
    found = collective_mismatch(two)
    assert found is not None and found.odd == [1]  # two sides, no majority: the side that is not rank 0's
    assert found.line.startswith(
        "collective mismatch: rank 1 called all_reduce #14 ([6] Float) at loss.py:81 in sync; rank 0 called "
        "all_reduce #14 ([4] Float) at loss.py:81 in sync: rank 1 differs in its shapes from rank 0 at collective #14; "
        "rank 0 only died of it"), found.line
    # four ranks: the majority's shape is the norm, whichever rank the backend aborted
    four = {r: _record(r, "aborted (SIGABRT)" if r == 0 else "raised",
                       ("0", 14, "all_reduce", [[6 if r == 2 else 4]], r != 0, f"loss.py:{80 + r} in sync"))
            for r in range(4)}
    found = collective_mismatch(four)
    assert found is not None and found.odd == [2]
    assert "rank 2 called all_reduce #14 ([6] Float) at loss.py:82 in sync; ranks 0, 1, 3 called" in found.line
    assert "from the others" in found.line
    # another op at the same sequence number; groups other than the default one are compared too
    ops = {0: _record(0, "raised", ("5", 2, "barrier", [[1]], False, "a.py:1 in f")),
           1: _record(1, "raised", ("5", 2, "broadcast", [[3]], False, "b.py:2 in g"))}
    found = collective_mismatch(ops)
    assert found is not None and "differs in its op" in found.line and "of group 5" in found.line
    # the other side from the snapshot the aborted rank asked for (torchrun stopped rank 1 before its own record)
    peer = _snapshot(AGREED, ("0", 14, "all_reduce", [[6]], False, "loss.py:81 in sync"))
    found = collective_mismatch({0: {**two[0], "peers": {"1": peer}}})
    assert found is not None and found.odd == [1]
    assert "rank 1 called all_reduce #14 ([6] Float) at loss.py:81" in found.line
    # agreement, one record alone, or records of ranks that never met at one collective: nothing to name
    assert collective_mismatch({0: two[0], 1: _record(1, "raised", AGREED)}) is None
    assert collective_mismatch({0: two[0]}) is None
    assert collective_mismatch({}) is None


def test_a_mismatch_repoints_torchruns_root_cause(tmp_path, monkeypatch):
    failures = {0: _failure(tmp_path, 0, -signal.SIGABRT, None, monkeypatch),
                1: _failure(tmp_path, 1, -signal.SIGTERM, None, monkeypatch)}
    error = ChildFailedError("dptrain.launch.worker", failures)
    assert name_root_cause(error)[0] == 0  # the aborted rank: torchrun's pick, and the victim rule's
    assert name_root_cause(error, cause=1)[0] == 1
    assert error.get_first_failure()[0] == 1
