"""Monitoring against its real partners: TensorBoard's own event reader, a real Prometheus server
(Debian's package) scraping a 2-rank run over loopback and queried over its HTTP API, the shipped
Grafana dashboard's every PromQL expression, RUN_DIR/console.log of a real `dptrain run`, and
`dptrain top` rendering real run directories (finished, and live while both ranks are held)."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dptrain.cli.main import main as cli_main
from dptrain.metrics.monitor import DASHBOARD
from dptrain.metrics.prometheus import PrometheusExporter, metric_name
from support import overrides
from support.diag_helpers import TP_LLAMA
from support.monitor_helpers import PROMETHEUS, SCRAPE_S, Prometheus, free_port_pair
from support.mp import find_free_port, run_ranks
from support.run_helpers import dptrain

LM = overrides(TP_LLAMA, ["train.micro_batch_size=2"])  # global batch 4 = 2 x dp 2; tokens/s in every record
HOST = socket.gethostname()
# Always exported on every rank (besides one gauge per numeric record key, checked from metrics.jsonl).
EXPECTED = ["dptrain_rss_bytes", "dptrain_nonfinite_skipped_steps", "dptrain_restarts",
            "dptrain_straggler_reports_total", "dptrain_val_loss", "dptrain_tokens_per_second",
            "dptrain_step_time_seconds", "dptrain_learning_rate", "dptrain_loss"]
GPU_ONLY = re.compile(r"dptrain_(gpu|cuda)_\w+")


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _numeric(record: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}


# ---------------------------------------------------------------------------- exporter, in this process
@pytest.mark.fast
@pytest.mark.timeout(60)
def test_exporter_exports_every_numeric_key_and_counts_stragglers():
    from prometheus_client.parser import text_string_to_metric_families

    port = find_free_port()
    exp = PrometheusExporter(port=port, addr="127.0.0.1", rank=1, host="h1", device=torch.device("cpu"),
                             counters=lambda: {"nonfinite_skipped_steps": 2.0, "restarts": 1.0})
    try:
        exp.write({"step": 3, "loss": 1.25, "mfu": 0.375, "comm_bytes": 4096, "a new meter": 7, "strategy": "ddp",
                   "flag": True})
        exp.event("straggler", {"rank": 1, "host": "h1"})
        exp.event("straggler", {"rank": 0, "host": "h0"})  # another rank named: not this rank's count
        exp.event("memory", {"rank": 1})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        exp.close()
    samples = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert {s.labels["rank"] for s in samples.values()} == {"1"} and {s.labels["host"] for s in samples.values()} == {
        "h1"
    }
    values = {name: s.value for name, s in samples.items()}
    assert values["dptrain_step"] == 3 and values["dptrain_loss"] == 1.25
    assert values["dptrain_mfu"] == 0.375 and values["dptrain_comm_bytes"] == 4096
    assert values["dptrain_a_new_meter"] == 7  # a key no table knows still appears
    assert values["dptrain_straggler_reports_total"] == 1
    assert values["dptrain_nonfinite_skipped_steps"] == 2 and values["dptrain_restarts"] == 1
    assert values["dptrain_rss_bytes"] > 0
    assert not any("strategy" in n or "flag" in n for n in values)
    assert not any(GPU_ONLY.fullmatch(n) for n in values), "no GPU/CUDA metric on a CPU rank"


@pytest.mark.fast
def test_gpu_sampler_is_absent_on_cpu():
    from dptrain.metrics.gpu import GpuSampler

    assert GpuSampler.open(torch.device("cpu")) is None


@pytest.mark.fast
def test_gpu_sampler_units_and_unsupported_readings():
    """The NVML calls' results as exported (no GPU here: NVML's answers given by a stand-in module)."""
    from types import SimpleNamespace

    from dptrain.metrics.gpu import GpuSampler

    class NVMLError(Exception):
        pass

    def no_power(handle):
        raise NVMLError("Not Supported")

    nvml = SimpleNamespace(
        NVMLError=NVMLError,
        NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=87, memory=40),
        nvmlDeviceGetTemperature=lambda h, sensor: 64,
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=3 * 2**30, total=80 * 2**30),
        nvmlDeviceGetPowerUsage=lambda h: 412_500,
    )  # milliwatts
    assert GpuSampler(nvml, "h").sample() == {
        "gpu_utilization_percent": 87.0,
        "gpu_temperature_celsius": 64.0,
        "gpu_memory_used_bytes": float(3 * 2**30),
        "gpu_power_watts": 412.5,
    }
    nvml.nvmlDeviceGetPowerUsage = no_power
    assert "gpu_power_watts" not in GpuSampler(nvml, "h").sample()  # left out, not zero


@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["tensorboard", "prometheus"])
def test_missing_package_is_refused_before_launch(what, tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    missing = {"tensorboard": "tensorboard", "prometheus": "prometheus_client"}[what]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    switch = "log.tensorboard=true" if what == "tensorboard" else "log.prometheus_port=9400"
    assert cli_main(["run", "--out", str(tmp_path / "r"), *LM, switch]) == 2
    err = capsys.readouterr().err
    assert switch in err and "dptrain[monitor]" in err and "not installed" in err
    assert not (tmp_path / "r").exists()  # refused before anything was written or launched


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_bad_or_busy_prometheus_port_is_refused(tmp_path, capsys):
    assert cli_main(["run", "--out", str(tmp_path / "a"), *LM, "log.prometheus_port=70000"]) == 2
    assert "log.prometheus_port=70000 is not valid" in capsys.readouterr().err
    assert (
        cli_main(["run", "--out", str(tmp_path / "b"), *LM, "--nproc-per-node", "2", "log.prometheus_port=65535"]) == 2
    )
    assert "past 65535" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        code = cli_main(
            [
                "run",
                "--out",
                str(tmp_path / "c"),
                *LM,
                "--nproc-per-node",
                "1",
                f"log.prometheus_port={busy}",
                "log.prometheus_addr=127.0.0.1",
            ]
        )
    assert code == 2
    assert f"port {busy} on 127.0.0.1 (local rank 0) is not free" in capsys.readouterr().err


# ---------------------------------------------------------------------------- console.log, the tty path
@pytest.mark.fast
def test_console_log_keeps_each_redrawn_line_once_without_escapes(tmp_path, monkeypatch):
    from dptrain.metrics.console_log import console_log
    from dptrain.metrics.sinks import ConsoleSink

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr("sys.stdout", term)
    with console_log(tmp_path):
        sink = ConsoleSink(max_steps=3)  # on a terminal: "\r\033[K" + line, redrawn in place
        assert sink.tty
        for step in (1, 2, 3):
            sink.write({"step": step, "loss": 1.0 / step, "lr": 0.1, "samples_per_s": 10.0})
        sink.message("\033[1;31mevaluation\033[0m done")
        sink.close()
        print("tail without newline", end="")
    assert "\r" in term.getvalue() and "\033[K" in term.getvalue()  # the console got the redraws
    log = (tmp_path / "console.log").read_text()
    assert "\033" not in log and "\r" not in log
    lines = log.splitlines()
    assert [ln.split()[1] for ln in lines[:3]] == ["1/3", "2/3", "3/3"]
    assert lines[3:] == ["evaluation done", "tail without newline"]


# ---------------------------------------------------------------------------- a real `dptrain run`
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, Any]:
    """`dptrain run` on 2 ranks (torchrun), TensorBoard on, stdout not a terminal."""
    run = tmp_path_factory.mktemp("monitor") / "run"
    proc = dptrain(
        "run", "--out", str(run), "--nproc-per-node", "2", *LM, "train.max_steps=6", "log.tensorboard=true", timeout=280
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run, proc


@pytest.mark.timeout(300)
def test_tensorboard_events_equal_metrics_jsonl(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = finished_run
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    expected: dict[str, dict[int, float]] = {}
    for record in _records(run):
        for key, value in _numeric(record).items():
            if key != "step":
                expected.setdefault(key, {})[record["step"]] = value
    assert {"loss", "lr", "tokens_per_s", "step_time_s", "val_loss"} <= set(expected)
    assert set(acc.Tags()["scalars"]) == set(expected)
    for key, by_step in expected.items():
        got = {e.step: e.value for e in acc.Scalars(key)}
        assert got == {s: float(np.float32(v)) for s, v in by_step.items()}, key  # TensorBoard stores float32


@pytest.mark.timeout(300)
def test_console_log_holds_what_rank0_printed(finished_run):
    run, proc = finished_run
    log = (run / "console.log").read_text()
    assert "\033" not in log and "\r" not in log
    lines = log.splitlines()
    printed = [ln.rstrip() for ln in proc.stdout.splitlines() if ln.strip()]
    assert printed and all(ln in lines for ln in printed), (printed, lines)
    progress = [ln for ln in printed if re.match(r"step +\d+/", ln)]
    assert [ln.split()[1] for ln in progress] == ["2/6", "4/6", "6/6"]
    assert [ln for ln in lines if re.match(r"step +\d+/", ln)] == progress  # each once, in order
    assert "step 0: val loss" in log and "step 6: val loss" in log  # the evaluation messages
    assert any("standalone rendezvous" in ln for ln in lines)  # the launcher's own line
    assert any("checkpoint" in ln and "committed" in ln for ln in lines)  # rank 0's stderr
    assert any("dptrain run summary" in ln for ln in lines)  # the rich table


@pytest.mark.timeout(300)
def test_top_renders_finished_run(finished_run, capsys, tmp_path):
    from dptrain.cli.top import render_text

    run, _ = finished_run
    frame = render_text(run)
    last = [r for r in _records(run) if "loss" in r][-1]
    assert "step 6/6" in frame and f"loss {last['loss']:.4f}" in frame and "finished" in frame
    rows = [ln for ln in frame.splitlines() if HOST in ln]
    assert len(rows) == 2 and all(" done " in ln and " 6 " in ln for ln in rows), frame
    assert cli_main(["top", str(run), "--once"]) == 0
    # the same directory resumed on one rank: rank 1's file of the 2-rank attempt is no longer shown
    import shutil

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    status = json.loads((resumed / "status" / "rank0.json").read_text())
    status.update(world_size=1, started=status["started"] + 100, time=status["time"] + 100)
    (resumed / "status" / "rank0.json").write_text(json.dumps(status))
    assert len([ln for ln in render_text(resumed).splitlines() if HOST in ln]) == 1
    assert "dptrain top" in capsys.readouterr().out
    assert cli_main(["top", str(run / "nope"), "--once"]) == 2


# ---------------------------------------------------------------------------- Prometheus + Grafana
def _train_held(rank: int, out_dir: str, port: int) -> dict:
    from dptrain.config.load import load_config
    from dptrain.train.trainer import Trainer

    cfg = load_config(
        None,
        [
            *LM,
            "log.progress=false",
            "train.max_steps=8",
            "train.loss=support.monitor_helpers:held_loss",
            f"log.prometheus_port={port}",
            "log.prometheus_addr=127.0.0.1",
            "log.status_every_s=0.5",
            "diagnostics.hang_timeout_s=0",
        ],
    )  # the hold is a deliberate stall, not a hang to report
    return Trainer(cfg, out_dir=out_dir).fit()


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def _substitute(expr: str) -> str:
    """Grafana's template variables at their 'All' value."""
    return expr.replace("$rank", ".*").replace("$host", ".*")


