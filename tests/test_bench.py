"""`dptrain bench`: end to end at world 1..2, option checking, refusals reported as skipped, the report's arithmetic."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from dptrain.cli.main import main
from dptrain.config.load import load_config
from dptrain.tools.bench import cells as plan
from dptrain.tools.bench import report
from dptrain.train.build import build_model
from support import subprocess_env

TINY = ["model.kwargs.dim=32", "model.kwargs.n_layers=1", "model.kwargs.max_seq_len=32", "data.kwargs.seq_len=32",
        "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=0"]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.timeout(540)  # two torchrun launches: ~2 min with the machine loaded, most of it process start-up
def test_bench_end_to_end_world_1_and_2(tmp_path):
    out = tmp_path / "bench"
    env = subprocess_env(tests=False, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "dptrain", "bench", "--steps", "3", "--warmup", "1", "--nproc", "2",
                        "--variants", "ddp,zero2,dp", "--scaling", "strong", "--out", str(out), *TINY],
                       cwd=tmp_path, capture_output=True, text=True, timeout=530, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for column in ("median ms", "IQR ms", "tokens/s", "scaling eff", "comm/rank", "state MiB/rank", "loss", "vs raw"):
        assert column in r.stdout
    data = json.loads((out / "bench.json").read_text())
    assert {"options", "device", "backend", "peak_rss_mib", "rows", "skipped"} <= data.keys()
    cells = {(row["variant"], row["world"], row["mode"]): row for row in data["rows"]}
    assert set(cells) == {(v, w, m) for v in ("raw", "ddp", "zero2") for w, m in ((1, "base"), (2, "strong"))}
    for row in data["rows"]:
        for key in ("median_s", "q1_s", "q3_s", "min_s", "max_s", "loss", "tokens_per_s", "samples_per_s",
                    "scaling_efficiency", "vs_raw", "state_mib"):
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert len(row["times_s"]) == 3 and row["min_s"] <= row["median_s"] <= row["max_s"]
        assert row["vs_raw"] == pytest.approx(row["median_s"] / cells[("raw", row["world"], row["mode"])]["median_s"])
    assert cells[("raw", 2, "strong")]["vs_raw"] == 1.0
    # comm_bytes: dptrain's meter, bytes one rank sends per step. The raw loop is not metered; at world 1
    # nothing is sent; at world 2 DDP all-reduces the fp32 gradients once per step (no_sync on the other
    # micro-step), 2 (n - 1) / n = 1 x their size under the ring algorithm.
    assert all(row["comm_bytes"] is None for row in data["rows"] if row["variant"] == "raw")
    assert [cells[(v, 1, "base")]["comm_bytes"] for v in ("ddp", "zero2")] == [0.0, 0.0]
    grad_bytes = sum(p.numel() * 4 for p in build_model(load_config(None, TINY).model, seed=0).parameters())
    assert cells[("ddp", 2, "strong")]["comm_bytes"] == grad_bytes
    assert cells[("zero2", 2, "strong")]["comm_bytes"] > 0
    # strong scaling: the same global batch, so the efficiency is T1 / (2 * T2)
    ddp1, ddp2 = cells[("ddp", 1, "base")], cells[("ddp", 2, "strong")]
    assert ddp2["global_batch_size"] == ddp1["global_batch_size"] == 8
    assert ddp2["scaling_efficiency"] == pytest.approx(ddp1["median_s"] / (2 * ddp2["median_s"]))
    # the same batches, the same optimizer: dptrain's ddp lands exactly where the raw DDP loop does
    for world, mode in ((1, "base"), (2, "strong")):
        assert cells[("ddp", world, mode)]["loss"] == cells[("raw", world, mode)]["loss"]
        assert cells[("zero2", world, mode)]["loss"] == pytest.approx(cells[("raw", world, mode)]["loss"], rel=1e-4)
    # ZeRO-2 shards the optimizer state over the 2 ranks
    assert cells[("zero2", 2, "strong")]["state_mib"] < cells[("ddp", 2, "strong")]["state_mib"]
    if not _cuda():  # dp (nn.DataParallel) needs GPUs: listed as skipped with the config's reason, not crashed
        assert [s["variant"] for s in data["skipped"]] == ["dp"]
        assert "needs CUDA GPUs" in data["skipped"][0]["skipped"]
        assert "skipped: dp at world 1" in r.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "step_times.png").stat().st_size > 0 and (out / "scaling.png").stat().st_size > 0
    else:  # the optional extra dptrain[bench] is not installed: said, not crashed
        assert "PNG plots skipped: matplotlib is not installed" in r.stderr


@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "0"], "--steps=0 is not valid"),
    (["--warmup", "-1"], "--warmup=-1 is not valid"),
    (["--nproc", "0"], "--nproc=0 is not valid"),
    (["--scaling", "sideways"], "--scaling='sideways' is not valid; choose one of: none, strong, weak, both"),
    (["--variants", "ddp,nope"], "unknown variant(s) 'nope'; choose from: raw, single, dp, ddp"),
    (["--variants", ","], "(none given)"),
    (["--steps", "many"], "invalid int value"),
    (["parallel.strategy=zero9"], "parallel.strategy='zero9' is not valid"),
    (["launch.nnodes=2", "launch.rdzv_endpoint=h:1"], "dptrain bench runs on one node"),
])
def test_bad_options_exit_2_before_launch(tmp_path, capsys, args, message):
    out = tmp_path / "never"
    assert main(["bench", "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written or launched


def test_refused_cells_are_skipped_with_the_reason():
    cfg = load_config(None, ["train.global_batch_size=8", "train.micro_batch_size=4"])
    opts = plan.parse_options(steps=1, warmup=0, nproc=3, scaling="strong", variants="ddp,single")
    cells = plan.plan_cells(cfg, opts=opts)
    runs = {(c.variant, c.world, c.mode) for c in cells if c.skipped is None}
    assert runs == {("raw", 1, "base"), ("ddp", 1, "base"), ("single", 1, "base"), ("raw", 2, "strong"),
                    ("ddp", 2, "strong")}
    skipped = {(c.variant, c.world): c.skipped for c in cells if c.skipped}
    assert set(skipped) == {("raw", 3), ("ddp", 3)}  # global 8 does not split into micro 4 x 3 ranks
    assert "8" in skipped[("ddp", 3)] and "3" in skipped[("ddp", 3)]
    weak = plan.plan_cells(cfg, opts=plan.parse_options(steps=1, warmup=0, nproc=2, scaling="weak", variants="ddp"))
    assert [(c.world, c.config.train.global_batch_size) for c in weak if c.variant == "ddp"] == [(1, 8), (2, 16)]


@pytest.mark.fast
def test_every_strategy_and_compression_is_a_variant():
    """Written out, not derived from the code under test: the bench's variants in their order."""
    assert plan.all_variants() == ("raw", "single", "dp", "ddp", "zero1", "zero2", "fsdp",
                                   "ddp-fp16", "ddp-bf16", "ddp-powersgd", "ddp-onebit")


