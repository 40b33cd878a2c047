"""End-to-end: the `dptrain` command as a user runs it (real torchrun, real processes)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from support import ROOT
from support.cli import refused
from support.run_helpers import dptrain

TINY = [
    "model.kwargs.dim=32", "model.kwargs.n_layers=2", "model.kwargs.n_heads=2", "model.kwargs.max_seq_len=32",
    "data.kwargs.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
    "train.log_every_steps=2", "train.eval_every_steps=4", "train.eval_batches=2",
]


@pytest.mark.timeout(240)
def test_run_two_processes_writes_the_run_directory(tmp_path):
    out = tmp_path / "run"
    r = dptrain("run", *TINY, "train.max_steps=6", "--nproc-per-node", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dptrain run summary" in r.stdout
    assert r.stdout.count("val loss") >= 2  # evaluated at the start and the end, printed once (rank 0)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4, 6]
    for rec in steps:
        assert {"step", "loss", "lr", "tokens_per_s", "samples_per_s"} <= rec.keys()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == 2 and summary["strategy"] == "ddp"
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    assert {"final_loss", "wall_s"} <= summary.keys()
    # the consolidated weights carry the plain module's names
    from dptrain.config.load import load_config
    from dptrain.train.build import build_model

    cfg = load_config(out / "config.yaml")
    names = set(build_model(cfg.model, seed=0).state_dict())
    assert set(load_file(out / "final" / "model.safetensors")) == names
    # and the model samples text
    g = dptrain("generate", str(out), "--prompt", "def ", "--max-new-tokens", "20")
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("def ")


@pytest.mark.timeout(240)
def test_run_fsdp_single_strategy_and_deepspeed_json(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.002}},
        "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "wall_clock_breakdown": False,
    }))
    out = tmp_path / "fsdp"
    tiny = [t for t in TINY if "batch_size" not in t]
    r = dptrain("run", str(ds), *tiny, "train.max_steps=4", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wall_clock_breakdown" in r.stderr  # unknown DeepSpeed keys are named, not dropped
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "fsdp" and summary["precision"] == "bf16" and summary["world_size"] == 2
    assert len(load_file(out / "final" / "model.safetensors")) > 0

    out1 = tmp_path / "single"
    r = dptrain("run", *TINY, "train.max_steps=2", "parallel.strategy=single", "--out", str(out1))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out1 / "summary.json").read_text())["world_size"] == 1


@pytest.mark.timeout(60)
def test_inconsistent_batch_is_refused_before_any_process_starts(tmp_path):
    r = dptrain("run", "train.global_batch_size=16", "train.micro_batch_size=4", "train.grad_accum_steps=8",
                "--nproc-per-node", "2", "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    assert "16 != 4 * 8 * 2" in r.stderr
    assert "micro_batch_size=" in r.stderr  # valid alternatives are offered
    assert not (tmp_path / "x").exists()


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_bad_input_errors_exit_2_and_name_the_value(tmp_path, capsys):
    """In this process (the exit code's way out of `python -m dptrain` is the subprocess test above)."""
    x = str(tmp_path / "x")
    refused(capsys, ["run", "train.max_step=5", "--out", x], "train.max_step", "max_steps")
    refused(capsys, ["run", "parallel.strategy=dp", "--out", x], "CUDA", "ddp")
    refused(capsys, ["run", str(tmp_path / "missing.yaml")], "missing.yaml")
    refused(capsys, ["run", "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs.n=10",
                     "model.factory=dptrain.models.toy:build_mlp", "--out", x], "10", "32")
    refused(capsys, ["run", "model.factory=nosuch.module:fn", "--out", x], "nosuch.module")


@pytest.mark.timeout(60)
def test_config_show_prints_resolved_values():
    r = dptrain("config", "show", "train.global_batch_size=64", "train.micro_batch_size=8", "optim.lr_scaling=linear",
                "optim.base_batch_size=32",
                "--nproc-per-node", "2")
    assert r.returncode == 0, r.stderr
    assert "grad_accum_steps: 4" in r.stdout  # 64 = 8 * 4 * 2
    assert "lr * G / base" in r.stdout


@pytest.mark.timeout(120)
def test_launch_runs_a_users_own_loop():
    r = dptrain("launch", "--nproc-per-node", "2", "examples/own_loop.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("done") == 1  # rank 0 only


@pytest.mark.timeout(30)
def test_docs_config_reference_matches_the_code():
    from dptrain.cli.main import config_reference

    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    start = page.index("<!-- config-reference:start -->\n") + len("<!-- config-reference:start -->\n")
    assert page[start:page.index("<!-- config-reference:end -->")] == config_reference(), (
        "docs/reference/config.md is stale: regenerate the block between its markers with `dptrain config docs`"
    )


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_launch_fills_in_only_the_torchrun_defaults_the_user_left_out():
    from dptrain.launch.torchrun import user_script_args

    assert user_script_args(["train.py", "--lr", "1"], default_nproc=2) == [
        "--nproc-per-node", "2", "--standalone", "train.py", "--lr", "1"]
    # options that take a value are told apart from the script by torchrun's own parser
    assert user_script_args(["--max-restarts", "1", "--nproc-per-node", "3", "train.py"], default_nproc=2) == [
        "--standalone", "--max-restarts", "1", "--nproc-per-node", "3", "train.py"]
    given = ["--nnodes", "2", "--rdzv-endpoint", "h:29500", "train.py"]
    assert user_script_args(given, default_nproc=4) == ["--nproc-per-node", "4", *given]


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_launch_reads_restarts_only_from_torchrun_options_before_the_script():
    from dptrain.cli.script import _wants_restarts

    assert not _wants_restarts(["--nproc-per-node", "2", "train.py", "--max-restarts", "3"])  # the script's own flag
    assert not _wants_restarts(["--standalone", "train.py", "--max_restarts=3"])
    assert _wants_restarts(["--max-restarts", "2", "train.py"])
    assert _wants_restarts(["--standalone", "--max_restarts=1", "--nproc-per-node", "2", "train.py"])
    assert not _wants_restarts(["--max-restarts", "0", "train.py"])


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_launch_checks_nproc_only_before_the_script_told_apart_by_torchruns_parser():
    from dptrain.cli.script import _check_nproc_option
    from dptrain.config import ConfigError

    # --standalone takes no value: s.py is the script, and its own --nproc-per-node is not torchrun's
    _check_nproc_option(["--standalone", "s.py", "--nproc-per-node", "zz"])
    _check_nproc_option(["--nnodes", "1", "--no-python", "s.py", "--nproc-per-node", "zz"])
    _check_nproc_option(["--nproc-per-node=2", "s.py", "--nproc-per-node", "zz"])
    with pytest.raises(ConfigError, match="'zz'"):
        _check_nproc_option(["--standalone", "--nproc-per-node", "zz", "s.py"])
    with pytest.raises(ConfigError, match="'0'"):
        _check_nproc_option(["--max-restarts", "1", "--nproc_per_node=0", "s.py"])


CRASHING_SCRIPT = '''
import sys
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise RuntimeError(f"boom on rank 1 with {sys.argv[1:]}")
dist.barrier()
'''


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_launch_failure_keeps_torchruns_root_cause_report(tmp_path):
    """A rank that raises: torchrun's report (root cause: its rank, exit code, error file holding the
    traceback) is printed, then dptrain's one line naming the script's status. The script's own --max-restarts is
    its own."""
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_SCRIPT)
    r = dptrain("launch", "--nproc-per-node", "2", str(script), "--max-restarts", "3")
    assert r.returncode == 1, r.stderr[-3000:]
    root = r.stderr[r.stderr.index("Root Cause (first observed failure):"):]
    assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : 1" in root
    assert "error_file:" in root and "error.json" in root
    assert "RuntimeError: boom on rank 1 with ['--max-restarts', '3']" in root  # the traceback, from the error file
    assert 'crash.py", line 7' in root
    assert f"{script} FAILED" in r.stderr  # titled by the user's script, not dptrain's shim
    assert "dptrain: your script exited with status 1 on rank 1" in r.stderr  # the script's status, as its own
    assert "will restart worker group" not in r.stderr  # the script's --max-restarts is not torchrun's


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_run_failure_report_names_the_raising_rank_and_its_traceback(tmp_path):
    """dptrain's own worker runs under `record`: the report's root cause is the rank that raised, with its traceback."""
    r = dptrain(
        "run",
        "model.factory=dptrain.models.toy:build_mlp",
        "data.factory=dptrain.models.toy:build_regression_data",
        "train.loss=support.bad_factories:fails_on_rank_1",
        "train.max_steps=3",
        "--nproc-per-node",
        "2",
        "--out",
        str(tmp_path / "run"),
    )
    assert r.returncode == 1, r.stderr[-3000:]
    root = r.stderr[r.stderr.index("Root Cause (first observed failure):") :]
    assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : 1" in root
    assert "ValueError: user bug: loss exploded on rank 1" in root and 'bad_factories.py", line' in root
    assert "dptrain: worker(s) failed:" in r.stderr


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_launch_runs_plain_scripts_under_record_and_leaves_other_commands_alone():
    from dptrain.launch.torchrun import record_failures

    assert record_failures(["--nproc-per-node", "2", "--standalone", "t.py", "--lr", "1"]) == [
        "--nproc-per-node",
        "2",
        "--standalone",
        "--module",
        "dptrain.launch.record_script",
        "t.py",
        "--lr",
        "1",
    ]
    for given in (
        ["--standalone", "-m", "pkg.train"],
        ["--no-python", "bash", "x.py"],
        ["--run-path", "t.py"],
        ["--standalone", "train.sh"],
        ["--standalone"],
    ):
        assert record_failures(given) == given
