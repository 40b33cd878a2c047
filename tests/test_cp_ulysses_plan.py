"""`dptrain plan` with Ulysses as the layout's cp attention (plan/memory.py `Layout.cp_attention`, plan/timing.py
`cp_exchange_bytes`, plan/llama.py's cp terms): the exchange's shape (Ulysses' bytes per rank fall as 1/cp, the K/V
all-gather's do not), the choice the plan makes (the run's: `parallel.cp_attention`, auto on the heads), and one
rank's activation memory on gloo within 15% of the plan at cp 2 and 4."""

from __future__ import annotations

import dataclasses

import pytest

from dptrain.config.load import load_config
from dptrain.models.llama import LlamaConfig
from dptrain.tools.plan.llama import activation_parts
from dptrain.tools.plan.memory import Layout
from dptrain.tools.plan.predict import predict
from dptrain.tools.plan.timing import Link, cp_exchange_bytes
from support.cp_memory import measure_activations, on_ranks
from support.mp import run_ranks

MODEL = {"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4}
"""4 query and 4 KV heads of 16: Ulysses at cp 2 and 4."""
SEQ = 512


def layout(*, cp: int, attention: str, seq: int = 4096, tp: int = 1) -> Layout:
    return Layout(strategy="ddp", dp_shard=1, tp=tp, pp=1, micro_batch=1, seq=seq, precision="bf16",
                  optimizer="adamw", cp=cp, cp_attention=attention)


@pytest.mark.fast
def test_ulysses_bytes_per_rank_fall_as_one_over_cp_the_all_gathers_do_not():
    cfg = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, max_seq_len=131072)
    hd, seq = 128, 131072
    ulysses = {cp: cp_exchange_bytes(cfg, layout(cp=cp, attention="ulysses", seq=seq)) for cp in (2, 4, 8, 16)}
    gather = {cp: cp_exchange_bytes(cfg, layout(cp=cp, attention="allgather", seq=seq)) for cp in (2, 4, 8, 16)}
    for cp in (2, 4, 8, 16):
        share = (cp - 1) / cp
        # 4 all-to-alls forward (q and the output at 32 heads, k and v at 8), 4 backward, each (cp-1)/cp of the
        # rank's seq/cp tokens; bf16
        assert ulysses[cp] == (8, pytest.approx(2 * share * 2 * (seq / cp) * hd * (32 + 8) * 2))
        # K and V of the whole row gathered forward, reduce-scattered backward, (cp-1)/cp of each
        assert gather[cp] == (4, pytest.approx(4 * share * seq * hd * 8 * 2))
        assert ulysses[cp][1] * cp / share == pytest.approx(ulysses[2][1] * 2 / 0.5)  # x 1/cp per rank
        assert gather[cp][1] / share == pytest.approx(gather[2][1] / 0.5)  # flat in cp
    assert ulysses[16][1] < gather[16][1] and ulysses[2][1] > gather[2][1]  # GQA: 8 KV heads gather cheaply at cp 2
    tp2 = cp_exchange_bytes(cfg, layout(cp=4, attention="ulysses", seq=seq, tp=2))
    assert tp2[1] == pytest.approx(ulysses[4][1] / 2)  # each tp rank exchanges its own heads
    recompute = cp_exchange_bytes(cfg, layout(cp=4, attention="ulysses", seq=seq), recompute=True)
    assert recompute == (12, pytest.approx(ulysses[4][1] * 3 / 2))  # the recompute's forward all-to-alls again


@pytest.mark.fast
def test_ulysses_keeps_what_one_process_keeps_at_seq_over_cp_tokens():
    cfg = LlamaConfig(**MODEL, max_seq_len=SEQ)
    kept, _ = activation_parts(cfg, batch=1, seq=SEQ, precision="fp32", cp=4, ulysses=True, outside=False)
    alone, _ = activation_parts(cfg, batch=1, seq=SEQ // 4, precision="fp32", outside=False)
    assert kept == alone
    gathered, _ = activation_parts(cfg, batch=1, seq=SEQ, precision="fp32", cp=4, cp_mask=False, outside=False)
    assert gathered > kept  # the K/V all-gather keeps K and V of the whole row


def predicted(model: dict, *, seq: int, cp: int, attention: str = "auto", gpu: str = "cpu", gpus: int | None = None):
    items = [f"model.kwargs.{k}={v}" for k, v in {**model, "max_seq_len": seq}.items()]
    items += [f"data.kwargs.seq_len={seq}", f"parallel.cp={cp}", "parallel.strategy=ddp",
              f"parallel.cp_attention={attention}", "train.micro_batch_size=1", "train.global_batch_size=1",
              "train.grad_accum_steps=1"]
    return predict(load_config(None, items), gpus=gpus or cp, nodes=1, gpu_type=gpu, interconnect="nvlink",
                   comm=Link(bandwidth=1e9, alpha=1e-5), efficiency=0.5)


@pytest.mark.fast
def test_the_plan_takes_the_runs_choice_and_names_it():
    assert predicted(MODEL, seq=SEQ, cp=4).layout.cp_attention == "ulysses"  # auto: 4 heads over 4 ranks
    assert predicted({**MODEL, "n_kv_heads": 2}, seq=SEQ, cp=4).layout.cp_attention == "allgather"
    assert predicted(MODEL, seq=SEQ, cp=4, attention="allgather").layout.cp_attention == "allgather"
    long = {**MODEL, "dim": 1024, "n_heads": 16, "n_kv_heads": 16}
    u = predicted(long, seq=32768, cp=8, gpu="H100", gpus=8)
    g = predicted(long, seq=32768, cp=8, attention="allgather", gpu="H100", gpus=8)
    assert 0 < u.time["cp_comm"] < g.time["cp_comm"]  # MHA at cp 8: a quarter of the bytes
    slim = dataclasses.replace(g.layout, cp_attention="ulysses")
    assert slim.ulysses and not g.layout.ulysses


@pytest.mark.fast
def test_the_plan_report_names_the_ulysses_exchange(capsys):
    from dptrain.cli.main import main

    common = ["plan", "--gpus", "4", "--gpu-type", "H100", "--efficiency", "0.5", "parallel.strategy=fsdp",
              "parallel.cp=2", "train.global_batch_size=2", "train.micro_batch_size=1", "train.grad_accum_steps=1"]
    assert main([*common, "parallel.cp_attention=ulysses"]) == 0
    assert "context-parallel Ulysses exchange (4 all-to-alls on heads" in capsys.readouterr().out
    assert main([*common, "parallel.cp_attention=allgather"]) == 0
    assert "context-parallel K/V exchange" in capsys.readouterr().out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_activation_memory_per_rank_within_15_percent_of_the_plan(cp):
    got = run_ranks(on_ranks, cp, measure_activations, {**MODEL, "max_seq_len": SEQ}, SEQ, cp, "ulysses",
                    timeout=60)
    want = predicted(MODEL, seq=SEQ, cp=cp, attention="ulysses").memory["activations"]
    print(f"Ulysses cp {cp}, {SEQ} tokens: measured {got} bytes per rank, planned {want:.0f}")
    assert max(got) - min(got) <= 0.02 * max(got), got  # as test_cp_memory.py: equal chunks, give or take a buffer
    for rank_bytes in got:
        assert rank_bytes == pytest.approx(want, rel=0.15), (got, want)
