"""Meters (metrics/comm.py, metrics/mfu.py, metrics/meters.py): the FLOPs model against a hand
count, the peak table and its override, the MFU formula, the communication meter on a real 2-rank
DDP run (bytes equal to the gradients' analytic size) and the FSDP2 byte model against the
collectives FSDP2 actually issues."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dptrain.config.load import load_config
from dptrain.metrics import comm, mfu
from dptrain.models.llama import build_llama
from support.mp import run_ranks

TINY = ["model.kwargs.dim=16", "model.kwargs.n_layers=2", "model.kwargs.n_heads=2", "model.kwargs.max_seq_len=16",
        "data.kwargs.seq_len=16"]


# ---------------------------------------------------------------- FLOPs model
@pytest.mark.fast
@pytest.mark.timeout(30)
@pytest.mark.parametrize("kv_heads", [None, 1])
def test_llama_flops_per_token_is_6n_plus_attention_by_hand(kv_heads):
    d, L, heads, f, vocab, T = 8, 2, 2, 16, 16, 4
    m = build_llama(vocab_size=vocab, dim=d, n_layers=L, n_heads=heads, n_kv_heads=kv_heads, ffn_hidden=f)
    kv_dim = (kv_heads or heads) * (d // heads)
    attn = d * d + 2 * d * kv_dim + d * d  # wq, wk, wv, wo
    per_layer = attn + 3 * d * f + 2 * d  # SwiGLU w1 w2 w3, two RMSNorm weights
    n = L * per_layer + d + vocab * d  # + final norm + output head (the input embedding is not a matmul)
    want = 6 * n + 12 * L * d * T  # + QK^T and AV: 2 matmuls x 2 FLOPs x d x T, x3 for fwd + bwd
    got, source = mfu.model_flops_per_token(m, seq_len=T, override=None)
    assert got == want and "flops_per_token(4)" in source


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_6n_approximation_skips_input_embeddings_but_not_tied_ones_and_the_override_wins():
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    model = nn.Sequential(emb, nn.Linear(4, 4), head)
    got, source = mfu.model_flops_per_token(model, seq_len=8, override=None)
    assert got == 6 * (16 + 4 + 40) and source.startswith("6N approximation")
    head.weight = emb.weight  # tied: the matrix is a real matmul in the head
    assert mfu.model_flops_per_token(model, seq_len=8, override=None)[0] == 6 * (40 + 16 + 4)
    assert mfu.model_flops_per_token(model, seq_len=8, override=123.0) == (123.0, "train.flops_per_token")


# ---------------------------------------------------------------- peaks
@pytest.mark.fast
@pytest.mark.timeout(30)
@pytest.mark.parametrize(("name", "dtype", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5), ("NVIDIA H100 PCIe", "bf16", 756.5), ("NVIDIA H100 NVL", "fp16", 835.5),
    ("NVIDIA H200", "bf16", 989.5), ("NVIDIA H200 NVL", "fp32", 60), ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
    ("NVIDIA A100 80GB PCIe", "tf32", 156), ("NVIDIA L40S", "bf16", 362.05), ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ("Tesla V100-SXM2-16GB", "fp16", 125), ("Tesla V100-PCIE-32GB", "fp32", 14),
])
def test_peak_table_lookup(name, dtype, tflops):
    peak = mfu.lookup_peak(name, dtype)
    assert peak.flops == pytest.approx(tflops * 1e12) and "dense" in peak.source


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_peak_lookup_says_why_when_it_has_no_figure_and_the_override_wins():
    v100 = mfu.lookup_peak("Tesla V100-SXM2-16GB", "bf16")
    assert v100.flops is None and "no bf16 peak" in v100.source and "fp16" in v100.source
    unknown = mfu.lookup_peak("NVIDIA T4", "fp16")
    assert unknown.flops is None and "log.peak_tflops" in unknown.source and "H100" in unknown.source
    over = mfu.peak_flops(device=torch.device("cpu"), precision="fp32", override_tflops=2.5)
    assert over.flops == 2.5e12 and over.source == "log.peak_tflops"
    assert mfu.compute_dtype("bf16") == "bf16"
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert mfu.compute_dtype("fp32") == "tf32"
        torch.set_float32_matmul_precision("highest")
        assert mfu.compute_dtype("fp32") == "fp32"
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_cpu_matmul_peak_is_short_and_plausible():
    t = time.perf_counter()
    peak = mfu.cpu_matmul_peak(size=128, seconds=0.05)
    assert time.perf_counter() - t < 2.0
    assert math.isfinite(peak) and 1e7 < peak < 1e14  # FLOP/s of one CPU process


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_mfu_formula():
    # 1000 tok/s over 2 devices at 1e6 FLOPs/token = 5e8 FLOP/s per device, peak 1e9: 50 %
    assert mfu.mfu(tokens_per_s=1000.0, flops_per_token=1e6, devices=2, peak=1e9) == pytest.approx(0.5)


# ---------------------------------------------------------------- communication model
@pytest.mark.fast
@pytest.mark.timeout(30)
def test_ring_bytes_and_interval_union():
    assert comm.ring_bytes("all_reduce", 100, 4) == 150  # 2(n-1)/n
    assert comm.ring_bytes("all_gather", 100, 4) == 75 and comm.ring_bytes("reduce_scatter", 100, 1) == 0
    with pytest.raises(ValueError, match="all_to_all"):
        comm.ring_bytes("all_to_all", 1, 2)
    assert comm.union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.8)]) == pytest.approx(4.0)
    assert comm.union_length([]) == 0


def _fit(rank: int, items: list[str], out: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dptrain.train.trainer import Trainer

    hooks: list[Any] = []
    register = DDP.register_comm_hook
    DDP.register_comm_hook = lambda self, state, hook: (hooks.append(hook), register(self, state, hook))[1]
    trainer = Trainer(load_config(None, items), out_dir=out)
    summary = trainer.fit()
    summary["grad_bytes"] = sum(p.numel() * p.element_size() for p in trainer.module.parameters())
    summary["comm_hooks"] = len(hooks)  # DDP communication hooks registered (this forked rank only)
    return summary


def _items(strategy: str, steps: int = 4) -> list[str]:
    return [*TINY, f"parallel.strategy={strategy}", f"train.max_steps={steps}", "train.log_every_steps=2",
            "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_every_steps=0", "train.eval_batches=1",
            "parallel.device=cpu", "parallel.timeout_s=60", "log.progress=false", "diagnostics.preflight=false"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("timed", [False, True])
def test_ddp_run_logs_comm_bytes_equal_to_the_gradients_bytes_and_mfu(tmp_path, timed):
    """Default: no DDP hook, the bytes counted from the gradients and the times null; log.comm_times: the metered
    hook, whose bytes (read from the buckets) are the same and whose times are finite."""
    out = tmp_path / "run"
    summaries = run_ranks(_fit, 2, [*_items("ddp"), f"log.comm_times={str(timed).lower()}"], str(out), timeout=100)
    assert summaries[0]["comm_hooks"] == (1 if timed else 0)  # no Python per gradient bucket unless asked
    grad_bytes = summaries[0]["grad_bytes"]
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(records) == 2
    for rec in [*records, summaries[0]]:
        # world 2: ring all-reduce sends 2(n-1)/n = 1 x the payload, once per step (accum 2: no_sync first)
        assert rec["comm_bytes"] == grad_bytes
        for key in ("comm_s", "exposed_comm_s"):
            if timed:
                assert math.isfinite(rec[key]) and rec[key] >= 0, (key, rec)
            else:
                assert rec[key] is None, (key, rec)
        assert 0 < rec["mfu"] <= 1
        assert rec["tokens_per_s_per_rank"] == pytest.approx(rec["tokens_per_s"] / 2)
        assert rec["samples_per_s_per_rank"] == pytest.approx(rec["samples_per_s"] / 2)
    s = summaries[0]
    assert s["comm_bytes_total"] == 4 * grad_bytes
    assert s["flops_per_token_source"] == "LlamaLM.flops_per_token(16)" and s["peak_flops"] > 0


def _count_fsdp(rank: int, strategy: str) -> dict[str, float]:
    """One FSDP2 forward+backward, counting the bytes each collective makes this rank send."""
    import torch.distributed as dist

    from dptrain.config import ParallelConfig
    from dptrain.distributed.mesh import ParallelDims, ParallelMesh
    from dptrain.parallel import fsdp, parallelize_model

    dist.init_process_group("gloo")
    try:
        mesh = ParallelMesh.build(ParallelDims.resolve(dp_shard=2, world_size=2), device_type="cpu")
        torch.manual_seed(0)
        model = build_llama(dim=12, n_layers=2, n_heads=2, ffn_hidden=21, vocab_size=31, max_seq_len=8)
        pmodel = parallelize_model(model, cfg=ParallelConfig(strategy=strategy), mesh=mesh, device=torch.device("cpu"))
        want = comm.fsdp_comm_bytes(model, shard=2, reshard_after_forward=strategy == "fsdp")
        sent = {"gather": 0.0, "scatter": 0.0}
        real_rs = dist.reduce_scatter_single
        # on the host FSDP2 gathers through parallel/fsdp.py's HostAllGather (a broadcast from each rank into its
        # slice: the same bytes per rank as a ring all-gather)
        real_ag = fsdp.HostAllGather.__call__

        def ag(self, output_tensor, input_tensor, **k):  # FSDP2 calls its comm by keyword
            sent["gather"] += comm.ring_bytes("all_gather", output_tensor.numel() * output_tensor.element_size(), 2)
            return real_ag(self, output_tensor=output_tensor, input_tensor=input_tensor, **k)

        def rs(output, input, *a, **k):  # noqa: A002
            sent["scatter"] += comm.ring_bytes("reduce_scatter", input.numel() * input.element_size(), 2)
            return real_rs(output, input, *a, **k)

        fsdp.HostAllGather.__call__, dist.reduce_scatter_single = ag, rs
        ids = torch.randint(0, 31, (2, 8))
        pmodel.module(ids, labels=ids).backward()
        fsdp.HostAllGather.__call__, dist.reduce_scatter_single = real_ag, real_rs
        return {**sent, "want_gather": want.per_micro, "want_scatter": want.per_sync}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_fsdp2_byte_model_equals_the_collectives_fsdp2_issues(strategy):
    got = run_ranks(_count_fsdp, 2, strategy, timeout=100)[0]
    assert got["gather"] > 0 and got["scatter"] > 0
    assert got["gather"] == got["want_gather"] and got["scatter"] == got["want_scatter"]


@pytest.mark.timeout(120)
def test_fsdp_run_logs_analytic_bytes_and_null_times(tmp_path):
    out: Path = tmp_path / "run"
    s = run_ranks(_fit, 2, _items("zero2", steps=2), str(out), timeout=100)[0]
    assert s["comm_bytes"] > 0 and s["comm_s"] is None and s["exposed_comm_s"] is None


@pytest.mark.timeout(300)
def test_comm_overlap_benchmark_runs():
    import subprocess
    import sys

    from support import ROOT as root
    from support import subprocess_env

    env = subprocess_env(tests=False)
    r = subprocess.run([sys.executable, "benchmarks/perf/comm_overlap.py", "--dim", "32", "--layers", "1", "--seq", "8",
                        "--rounds", "2", "--buckets", "1", "--static", "off,on"], cwd=root, capture_output=True,
                       text=True, timeout=290, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 4  # gradient_as_bucket_view on/off x static_graph off/on
