"""Pipeline parallelism (parallel.pp > 1): the parity ladder's pipeline rungs, the split, refusals,
resume across layouts. Real gloo ranks forked by tests/mp.py; a tiny LLaMA, plain SGD."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import test_parity as tp
from dptrain.config import ConfigError, resolve
from dptrain.config.load import load_config
from dptrain.config.pipeline import stage_layer_counts

PP_LLAMA = {"dim": 32, "n_layers": 4, "n_heads": 2, "max_seq_len": 16}
RESULTS: dict[str, float] = {}


def pp_items(*, strategy: str, world_size: int, accum: int, schedule: str, pp: int = 2, microbatches: int = 2,
             stages_per_rank: int = 1, global_batch: int = 8) -> list[str]:
    items = tp.overrides(strategy=strategy, world_size=world_size // pp, accum=accum, model="llama",
                         global_batch=global_batch)
    items += [f"model.kwargs.{k}={v}" for k, v in PP_LLAMA.items()]
    items += [f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}", f"parallel.pp_microbatches={microbatches}",
              f"parallel.pp_stages_per_rank={stages_per_rank}"]
    return items


def pp_reference(global_batch: int = 8) -> tuple[dict[str, torch.Tensor], list[float]]:
    saved = tp.MODELS["llama"]["kwargs"]
    tp.MODELS["llama"]["kwargs"] = PP_LLAMA
    try:
        return tp.reference("llama", global_batch=global_batch)
    finally:
        tp.MODELS["llama"]["kwargs"] = saved


def pp_rung(items: list[str], world_size: int, out_dir: Path, *, rtol: float = tp.RTOL, atol: float = tp.ATOL,
            timeout: float = 120) -> float:
    got, records = tp.train(items, world_size, out_dir, timeout=timeout)
    want, norms = pp_reference()
    assert [r["step"] for r in records if "loss" in r] == list(range(1, tp.STEPS + 1))
    tp.assert_weights_close(got, want, rtol=rtol, atol=atol)
    logged = [r["grad_norm"] for r in records if "grad_norm" in r]
    assert logged == pytest.approx(norms, rel=1e-4)  # the global norm over both stages
    return tp.max_abs_diff(got, want)


# ------------------------------------------------------------------ parity
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("schedule,stages_per_rank", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_pp2_matches_reference(schedule, stages_per_rank, accum, tmp_path):
    items = pp_items(strategy="ddp", world_size=2, accum=accum, schedule=schedule, stages_per_rank=stages_per_rank)
    diff = pp_rung(items, 2, tmp_path)
    print(f"\nPARITY pp2 {schedule} accum={accum} worst|dw|={diff:.3g}")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_dp2_pp2_matches_reference(strategy, accum, tmp_path):
    items = pp_items(strategy=strategy, world_size=4, accum=accum, schedule="1f1b")
    diff = pp_rung(items, 4, tmp_path, timeout=200)
    print(f"\nPARITY dp2xpp2 {strategy} 1f1b accum={accum} worst|dw|={diff:.3g}")
