"""A Prometheus exporter on every rank (`log.prometheus_port`): prometheus-client's HTTP server.

Ports: rank with local rank L serves on `log.prometheus_port + L` on every node, so a scrape config
lists `host:PORT` ... `host:PORT+nproc_per_node-1` for each host; every series carries the labels
`rank` (the global rank) and `host`.

Where the values come from: every rank builds the log record at a log step (the loss is already
averaged over the data-parallel ranks there; step time and throughput are this rank's own clock over
its own window), so each rank's exporter is fed by its own trainer, without any extra collective,
and only rank 0 writes the record to metrics.jsonl (still the source of truth). Every numeric key of a
record becomes a gauge: the keys in METRICS get their documented name and help; any other key
(one a newer meter adds) is exported as `dptrain_<key>`. Memory, GPU (NVML) readings and the
diagnostics counters are read when Prometheus scrapes, in the server's thread: nothing is added to
the training step.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dptrain.metrics.gpu import GpuSampler, process_memory

PREFIX = "dptrain_"
LABELS = ("rank", "host")

# record key -> (metric name without the prefix, help). Keys not listed are exported as dptrain_<key>.
METRICS: dict[str, tuple[str, str]] = {
    "step": ("step", "Last logged optimizer step."),
    "loss": ("loss", "Training loss, mean of the log window over the data-parallel ranks."),
    "val_loss": ("val_loss", "Validation loss at the last evaluation."),
    "val_bpb": ("val_bits_per_byte", "Validation bits per byte at the last evaluation (byte-level data)."),
    "lr": ("learning_rate", "Learning rate of the last step."),
    "grad_norm": ("grad_norm", "Global gradient norm before clipping, last step."),
    "step_time_s": ("step_time_seconds", "Mean step time over the log window, this rank's clock."),
    "tokens_per_s": ("tokens_per_second", "Global tokens per second over the log window, this rank's clock."),
    "samples_per_s": ("samples_per_second", "Global samples per second over the log window, this rank's clock."),
    "tokens_per_s_per_rank": ("tokens_per_second_per_rank", "Tokens per second per rank over the log window."),
    "samples_seen": ("samples_seen", "Samples trained on so far."),
    "mfu": ("mfu", "Model FLOPs utilisation (fraction of the device's peak)."),
    "comm_bytes": ("comm_bytes", "Bytes communicated per step."),
    "loss_scale": ("loss_scale", "fp16 loss scale."),
    "skipped_steps": ("skipped_steps", "Optimizer steps skipped by fp16 overflow so far."),
}
# read at scrape time (gpu.py, the diagnostics): name -> help
LIVE: dict[str, str] = {
    "rss_bytes": "Resident host memory of this rank's process.",
    "cuda_allocated_bytes": "CUDA memory allocated by tensors on this rank's device.",
    "cuda_reserved_bytes": "CUDA memory held by the caching allocator on this rank's device.",
    "gpu_utilization_percent": "GPU utilisation (NVML), percent of the last sample period.",
    "gpu_temperature_celsius": "GPU temperature (NVML).",
    "gpu_memory_used_bytes": "GPU memory used by all processes (NVML).",
    "gpu_power_watts": "GPU power draw (NVML).",
    "nonfinite_skipped_steps": "Steps skipped by diagnostics.nonfinite=skip so far.",
    "restarts": "Elastic restarts of the worker group before this attempt (TORCHELASTIC_RESTART_COUNT).",
}
STRAGGLER_HELP = "Times this rank was named a straggler by the diagnostics' step-time split."


def metric_name(key: str) -> str:
    """The Prometheus name of a record key (a valid name for any key)."""
    name = METRICS[key][0] if key in METRICS else re.sub(r"[^a-zA-Z0-9_]", "_", key)
    return PREFIX + name


class PrometheusExporter:
    """This rank's metrics over HTTP; `write(record)` at log steps, `event(kind, record)` for
    diagnostics findings, `close()` at the end. Also a prometheus-client collector (`collect`)."""

    def __init__(self, *, port: int, addr: str, rank: int, host: str, device: torch.device,
                 counters: Callable[[], dict[str, float]] | None = None) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.rank, self.host, self.device, self.port = rank, host, device, port
        self._counters = counters or dict
        self._values: dict[str, float] = {}
        self._stragglers = 0
        self._lock = threading.Lock()
        self._gpu = GpuSampler.open(device)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # a collector: it has collect()
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise RuntimeError(f"rank {rank}: cannot serve Prometheus metrics on {addr}:{port} ({e}); choose another "
                               "log.prometheus_port (each rank uses the port + its local rank)") from None

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            for key, value in record.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._values[key] = float(value)

    def event(self, kind: str, record: dict[str, Any]) -> None:
        """A diagnostics finding (hub.report): counts the straggler reports that name this rank."""
        if kind == "straggler" and record.get("rank") == self.rank:
            with self._lock:
                self._stragglers += 1

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = [str(self.rank), self.host]
        with self._lock:
            values, stragglers = dict(self._values), self._stragglers
        for key, value in values.items():
            help_text = METRICS[key][1] if key in METRICS else f"The log record's {key!r} value."
            g = GaugeMetricFamily(metric_name(key), help_text, labels=LABELS)
            g.add_metric(labels, value)
            yield g
        live = {**process_memory(self.device), **(self._gpu.sample() if self._gpu else {}), **self._counters()}
        for key, value in live.items():
            if math.isfinite(value):
                g = GaugeMetricFamily(PREFIX + key, LIVE.get(key, key), labels=LABELS)
                g.add_metric(labels, value)
                yield g
        c = CounterMetricFamily(PREFIX + "straggler_reports", STRAGGLER_HELP, labels=LABELS)
        c.add_metric(labels, stragglers)
        yield c

    def close(self, *, finished: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