@pytest.mark.fast
def test_a_compression_the_backend_cannot_do_is_skipped():
    cfg = load_config(None, ["parallel.device=cpu"])
    opts = plan.parse_options(steps=1, warmup=0, nproc=2, scaling="strong", variants="ddp-bf16,ddp-fp16")
    cells = {(c.variant, c.world): c for c in plan.plan_cells(cfg, opts=opts)}
    assert cells[("ddp-bf16", 2)].skipped and "bf16" in cells[("ddp-bf16", 2)].skipped
    assert cells[("ddp-fp16", 2)].skipped is None


@pytest.mark.fast
def test_report_derives_efficiency_and_ratio():
    def row(variant, world, mode, median, gbs):
        return {"variant": variant, "world": world, "mode": mode, "median_s": median, "q1_s": median, "q3_s": median,
                "global_batch_size": gbs, "tokens_per_sample": 10, "loss": 1.0, "state_mib": 1.0,
                "cuda_peak_mib": None, "comm_bytes": None, "times_s": [median]}
    results = [{"world": 1, "rows": [row("raw", 1, "base", 1.0, 8), row("ddp", 1, "base", 1.1, 8)], "device": "cpu",
                "backend": "gloo", "peak_rss_mib": 1.0},
               {"world": 2, "rows": [row("raw", 2, "strong", 0.8, 8), row("ddp", 2, "strong", 0.55, 8),
                                     row("ddp", 2, "weak", 2.2, 16)], "device": "cpu", "backend": "gloo",
                "peak_rss_mib": 1.0}]
    s = report.summarize(results, skipped=[], opts=plan.BenchOptions())
    got = {(r["variant"], r["world"], r["mode"]): r for r in s["rows"]}
    assert got[("ddp", 2, "strong")]["scaling_efficiency"] == pytest.approx(1.1 / (2 * 0.55))
    assert got[("ddp", 2, "weak")]["scaling_efficiency"] == pytest.approx(0.5)
    assert got[("ddp", 2, "strong")]["vs_raw"] == pytest.approx(0.55 / 0.8)
    assert got[("ddp", 2, "weak")]["vs_raw"] is None  # no raw cell to compare with
    assert got[("ddp", 1, "base")]["tokens_per_s"] == pytest.approx(8 * 10 / 1.1)
    assert report.table_rows(s)[4][10] == "-"
