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
