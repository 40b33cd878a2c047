"""The benchmarks still run (short versions): they call into the trainer and must not rot."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support import ROOT, subprocess_env


@pytest.mark.timeout(180)
def test_overhead_benchmark_runs_and_weights_match():
    r = subprocess.run([sys.executable, "benchmarks/perf/overhead.py", "--steps", "4", "--warmup", "1", "--dim", "32",
                        "--layers", "1", "--seq", "32"], cwd=ROOT, capture_output=True, text=True, timeout=170,
                       env=subprocess_env(tests=False))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ratio dptrain / raw" in r.stdout
    assert "per-step losses identical: True; final weights identical: True" in r.stdout


@pytest.mark.timeout(180)
def test_diagnostics_overhead_benchmark_runs():
    env = subprocess_env(tests=False)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "benchmarks/perf/diagnostics_overhead.py", "--rounds", "2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=170, env=env)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.timeout(240)
def test_meta_init_memory_benchmark_runs_and_weights_match():
    env = subprocess_env(tests=False)
    r = subprocess.run([sys.executable, "benchmarks/memory/meta_init_memory.py", "--vocab", "64", "--dim", "32",
                        "--layers", "2"], cwd=ROOT, capture_output=True, text=True, timeout=230, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("peak RSS") == 4
    assert "weights identical (SHA-256 of the gathered state dict): True" in r.stdout


@pytest.mark.timeout(180)
def test_tp_comm_benchmark_matches_theory():
    env = subprocess_env(tests=False)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "benchmarks/perf/tp_comm.py", "--dim", "32", "--seq", "16", "--batch", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=170, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "per-block bytes equal theory: True" in r.stdout


@pytest.mark.timeout(240)
def test_pipeline_bubble_benchmark_runs():
    env = subprocess_env(tests=False)
    r = subprocess.run(
        [
            sys.executable,
            "benchmarks/perf/pipeline_bubble.py",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--dim",
            "32",
            "--layers",
            "2",
            "--seq",
            "16",
            "--microbatches",
            "2,4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=230,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith(("| gpipe", "| 1f1b"))]
    assert len(rows) == 4
    assert [row.split("|")[-2].strip() for row in rows] == ["0.333", "0.200", "0.333", "0.200"]  # theory column


@pytest.mark.timeout(300)
def test_finetune_memory_benchmark_samples_every_rank_of_a_real_run():
    pytest.importorskip("peft")
    pytest.importorskip("psutil")
    r = subprocess.run([sys.executable, "benchmarks/memory/finetune_memory.py", "--params", "2e5", "--nproc", "2",
                        "--lora"],
                       cwd=ROOT, capture_output=True, text=True, timeout=290, env=subprocess_env(tests=False))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "LoRA r=8, adamw, fsdp, 2 steps, factory eager" in r.stdout
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("| ")}
    assert {"rank 0", "rank 1", "launcher"} <= set(rows), r.stdout
    peak = float(rows["rank 0"].split("|")[2])  # GB: a worker with torch and transformers imported holds some
    assert 0.1 < peak < 3.0