def _check_live(prom: Prometheus, run: Path, results: dict[str, Any]) -> None:
    """While both ranks are held at step 7 (last log step 6): every query, recorded for the test."""
    deadline = time.monotonic() + 240  # generous: this machine is shared and often loaded
    while time.monotonic() < deadline:
        steps = prom.query("dptrain_step")
        if len(steps) == 2 and all(s["value"][1] == "6" for s in steps):
            break
        time.sleep(0.5)
    time.sleep(SCRAPE_S + 0.5)  # one more scrape, so every gauge of step 6 is in
    records = _records(run)
    names = set(EXPECTED) | {metric_name(k) for r in records for k in _numeric(r)}
    results["per_rank"] = {
        n: sorted((s["metric"]["rank"], s["metric"]["host"], s["metric"]["job"]) for s in prom.query(n))
        for n in sorted(names)
    }
    results["loss"] = {s["metric"]["rank"]: float(s["value"][1]) for s in prom.query("dptrain_loss")}
    results["step_time"] = {s["metric"]["rank"]: float(s["value"][1]) for s in prom.query("dptrain_step_time_seconds")}
    results["records"] = records
    results["dashboard"] = {expr: prom.query(_substitute(expr)) for _, expr in _dashboard_exprs()}
    results["rank_values"] = prom.api("label/rank/values", **{"match[]": "dptrain_step"})
    from dptrain.cli.top import render_text

    results["top"] = render_text(run)
    results["top_later"] = render_text(run, now=time.time() + 60)  # as if a minute passed without news


