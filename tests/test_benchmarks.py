"""The benchmarks still run (short versions): they call into the trainer and must not rot. Their index
(docs/guides/benchmarks.md) lists every script, every path naming one exists, and the harness they share
(dptrain.tools.bench.harness) starts and times runs as it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT, subprocess_env
from support.run_helpers import TOY_RUN

KINDS = ("perf", "memory", "acceptance", "planner", "architecture")
SCRIPT = re.compile(r"(?<![\w/])benchmarks/[\w/]+\.(?:py|sh)\b")


def scripts() -> list[Path]:
    """Every benchmark script: benchmarks/<kind>/<name>.py (the fault matrix's faults/ package is its helpers)."""
    return sorted(p for p in (ROOT / "benchmarks").rglob("*.py") if "faults" not in p.relative_to(ROOT).parts)


def named_paths() -> dict[str, set[str]]:
    """benchmarks/....py and .sh paths named in the docs, README, examples, src, tests and CI, by file."""
    files = [*(ROOT / "docs").rglob("*.md"), *(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
             *(ROOT / "examples").rglob("*.*"), ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "mkdocs.yml",
             ROOT / ".ci" / "run"]
    found: dict[str, set[str]] = {}
    for f in files:
        try:
            text = f.read_text()
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        for path in SCRIPT.findall(text):
            found.setdefault(path, set()).add(str(f.relative_to(ROOT)))
    return found


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_every_benchmark_path_named_in_docs_src_and_tests_exists():
    named = named_paths()
    assert "benchmarks/perf/overhead.py" in named and "benchmarks/gpu_check.sh" in named  # the scan sees paths
    missing = {path: sorted(where) for path, where in named.items() if not (ROOT / path).is_file()}
    assert not missing, f"named but not in the checkout (moved? see docs/guides/benchmarks.md): {missing}"


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_every_script_sits_in_a_kind_folder_and_in_the_index():
    index = (ROOT / "docs" / "guides" / "benchmarks.md").read_text()
    listed = set(SCRIPT.findall(index))
    for p in scripts():
        rel = p.relative_to(ROOT).as_posix()
        assert p.parent.name in KINDS, f"{rel}: benchmarks/ holds scripts in folders by kind {KINDS}"
        assert rel in listed, f"{rel} is missing from the index in docs/guides/benchmarks.md"
    assert (ROOT / "benchmarks" / "gpu_check.sh").is_file()  # the team's instructions name this path


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_alternate_runs_every_variant_once_a_round_in_order_and_ratios_pair_rounds():
    from dptrain.tools.bench.harness import Ratios, alternate

    calls: list[str] = []
    got = alternate({"a": lambda: calls.append("a") or len(calls), "b": lambda: calls.append("b") or len(calls)}, 3)
    assert calls == ["a", "b"] * 3
    assert got == {"a": [1, 3, 5], "b": [2, 4, 6]}
    r = Ratios.of([2.0, 3.0, 5.0], [2.0, 2.0, 4.0])
    assert (r.median, r.low, r.high) == (1.25, 1.0, 1.5)
    assert str(r) == "1.250 (1.000-1.500)"
    with pytest.raises(ValueError, match="equally long"):
        Ratios.of([1.0], [1.0, 2.0])


@pytest.mark.timeout(120)
def test_dptrain_run_returns_the_runs_records_and_names_a_failure(tmp_path):
    from dptrain.tools.bench.harness import dptrain_run

    env = subprocess_env(tests=False)
    run = dptrain_run([*TOY_RUN, "train.max_steps=3", "checkpoint.every_steps=0"], nproc=1, out=tmp_path / "ok",
                      env=env, timeout=110)
    assert run.returncode == 0
    assert [r["step"] for r in run.steps()] == [1, 2, 3]
    assert len(run.step_times(after=1)) == 2
    assert run.summary()["final_loss"] == run.steps()[-1]["loss"]

    bad = [*TOY_RUN, "train.max_steps=three"]
    refused = dptrain_run(bad, out=tmp_path / "bad", check=False, env=env, timeout=60)
    assert refused.returncode == 2 and "train.max_steps" in refused.output
    with pytest.raises(RuntimeError, match="exited 2"):
        dptrain_run(bad, out=tmp_path / "bad2", env=env, timeout=60)
    late = dptrain_run(bad, out=tmp_path / "late", check=False, env=env, timeout=0.01)
    assert late.returncode == 124 and late.output.startswith("timed out after")


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
