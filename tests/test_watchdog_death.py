"""A watchdog thread that dies is said on the console and recorded in diagnostics.jsonl: from then on
the rank has no hang detection, which a run must not hide behind one stderr line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import dptrain.diagnostics.hub as hub
from dptrain.config import DiagnosticsConfig
from dptrain.diagnostics.hub import Diagnostics
from dptrain.distributed.env import DistEnv

pytestmark = pytest.mark.timeout(60)


class FailingStore:
    """Accepts the first publication (from the training thread), then fails like a store whose
    server went away."""

    def __init__(self) -> None:
        self.sets = 0

    def set(self, key: str, value: str) -> None:
        self.sets += 1

    def add(self, key: str, amount: int) -> int:
        raise ConnectionResetError("store server closed the connection")


def _start(tmp_path: Path, monkeypatch, *, rank: int) -> tuple[Diagnostics, list[str]]:
    monkeypatch.setattr(hub, "_default_store", FailingStore)
    said: list[str] = []
    cfg = DiagnosticsConfig(hang_timeout_s=5, straggler_every_steps=0, drift_every_steps=0, rss_every_steps=0)
    diag = Diagnostics(cfg, env=DistEnv(rank=rank, world_size=2), run_dir=tmp_path, pg_timeout_s=60, say=said.append)
    diag.start(torch.nn.Linear(1, 1), step=6, device=torch.device("cpu"))
    deadline = time.monotonic() + 20
    while not said and time.monotonic() < deadline:
        time.sleep(0.05)
    return diag, said


def _records(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "diagnostics.jsonl").read_text().splitlines()]


@pytest.mark.fast
@pytest.mark.parametrize("rank", [0, 1])
def test_watchdog_death_is_said_and_recorded(tmp_path, monkeypatch, rank):
    diag, said = _start(tmp_path, monkeypatch, rank=rank)
    try:
        assert len(said) == 1, said
        assert f"rank {rank}: the hang watchdog died (ConnectionResetError: store server closed" in said[0]
        assert "WITHOUT hang detection" in said[0]
    finally:
        diag.close()
    died = [r for r in _records(tmp_path) if r["kind"] == "watchdog_died"]
    assert len(died) == 1
    assert died[0]["rank"] == rank and died[0]["step"] == 7
    assert died[0]["error"] == "ConnectionResetError: store server closed the connection"
    assert "ConnectionResetError" in died[0]["traceback"] and "_run" in died[0]["traceback"]


def test_a_stopped_watchdog_does_not_report(tmp_path, monkeypatch):
    """After close() the store may be gone with the job: that is no death to report."""
    monkeypatch.setattr(hub, "_default_store", FailingStore)
    said: list[str] = []
    cfg = DiagnosticsConfig(hang_timeout_s=5, straggler_every_steps=0, drift_every_steps=0, rss_every_steps=0)
    diag = Diagnostics(cfg, env=DistEnv(), run_dir=tmp_path, pg_timeout_s=60, say=said.append)
    diag.hang_timeout_s = 1000.0  # interval 1 s: close() comes before the first loop turn
    diag.start(torch.nn.Linear(1, 1), step=0, device=torch.device("cpu"))
    diag.close()
    assert said == []
    assert (tmp_path / "diagnostics.jsonl").read_text() == ""