@pytest.mark.timeout(480)
@pytest.mark.skipif(
    not os.access(PROMETHEUS, os.X_OK),
    reason=f"no Prometheus server binary at {PROMETHEUS} (Debian package `prometheus`)",
)
def test_prometheus_scrapes_each_rank_and_the_dashboard_has_data(tmp_path):
    port = free_port_pair()
    prom = Prometheus(tmp_path / "prom", [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"])
    run, hold = tmp_path / "run", tmp_path / "release"
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def check() -> None:
        try:
            prom.wait_ready()
            _check_live(prom, run, results)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
        finally:
            hold.touch()  # let the ranks finish whatever happened

    try:
        checker = threading.Thread(target=check, daemon=True)
        checker.start()
        run_ranks(_train_held, 2, str(run), port, timeout=400, env={"HOLD_CALL": "7", "HOLD_FILE": str(hold)})
        checker.join(30)
    finally:
        prom.stop()
    if errors:
        raise errors[0]
    # every metric, per rank, labelled with rank and host
    for name, series in results["per_rank"].items():
        assert series == [("0", HOST, "dptrain"), ("1", HOST, "dptrain")], name
    step6 = next(r for r in results["records"] if r.get("step") == 6 and "loss" in r)
    assert results["loss"] == {"0": step6["loss"], "1": step6["loss"]}  # the value of metrics.jsonl, exactly
    assert results["step_time"]["0"] == step6["step_time_s"]  # rank 0's own clock is what metrics.jsonl holds
    assert results["step_time"]["1"] > 0  # rank 1's own clock
    assert results["rank_values"] == ["0", "1"]  # the dashboard's rank variable
    # the dashboard: every expression returns data, except GPU-only ones on this CPU run and meters no record has yet
    keys = {k for r in results["records"] for k in r}
    checked, gpu_only, pending = [], [], []
    for title, expr in _dashboard_exprs():
        result = results["dashboard"][expr]
        if GPU_ONLY.search(expr) and not torch.cuda.is_available():
            assert result == [], (title, expr)  # absent cleanly on the CPU, not zeros
            gpu_only.append(expr)
        elif "dptrain_mfu" in expr and "mfu" not in keys:
            assert result == [], (title, expr)  # appears once the records carry `mfu` (then it must have data)
            pending.append(expr)
        else:
            assert result, (title, expr)
            if "by (" not in expr and not expr.startswith(("avg(", "max(", "sum(")):
                assert {s["metric"]["rank"] for s in result} == {"0", "1"}, (title, expr)
            checked.append(expr)
    assert len(gpu_only) == 5 and len(checked) >= 15, (checked, gpu_only, pending)
    # dptrain top on the live run: both ranks held in the forward of step 7, with fresh status files
    rows = [ln for ln in results["top"].splitlines() if HOST in ln]
    assert len(rows) == 2 and all(" 7 " in ln and "forward" in ln and "STALE" not in ln for ln in rows), results["top"]
    assert sum("STALE" in ln for ln in results["top_later"].splitlines()) == 2, results["top_later"]
