"""The planner's time model and what calibrates it (plan/timing.py, calibrate.py, predict.py):
alpha and beta fitted to a sweep, DDP's buckets and their overlap with backward, the efficiency of
a finished run, the scaling table, the torchtitan throughput point, bad input."""

from __future__ import annotations

import json
import math

import pytest

from dptrain.cli.main import main
from dptrain.cli.plan import DEFAULT_EFFICIENCY
from dptrain.metrics import hardware as specs
from dptrain.models.llama import LlamaConfig
from dptrain.tools.plan import calibrate, predict, timing
from dptrain.tools.plan.llama import param_counts, param_shapes
from dptrain.tools.plan.memory import Layout

pytestmark = pytest.mark.fast

SIZES = [4 * 2**10 * 4**i for i in range(8)]


def _sweep(link: timing.Link, n: int, noise: list[float] | None = None) -> dict:
    rows = [{"bytes": s, "seconds": timing.all_reduce_time(s, n, link) * (1 + (noise or [0] * 8)[i])}
            for i, s in enumerate(SIZES)]
    return {"kind": "dptrain.commcheck", "ranks": n, "backend": "gloo", "hosts": ["a"] * n, "all_reduce": rows}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_alpha_beta_recovered_from_a_sweep(n):
    link = timing.Link(bandwidth=1.25e9, alpha=40e-6)
    got = calibrate.link_from_sweep(_sweep(link, n))
    assert got.bandwidth == pytest.approx(link.bandwidth, rel=1e-9) and got.alpha == pytest.approx(link.alpha, rel=1e-9)
    noisy = calibrate.link_from_sweep(_sweep(link, n, [0.05, -0.05, 0.03, -0.02, 0.04, -0.05, 0.02, -0.03]))
    assert noisy.bandwidth == pytest.approx(link.bandwidth, rel=0.1) and noisy.alpha == pytest.approx(
        link.alpha, rel=0.2
    )


@pytest.mark.timeout(30)
def test_bad_sweeps_are_refused_naming_the_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"kind": "other"}')
    for path, words in [(bad, ["dptrain.commcheck"]), (tmp_path / "none.json", ["cannot read", "--json"])]:
        with pytest.raises(ValueError) as e:
            calibrate.load_sweep(path)
        assert str(path) in str(e.value) and all(w in str(e.value) for w in words)
    flat = _sweep(timing.Link(1e9, 1e-5), 2)
    for row in flat["all_reduce"]:
        row["seconds"] = 1e-3
    with pytest.raises(ValueError, match="do not grow"):
        calibrate.link_from_sweep(flat)


@pytest.mark.timeout(30)
def test_ddp_buckets_and_their_overlap_with_backward():
    assert timing.ddp_buckets(3.5 * 2**20, 1.0) == [2**20, 2**20, 2**20, 0.5 * 2**20]
    assert timing.ddp_buckets(0.5 * 2**20, 25) == [0.5 * 2**20]
    link = timing.Link(bandwidth=1e9, alpha=0.0)
    one = [10e6]  # one bucket: ready when backward ends, all of it exposed
    assert timing.bucket_overlap(one, 2, link, backward=1.0) == pytest.approx((0.01, 0.01))
    many = [1e6] * 100  # 100 MB in 100 buckets over a 1 s backward: the link keeps up, only the last is exposed
    busy, exposed = timing.bucket_overlap(many, 2, link, backward=1.0)
    assert busy == pytest.approx(0.1) and exposed == pytest.approx(0.001)
    slow = timing.Link(bandwidth=1e7, alpha=0.0)  # 10 s on the link: 9 s past the end of a 1 s backward (+ 0.01)
    busy, exposed = timing.bucket_overlap(many, 2, slow, backward=1.0)
    assert busy == pytest.approx(10.0) and exposed == pytest.approx(9.0, rel=0.01)


def _lay(**kw) -> Layout:
    base = dict(
        strategy="ddp",
        dp_shard=1,
        tp=1,
        pp=1,
        micro_batch=8,
        seq=128,
        precision="fp32",
        optimizer="adamw",
        bucket_cap_mb=5.0,
    )
    return Layout(**{**base, **kw})


