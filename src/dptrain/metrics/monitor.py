"""The monitoring sinks beside metrics.jsonl and the console (sinks.py), built by the trainer on
every rank from the `log` section:

- TensorBoard scalars (`log.tensorboard`, rank 0 only: the same records as metrics.jsonl);
- a Prometheus exporter (`log.prometheus_port`, every rank, port + local rank);
- the per-rank status file for `dptrain top` (`log.status_every_s`, every rank).

Every rank builds the log record at a log step (metrics/records.py); rank 0 alone writes it to
metrics.jsonl, and each rank hands its own to these sinks. `check_monitoring` runs in the launcher,
before any worker starts: the optional packages are installed and the ports are free.
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dptrain.config import ConfigError, LogConfig

if TYPE_CHECKING:  # the launcher imports this module for check_monitoring: no torch at import
    import torch

    from dptrain.diagnostics import Diagnostics
    from dptrain.distributed.env import DistEnv

INSTALL = "pip install 'dptrain[monitor]'"
DASHBOARD = Path(__file__).resolve().parent / "grafana" / "dptrain.json"
"""The Grafana dashboard for the Prometheus metrics (installed with the package)."""


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self, *, finished: bool = True) -> None: ...


def require(log: LogConfig) -> None:
    """Refuse a monitoring switch whose package is not installed, naming the switch and the fix."""
    needs = [("log.tensorboard=true", "tensorboard", "tensorboard")] if log.tensorboard else []
    if log.prometheus_port:
        needs.append((f"log.prometheus_port={log.prometheus_port}", "prometheus_client", "prometheus-client"))
    for switch, module, package in needs:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{switch} needs the {package} package, which is not installed: {INSTALL}")


def check_monitoring(log: LogConfig, *, nproc_per_node: int) -> None:
    """In the launcher: packages present, and ports PORT .. PORT+nproc-1 in range and free here."""
    require(log)
    port = log.prometheus_port
    if not port:
        return
    last = port + nproc_per_node - 1
    if last > 65535:
        raise ConfigError(f"log.prometheus_port={port} with {nproc_per_node} ranks per node needs ports up to {last}, "
                          "past 65535; choose a lower port")
    for p in range(port, last + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((log.prometheus_addr, p))
            except OSError as e:
                raise ConfigError(f"log.prometheus_port={port}: port {p} on {log.prometheus_addr} (local rank "
                                  f"{p - port}) is not free ({e.strerror}); each rank serves on the port + its local "
                                  "rank: choose another port") from None


class Monitor:
    """This rank's monitoring sinks, fed like the JSONL sink."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def event(self, kind: str, record: dict[str, Any]) -> None:
        """A diagnostics finding (the hub's report), for the sinks that count them."""
        for sink in self.sinks:
            if hasattr(sink, "event"):
                sink.event(kind, record)

    def close(self, *, finished: bool = True) -> None:
        """`finished`: the run ended normally (else it failed or was stopped; the status file says which)."""
        sinks, self.sinks = self.sinks, []  # closing twice (fit, then a benchmark's close) is harmless
        for sink in sinks:
            sink.close(finished=finished)
        self.sinks = []


def build_monitor(log: LogConfig, *, env: DistEnv, run_dir: Path, device: torch.device, diag: Diagnostics) -> Monitor:
    """The sinks `log` asks for on this rank; they read the training thread's position (step, phase)
    and the counters from `diag`, and hear its findings (straggler reports)."""
    require(log)
    sinks: list[Sink] = []
    if log.tensorboard and env.is_main:
        # lazy: optional extra [monitor] (tensorboard)
        from dptrain.metrics.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(Path(run_dir) / "tensorboard"))
    if log.prometheus_port:
        # lazy: optional extra [monitor] (prometheus-client)
        from dptrain.metrics.prometheus import PrometheusExporter

        def counters() -> dict[str, float]:  # read when Prometheus scrapes, in the exporter's thread
            skipped = diag.nonfinite.skipped if diag.nonfinite is not None else 0
            return {"nonfinite_skipped_steps": float(skipped), "restarts": float(env.restart_count)}

        sinks.append(PrometheusExporter(port=log.prometheus_port + env.local_rank, addr=log.prometheus_addr,
                                        rank=env.rank, host=socket.gethostname(), device=device, counters=counters))
    if log.status_every_s:
        # lazy: written only when log.status_every_s > 0
        from dptrain.metrics.status import StatusWriter

        sinks.append(StatusWriter(run_dir, rank=env.rank, local_rank=env.local_rank, world_size=env.world_size,
                                  device=device, position=lambda: (diag.step, diag.phase_name),
                                  every_s=log.status_every_s))
    monitor = Monitor(sinks)
    diag.listeners.append(monitor.event)
    return monitor
