"""Helpers for tests/test_monitor.py: a loss that holds a run at one step until the test lets it go,
and a real Prometheus server (Debian's /usr/bin/prometheus) on loopback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import torch
from torch import nn

from support.mp import find_free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SCRAPE_S = 2  # scrape interval and timeout: a loaded machine can take over a second to answer

_calls = {"train": 0}


def held_loss(model: nn.Module, batch) -> torch.Tensor:
    """The model's loss; the $HOLD_CALL-th training call waits (up to 300 s) until the file $HOLD_FILE
    exists, so the run stays alive, its exporters serving, while the test scrapes and queries."""
    if model.training:
        _calls["train"] += 1
        if _calls["train"] == int(os.environ.get("HOLD_CALL", "0")):
            deadline = time.monotonic() + 300
            while not Path(os.environ["HOLD_FILE"]).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    return model(batch)


def free_port_pair() -> int:
    """A port P with P and P + 1 free on 127.0.0.1 a moment ago (the exporters of local ranks 0 and 1)."""
    import socket

    for _ in range(50):
        p = find_free_port()
        if p >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports found")


class Prometheus:
    """A Prometheus server scraping `targets` every SCRAPE_S seconds, its HTTP API on a free loopback port."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        every = f"{SCRAPE_S}s"
        config = {"global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every},
                  "scrape_configs": [{"job_name": "dptrain", "static_configs": [{"targets": targets}]}]}
        (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout_s} s; see {self.log.name}")

    def api(self, path: str, **params: Any) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector `expr` evaluates to now."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def targets_up(self) -> int:
        return sum(t["health"] == "up" for t in self.api("targets")["activeTargets"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
