"""Ulysses attention under context parallelism (parallel.cp_attention=ulysses, parallel/ulysses.py): 10 SGD steps equal
one plain process (the parity ladder's reference and tolerance, tests/test_context_parallel.py `cp_case`), a guard
shows the check catches the row left in chunk order, and the choice (auto, refusals) is made before launch."""

from __future__ import annotations

import pytest
import torch
from test_context_parallel import cp_case, packed_case

from dptrain.config import ConfigError, resolve
from dptrain.config.context import LLAMA_DEFAULT_HEADS, choose_cp_attention
from dptrain.config.load import load_config
from dptrain.parallel.context import chunk_positions
from dptrain.parallel.ulysses import gathered_positions
from support.parity import MODELS

FOUR_HEADS = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "max_seq_len": 16}
"""The parity model with 4 query and 4 KV heads: Ulysses at cp 4, and at cp 2 x tp 2 (2 heads a tp rank)."""
GQA = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 16}
"""Grouped KV heads: 2 query heads per KV head; at cp 2 each rank attends with 2 query heads and their 1 KV head."""


def with_model(monkeypatch, kwargs: dict) -> None:
    """Run the case (reference and ranks alike) on a variant of the parity LLaMA."""
    monkeypatch.setitem(MODELS["llama"], "kwargs", kwargs)


@pytest.mark.timeout(60)
def test_ulysses_cp2_matches_reference(tmp_path):
    cp_case(tmp_path, strategy="ddp", dp=1, cp=2, accum=2, attention="ulysses")


@pytest.mark.timeout(60)
def test_ulysses_cp2_with_grouped_kv_heads_matches_reference(tmp_path, monkeypatch):
    with_model(monkeypatch, GQA)
    cp_case(tmp_path, strategy="ddp", dp=1, cp=2, accum=1, attention="ulysses")


@pytest.mark.timeout(60)
def test_ulysses_cp4_matches_reference(tmp_path, monkeypatch):
    with_model(monkeypatch, FOUR_HEADS)
    cp_case(tmp_path, strategy="ddp", dp=1, cp=4, accum=1, attention="ulysses")


@pytest.mark.timeout(60)
def test_ulysses_cp2_with_fsdp2_matches_reference(tmp_path):
    cp_case(tmp_path, strategy="fsdp", dp=2, cp=2, accum=1, extra=("parallel.dp_shard=2",), attention="ulysses")


@pytest.mark.timeout(60)
def test_ulysses_cp2_with_tp2_matches_reference(tmp_path, monkeypatch):
    """tp splits the 4 heads into 2 a rank, Ulysses those 2 into 1 per cp rank (sequence parallelism on)."""
    with_model(monkeypatch, FOUR_HEADS)
    cp_case(tmp_path, strategy="ddp", dp=1, cp=2, tp=2, accum=1, attention="ulysses")


@pytest.mark.timeout(60)
def test_ulysses_cp2_with_pp2_matches_reference(tmp_path):
    """Each pipeline stage's attention runs the all-to-alls over the cp ranks of its stage."""
    cp_case(tmp_path, strategy="ddp", dp=1, cp=2, pp=2, accum=2, attention="ulysses")


@pytest.mark.timeout(90)
def test_ulysses_packed_rows_with_document_masks_match_one_process(tmp_path):
    """After the all-to-all each rank holds whole rows: the single-process document mask on the gathered ids."""
    packed_case(tmp_path, attention="ulysses")


@pytest.mark.timeout(60)
def test_the_tolerance_catches_ulysses_rows_left_in_chunk_order(tmp_path, monkeypatch):
    """Guard: the all-to-all'd row attended in rank (chunk) order, not put back in natural order, fails parity."""
    from dptrain.parallel import ulysses

    monkeypatch.setattr(ulysses, "gathered_positions", lambda n, *, cp, device=None: torch.arange(n, device=device))
    ulysses._natural_order.cache_clear()
    try:
        with pytest.raises(AssertionError):
            cp_case(tmp_path, strategy="ddp", dp=1, cp=2, accum=1, attention="ulysses")
    finally:
        ulysses._natural_order.cache_clear()


