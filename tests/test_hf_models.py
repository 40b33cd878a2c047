"""Hugging Face models train unchanged: tiny LlamaForCausalLM, GPT2LMHeadModel and
T5ForConditionalGeneration (configs built in code, nothing downloaded) fed dict batches
(`input_ids`, `attention_mask`, `labels`; for T5 `labels` are the decoder's targets) through
dptrain's real `Trainer(cfg).fit()` on 2 forked gloo ranks under ddp, zero2 and fsdp.

Every case asserts the loss falls. Llama and GPT-2 under ddp and fsdp (and Llama under zero2) also
match a single-process reference of plain PyTorch on the same global batches with plain SGD, as
the parity ladder (test_parity.py) does: the token rule (`num_items_in_batch`, dptrain/train/loss.py)
makes the step's gradient the global batch's token mean even with padded rows. The losses are
printed as a table row (`pytest -s`) for docs/results/training.md.

What these models exercise in dptrain: the meta-device build falls back to the eager build (HF
initialises weights in `post_init`, outside the init contract of dptrain.parallel.materialize) with
the reason logged; tied embeddings (GPT-2, T5) under FSDP; `_no_split_modules` (LlamaDecoderLayer,
GPT2Block, T5Block) naming the FSDP units, T5Block holding its own ModuleList.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the optional extra: pip install -e '.[hf]')"
)

import torch  # noqa: E402

from dptrain.config import ModelConfig  # noqa: E402
from dptrain.train.build import build_model_meta  # noqa: E402
from support.hf import (  # noqa: E402
    GLOBAL_BATCH,
    LAYERS,
    PARITY,
    STEPS,
    overrides,
    reference,
    tiny_gpt2,
    tiny_llama,
    tiny_t5,
)
from support.parity import SEED, assert_weights_close, train  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
@pytest.mark.parametrize("model", ["llama", "gpt2", "t5"])
def test_hf_model_trains(model: str, strategy: str, tmp_path: Path, capsys) -> None:
    weights, records = train(overrides(model, strategy), 2, tmp_path, timeout=150)
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    with capsys.disabled():
        print(f"\nHF | {model} | {strategy} | first loss {losses[0]:.4f} | last loss {losses[-1]:.4f}")
    assert losses[-1] < 0.9 * losses[0], f"the loss did not fall: {losses}"
    if (model, strategy) in PARITY:
        assert_weights_close(weights, reference(model), rtol=1e-4, atol=1e-5)


@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", ["llama", "gpt2", "t5"])
def test_hf_meta_build_falls_back_with_a_reason(model: str) -> None:
    """HF models initialise in post_init, outside dptrain's meta init contract: the build is eager,
    with the reason, and bit-identical on every rank (same seed)."""
    cfg = ModelConfig(factory=f"support.hf:tiny_{model}", kwargs={})
    first, reason = build_model_meta(cfg, seed=SEED)
    second, _ = build_model_meta(cfg, seed=SEED)
    assert reason is not None and "built it eagerly" in reason
    assert not any(p.is_meta for p in first.parameters())
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    if model != "llama":  # tied embeddings stay tied
        assert first.get_output_embeddings().weight is first.get_input_embeddings().weight


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_loss_rule_follows_what_the_forward_does_with_num_items() -> None:
    """Llama and GPT-2 pass num_items_in_batch to their loss_function (token rule); T5's forward takes
    **kwargs but returns a plain token mean (sample rule, else accumulation would not divide it)."""
    from dptrain.train.loss import forward_loss, takes_num_items

    assert takes_num_items(forward_loss, tiny_llama()) and takes_num_items(forward_loss, tiny_gpt2())
    assert not takes_num_items(forward_loss, tiny_t5())


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("model,strategy", [("llama", "fsdp"), ("gpt2", "ddp")])
def test_hf_accumulation_matches_reference(model: str, strategy: str, tmp_path: Path) -> None:
    """Two micro-steps per rank with padded rows: the token rule still gives the global token mean."""
    items = [*overrides(model, strategy), f"train.micro_batch_size={GLOBAL_BATCH // 4}", "train.grad_accum_steps=2"]
    weights, _ = train(items, 2, tmp_path, timeout=150)
    assert_weights_close(weights, reference(model), rtol=1e-4, atol=1e-5)


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_t5_fsdp_units_are_blocks_bottom_up() -> None:
    """T5Block holds its own ModuleList (`layer`); FSDP units come from `_no_split_modules`, deepest first."""
    from dptrain.parallel.fsdp import shard_units

    torch.manual_seed(SEED)
    model = tiny_t5()
    units = shard_units(model)
    assert {type(u).__name__ for u in units} == {"T5Block"}
    assert len(units) == 2 * LAYERS


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_t5_sharded_matches_ddp(tmp_path: Path) -> None:
    """T5 under fsdp (FSDP2 warns that T5Block returns a view: position_bias) ends with the same weights
    as under ddp. T5's loss is a plain token mean (sample rule), so with padded rows neither equals
    the single-process global-token-mean reference; ddp is the reference here."""
    want, _ = train(overrides("t5", "ddp"), 2, tmp_path / "ddp", timeout=150)
    got, _ = train(overrides("t5", "fsdp"), 2, tmp_path / "fsdp", timeout=150)
    assert_weights_close(got, want, rtol=1e-4, atol=1e-5)