@pytest.mark.timeout(30)
def test_the_cpu_overlaps_nothing_a_gpu_hides_buckets_behind_backward():
    cfg = LlamaConfig(vocab_size=256, dim=512, n_layers=8, n_heads=8, max_seq_len=128)
    link = timing.Link(bandwidth=1e9, alpha=1e-4)
    n = param_counts(cfg).total
    gpu = specs.gpu_spec("A100-40GB")
    cpu = specs.GpuSpec("cpu", "", "CPU", 16, dict(gpu.peaks), 0, 0)
    g = timing.step_time(cfg, _lay(), gpu, gpus=2, nodes=1, interconnect="nvlink", accum=1, efficiency=0.5, comm=link)
    c = timing.step_time(cfg, _lay(), cpu, gpus=2, nodes=1, interconnect="nvlink", accum=1, efficiency=0.5, comm=link)
    assert (
        g["dp_comm"]
        == c["dp_comm"]
        == pytest.approx(sum(timing.all_reduce_time(b, 2, link) for b in timing.ddp_buckets(4 * n, 5.0)))
    )
    assert c["exposed_comm"] == c["dp_comm"] and c["step"] == pytest.approx(c["compute"] + c["dp_comm"])
    assert g["exposed_comm"] < g["dp_comm"]
    z1 = timing.step_time(
        cfg, _lay(strategy="zero1"), cpu, gpus=2, nodes=1, interconnect="nvlink", accum=1, efficiency=0.5, comm=link
    )
    assert z1["dp_comm"] == pytest.approx(c["dp_comm"] + timing.gather_time(4 * n, 2, link))
    half = timing.step_time(
        cfg, _lay(grad_dtype="fp16"), cpu, gpus=2, nodes=1, interconnect="nvlink", accum=1, efficiency=0.5, comm=link
    )
    assert half["dp_comm"] < 0.6 * c["dp_comm"]  # fp16 gradients: half the bytes, the same alphas
    fsdp = timing.step_time(
        cfg,
        _lay(strategy="fsdp", dp_shard=2),
        cpu,
        gpus=2,
        nodes=1,
        interconnect="nvlink",
        accum=4,
        efficiency=0.5,
        comm=link,
    )
    bf16 = timing.step_time(
        cfg,
        _lay(strategy="fsdp", dp_shard=2, param_dtype="bf16", reduce_dtype="fp32"),
        cpu,
        gpus=2,
        nodes=1,
        interconnect="nvlink",
        accum=4,
        efficiency=0.5,
        comm=link,
    )
    gather = timing.gather_time(4 * n, 2, link)
    assert fsdp["dp_comm"] == pytest.approx(4 * 2 * gather + gather)  # 2 gathers per micro-step, 1 reduce-scatter
    assert bf16["dp_comm"] == pytest.approx(4 * 2 * timing.gather_time(2 * n, 2, link) + gather)


@pytest.mark.timeout(30)
def test_torchtitan_llama3_8b_on_8_h100_within_15_percent():
    # torchtitan docs/performance.md, table 1: Llama 3.1 8B, 8 H100s, FSDP, local batch 2 x 8192 tokens,
    # selective activation checkpointing, bf16 parameters for compute and fp32 reduction: 5,762 tokens/s per GPU
    cfg = LlamaConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, max_seq_len=8192
    )
    lay = _lay(
        strategy="fsdp",
        dp_shard=8,
        micro_batch=2,
        seq=8192,
        precision="bf16",
        checkpointing="selective",
        param_dtype="bf16",
        reduce_dtype="fp32",
    )
    t = timing.step_time(
        cfg, lay, specs.gpu_spec("H100"), gpus=8, nodes=1, interconnect="nvlink", accum=1, efficiency=DEFAULT_EFFICIENCY
    )
    assert abs(t["tokens_per_s"] / 8 / 5762 - 1) < 0.15
    assert t["exposed_comm"] < 0.01 * t["step"]  # FSDP's gathers hide behind 2.5 s of compute on NVLink


@pytest.mark.timeout(30)
def test_efficiency_from_a_run_directory(tmp_path):
    steps = [{"step": i, "mfu": 0.3, "step_time_s": 1.0, "exposed_comm_s": 0.25, "loss": 1.0} for i in range(1, 9)]
    steps[0]["mfu"] = 0.01  # warm-up: left out
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"step": 0, "val_loss": 2}, *steps]))
    eff, n = calibrate.efficiency_from_run(tmp_path)
    assert n == 5 and eff == pytest.approx(0.4)  # 0.3 of the step, computing 0.75 of it
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        calibrate.efficiency_from_run(tmp_path / "nope")


