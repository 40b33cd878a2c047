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
from typing import Any

import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the optional extra: pip install -e '.[hf]')"
)

import torch  # noqa: E402
from test_parity import SEED, assert_weights_close, train  # noqa: E402
from torch.utils.data import Dataset, default_collate  # noqa: E402

from dptrain.config import ModelConfig  # noqa: E402
from dptrain.data import GlobalBatchSampler  # noqa: E402
from dptrain.train.build import build_model_meta  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 32, 2, 2, 16
STEPS, GLOBAL_BATCH = 8, 8
N_SAMPLES = 32


# ------------------------------------------------------------------ model factories (by import path)
def tiny_llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=2 * SEQ,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


def tiny_gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=2 * SEQ,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)  # lm_head tied to wte


def tiny_t5() -> torch.nn.Module:
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN, num_layers=LAYERS,
        num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=2,
    )
    # shared embedding tied to both stacks and lm_head. Its forward takes **kwargs but its loss is a plain
    # token mean that ignores num_items_in_batch: dptrain sees that and uses the sample rule.
    return transformers.T5ForConditionalGeneration(cfg)


# ------------------------------------------------------------------ data factory: dict samples
class DictRows(Dataset):
    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def hf_batches(*, n: int = N_SAMPLES, seq_len: int = SEQ, seq2seq: bool = False, seed: int = 0) -> DictRows:
    """Learnable rows (each token is the previous one + a per-row step, mod VOCAB) as dicts. Some rows
    end in padding: attention_mask 0 and labels -100 there. Causal LMs shift labels inside, so the
    first label of a row is never scored: it is -100 too, and the token count is exact. Seq2seq: the
    decoder's labels are the source rows reversed (T5 builds the decoder inputs from them)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = int(torch.randint(3, VOCAB, (), generator=g))
        step = int(torch.randint(1, 3, (), generator=g))
        ids = (start + step * torch.arange(seq_len)) % (VOCAB - 3) + 3  # ids 0..2 are pad/bos/eos
        pad = int(torch.randint(0, seq_len // 4, (), generator=g))
        mask = torch.ones(seq_len, dtype=torch.long)
        if pad:
            mask[-pad:] = 0
        labels = ids.flip(0).clone() if seq2seq else ids.clone()
        labels[mask == 0] = -100
        if not seq2seq:
            labels[0] = -100
        rows.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": labels})
    return DictRows(rows)


MODELS: dict[str, dict[str, Any]] = {
    # plain SGD (lr, momentum) that makes each fall visibly within STEPS steps
    "llama": {"build": tiny_llama, "data": {}, "lr": 0.5, "momentum": 0.0},
    "gpt2": {"build": tiny_gpt2, "data": {}, "lr": 0.3, "momentum": 0.9},
    "t5": {"build": tiny_t5, "data": {"seq2seq": True}, "lr": 1.0, "momentum": 0.0},
}
PARITY = {("llama", "ddp"), ("llama", "zero2"), ("llama", "fsdp"), ("gpt2", "ddp"), ("gpt2", "fsdp")}


def overrides(model: str, strategy: str) -> list[str]:
    spec = MODELS[model]
    return [
        f"model.factory=test_hf_models:tiny_{model}",
        "data.factory=test_hf_models:hf_batches",
        *(f"data.kwargs.{k}={str(v).lower()}" for k, v in MODELS[model]["data"].items()),
        "data.num_workers=0",
        "optim.name=sgd", f"optim.lr={spec['lr']}", "optim.weight_decay=0", f"optim.momentum={spec['momentum']}",
        "optim.warmup_steps=0", "optim.schedule=constant", "optim.grad_clip=null",
        f"train.max_steps={STEPS}", f"train.seed={SEED}", "train.eval_batches=1", "train.log_every_steps=1",
        f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={GLOBAL_BATCH // 2}",
        "train.grad_accum_steps=1",
        f"parallel.strategy={strategy}", "parallel.device=cpu", "parallel.timeout_s=60", "log.progress=false",
    ]


def reference(model: str) -> dict[str, torch.Tensor]:
    """One plain process: the model's own loss (token mean) over each whole global batch, SGD."""
    spec = MODELS[model]
    ds = hf_batches(**spec["data"])
    torch.manual_seed(SEED)
    net = spec["build"]()
    opt = torch.optim.SGD(net.parameters(), lr=spec["lr"], momentum=spec["momentum"])
    order = GlobalBatchSampler(
        dataset_len=len(ds), global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH, grad_accum_steps=1,
        dp_rank=0, dp_world_size=1, seed=SEED, shuffle=True,
    )
    for step in range(STEPS):
        batch = default_collate([ds[i] for i in order.global_batch_indices(step)])
        net(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", ["llama", "gpt2", "t5"])
def test_hf_meta_build_falls_back_with_a_reason(model: str) -> None:
    """HF models initialise in post_init, outside dptrain's meta init contract: the build is eager,
    with the reason, and bit-identical on every rank (same seed)."""
    cfg = ModelConfig(factory=f"test_hf_models:tiny_{model}", kwargs={})
    first, reason = build_model_meta(cfg, seed=SEED)
    second, _ = build_model_meta(cfg, seed=SEED)
    assert reason is not None and "built it eagerly" in reason
    assert not any(p.is_meta for p in first.parameters())
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    if model != "llama":  # tied embeddings stay tied
        assert first.get_output_embeddings().weight is first.get_input_embeddings().weight


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