def _logged_attention(rank: int) -> list[str]:
    import logging

    import torch.distributed as dist

    from dptrain.models.llama import build_llama
    from dptrain.parallel.context import apply_cp

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dptrain.parallel").addHandler(handler)
    logging.getLogger("dptrain.parallel").setLevel(logging.INFO)
    dist.init_process_group("gloo")
    try:
        model = build_llama(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
        assert apply_cp(model, group=dist.group.WORLD, cp=2, rank=rank) == "ulysses"  # auto
        rows = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(16).view(4, 4)[[rank, 3 - rank]].flatten()
        model(input_ids=rows[:, :-1][:, pos], labels=rows[:, 1:][:, pos], position_ids=pos.expand(2, -1))
        return [line for line in lines if "parallel.cp: attention is" in line]
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_the_attention_that_runs_is_logged_once():
    from support.mp import run_ranks

    for lines in run_ranks(_logged_attention, 2, timeout=50):
        assert lines == ["parallel.cp: attention is Ulysses all-to-all on heads (4 query / 2 KV heads a rank, 2 / 1 "
                         "after the all-to-all, whole rows, causal SDPA)"]


def test_gathered_positions_are_the_cp_ranks_chunks_in_rank_order():
    for seq, cp in ((8, 2), (16, 4), (24, 3)):
        want = torch.cat([chunk_positions(seq, cp=cp, rank=r) for r in range(cp)])
        assert gathered_positions(seq, cp=cp).tolist() == want.tolist()


# ------------------------------------------------------------------ the choice, before launch
def test_auto_picks_ulysses_where_the_local_heads_divide_by_cp():
    pick = choose_cp_attention
    assert pick("auto", n_heads=4, n_kv_heads=4, tp=1, cp=4) == "ulysses"
    assert pick("auto", n_heads=4, n_kv_heads=2, tp=1, cp=2) == "ulysses"
    assert pick("auto", n_heads=4, n_kv_heads=2, tp=1, cp=4) == "allgather"  # 2 KV heads over 4 ranks
    assert pick("auto", n_heads=4, n_kv_heads=4, tp=2, cp=4) == "allgather"  # 2 heads a tp rank
    assert pick("auto", n_heads=8, n_kv_heads=4, tp=2, cp=2) == "ulysses"
    assert pick("allgather", n_heads=8, n_kv_heads=8, tp=1, cp=2) == "allgather"
    assert pick("ulysses", n_heads=8, n_kv_heads=8, tp=1, cp=1) == "allgather"  # nothing to split


def test_the_default_heads_are_the_models():
    from dptrain.models.llama import LlamaConfig

    assert LlamaConfig().n_heads == LLAMA_DEFAULT_HEADS


BASE = ["parallel.device=cpu", "parallel.cp=2", "parallel.strategy=ddp"]


@pytest.mark.parametrize(
    "extra,world,match",
    [
        (["parallel.cp_attention=ulysses", "model.kwargs.n_heads=4", "model.kwargs.n_kv_heads=1"], 2,
         r"parallel.cp=2 .*: parallel.cp_attention='ulysses' .* n_heads=4 and n_kv_heads=1 over tp=1 leave 4 query "
         r"and 1 KV heads, not both divisible by cp=2; use parallel.cp_attention=allgather"),
        (["parallel.cp_attention=ulysses", "model.kwargs.n_heads=4", "parallel.tp=4", "data.kwargs.seq_len=64"], 8,
         r"n_heads=4 and n_kv_heads=4 over tp=4 leave 1 query and 1 KV heads, not both divisible by cp=2"),
        (["parallel.cp_attention=ring"], 2, r"parallel.cp_attention='ring' is not valid; choose one of: auto, "),
        (["parallel.cp=1", "parallel.cp_attention=ring"], 1, r"parallel.cp_attention='ring' is not valid"),
    ],
)
def test_ulysses_that_cannot_split_the_heads_is_refused_before_launch(extra, world, match):
    with pytest.raises(ConfigError, match=match):
        resolve(load_config(None, [*BASE, *extra]), world_size=world)


def test_auto_resolves_where_ulysses_cannot_split():
    cfg = load_config(None, [*BASE, "model.kwargs.n_heads=4", "model.kwargs.n_kv_heads=1"])
    assert resolve(cfg, world_size=2).dims.cp == 2  # auto: the K/V all-gather