@pytest.mark.timeout(30)
def test_scaling_points_and_rows():
    assert predict.scaling_points(8, 1) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    assert predict.scaling_points(64, 8) == [(1, 1), (2, 1), (4, 1), (8, 1), (16, 2), (32, 4), (64, 8)]
    assert predict.scaling_points(1, 1) == [(1, 1)]
    from dptrain.config.load import load_config

    cfg = load_config(None, ["train.global_batch_size=12"])
    rows = predict.scaling(cfg, gpus=8, nodes=1, gpu_type="A100-40GB", interconnect="nvlink", comm=None, efficiency=0.5)
    assert [r["ranks"] for r in rows] == [1, 2, 4, 8]
    assert "refused" in rows[-1] and "12" in rows[-1]["refused"]  # 12 sequences do not split over 8 ranks
    assert rows[0]["efficiency"] == 1.0 and all(0 < r["efficiency"] <= 1 for r in rows[:3])


@pytest.mark.timeout(60)
def test_cli_time_options_and_bad_input(capsys, tmp_path):
    sweep = tmp_path / "c.json"
    sweep.write_text(json.dumps(_sweep(timing.Link(1e8, 1e-4), 2)))
    assert main(["plan", "--gpus", "2", "--gpu-type", "A100-40GB", "--comm", str(sweep), "--scaling"]) == 0
    out = capsys.readouterr().out
    assert f"measured, {sweep}" in out and "scaling" in out and "exposed" in out
    for argv, words in [
        (["--gpu-type", "cpu", "--gpus", "2"], ["--comm FILE", "doctor --comm --json"]),
        (["--calibrate", str(tmp_path)], ["no metrics.jsonl"]),
        (["--comm", str(tmp_path / "missing.json")], ["cannot read"]),
    ]:
        assert main(["plan", *argv]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), err
    assert main(["doctor", "--json", str(sweep)]) == 2
    assert "add --comm" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_powersgd_and_onebit_shrink_what_a_bucket_costs():
    cfg = LlamaConfig(vocab_size=256, dim=512, n_layers=4, n_heads=8, max_seq_len=128)
    link = timing.Link(bandwidth=1e8, alpha=0.0)
    lay = _lay(strategy="ddp", grad_compression="powersgd", powersgd_rank=4)
    cost = timing.compression_cost(param_shapes(cfg), lay, 2, link)
    shapes = param_shapes(cfg)
    numel = sum(math.prod(s) for s in shapes)
    sent = sum(
        4 * (s[0] + math.prod(s[1:])) if len(s) == 2 and 8 * (s[0] + s[1]) < s[0] * s[1] else math.prod(s)
        for s in shapes
    )
    assert cost(4 * numel) == pytest.approx(timing.all_reduce_time(4 * sent, 2, link))
    onebit = timing.compression_cost(param_shapes(cfg), _lay(grad_compression="onebit"), 4, link)
    assert onebit(4 * numel) == pytest.approx(timing.gather_time(4 * (numel / 8 + 4 * len(shapes)), 4, link))
    assert timing.compression_cost(param_shapes(cfg), _lay(grad_compression="fp16"), 2, link) is None


@pytest.mark.timeout(60)
def test_this_cpu_as_a_device(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert calibrate.threads_per_rank(1, 2) == 2 and calibrate.threads_per_rank(4, 2) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert calibrate.threads_per_rank(4, 2) == 3  # what the user set wins, as in `dptrain run`
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(calibrate.os, "cpu_count", lambda: 2)
    real = calibrate.cpu_spec(ranks_per_host=1, seconds=0.05)
    assert real.key == "cpu" and real.peaks["fp32"] > 0
    from dptrain.metrics import mfu

    monkeypatch.setattr(mfu, "cpu_matmul_peak", lambda **kw: 1e10)
    monkeypatch.setattr(calibrate, "_PEAKS", {})
    one, four = calibrate.cpu_spec(ranks_per_host=1), calibrate.cpu_spec(ranks_per_host=4)
    assert one.peaks["fp32"] == 1e10 and "1 rank(s) x 1 thread(s)" in one.name
    assert four.peaks["fp32"] == 0.5e10 and "4 rank(s) x 1 thread(s)" in four.name  # 4 x 1 thread on 2 cores
