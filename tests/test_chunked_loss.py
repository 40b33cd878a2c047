"""The chunked (fused) linear + cross-entropy (dptrain/models/chunked_loss.py, `train.loss_chunk_tokens`): the loss
and every gradient equal the unchunked path's within float32 rounding (relative 1e-6), for the bare function, a
transformers Llama (plain and inside PEFT's wrapper, with dptrain's token rule and HF's mean) and the built-in
LLaMA; a training forward never makes the whole logits; models it does not know keep their own loss. The 2-rank
parity of whole runs (ddp, fsdp) against `train.loss_chunk_tokens=0` is in tests/test_chunked_loss_ranks.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dptrain.models.chunked_loss import (
    apply_chunked_loss,
    auto_chunk_tokens,
    chunked_loss_problem,
    linear_cross_entropy,
)
from dptrain.models.llama import LlamaConfig, LlamaLM

RTOL = 1e-6


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| over |want|, as norms (one number per tensor: the summation order differs per element)."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _case(n: int = 37, hidden: int = 16, vocab: int = 50, *, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.3] = -100
    return h, w, b, t


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("bias", [True, False])
def test_the_fused_loss_and_its_gradients_equal_the_unchunked_ones(chunk: int, bias: bool) -> None:
    h, w, b, t = _case(bias=bias)
    ref = F.cross_entropy(F.linear(h, w, b), t, ignore_index=-100, reduction="sum")
    want = torch.autograd.grad(ref * 0.37, [x for x in (h, w, b) if x is not None])
    loss = linear_cross_entropy(h, w, b, t, chunk_tokens=chunk)
    got = torch.autograd.grad(loss * 0.37, [x for x in (h, w, b) if x is not None])
    assert loss.dtype == torch.float32 and rel(loss, ref) <= RTOL
    for g, r in zip(got, want, strict=True):
        assert rel(g, r) <= RTOL


@pytest.mark.timeout(30)
def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_theirs() -> None:
    h, w, _, t = _case(bias=False)
    w.requires_grad_(False)
    ref = F.cross_entropy(F.linear(h, w), t, ignore_index=-100, reduction="sum")
    (want,) = torch.autograd.grad(ref, [h])
    (got,) = torch.autograd.grad(linear_cross_entropy(h, w, None, t, chunk_tokens=8), [h])
    assert rel(got, want) <= RTOL and w.grad is None


@pytest.mark.timeout(30)
def test_the_guard_a_wrong_label_alignment_is_far_beyond_the_tolerance() -> None:
    """The tolerance would catch an off-by-one between predictions and targets."""
    h, w, b, t = _case()
    ref = F.cross_entropy(F.linear(h, w, b), t, ignore_index=-100, reduction="sum")
    assert rel(linear_cross_entropy(h, w, b, t.roll(1), chunk_tokens=8), ref) > 1e-3


def test_the_auto_chunk_keeps_a_chunk_of_logits_within_32_mib() -> None:
    assert auto_chunk_tokens(32000) == 256 and auto_chunk_tokens(128256) == 64 and auto_chunk_tokens(256) == 32768
    assert auto_chunk_tokens(10**9) == 1


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(plain: torch.nn.Module, chunked: torch.nn.Module, batch: dict, **kw) -> None:
    ref = plain(**batch, **kw).loss
    ref.backward()
    out = chunked(**batch, **kw)
    out.loss.backward()
    assert out.logits is None  # the training forward made no whole logits
    assert rel(out.loss, ref) <= RTOL
    want, got = _grads(plain), _grads(chunked)
    assert want.keys() == got.keys() and want
    for name, g in want.items():
        assert rel(got[name], g) <= RTOL, name


def _hf_batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (3, 11), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[2, 7:] = -100  # padding
    return {"input_ids": ids, "labels": labels, "use_cache": False}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("normalise", ["token_rule", "mean"])
@pytest.mark.parametrize("lora", [False, True])
def test_a_transformers_llama_trains_on_the_same_loss_and_gradients(normalise: str, lora: bool) -> None:
    transformers = pytest.importorskip("transformers")
    from support.pretrained import hf_llama_config

    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(hf_llama_config())
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0.0, 0.2)
    if lora:
        peft = pytest.importorskip("peft")
        plain = peft.get_peft_model(plain, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        for name, p in plain.named_parameters():  # B = 0 would make the base's gradient paths vanish
            if "lora_B" in name:
                torch.nn.init.normal_(p, 0.0, 0.1)
    chunked = copy.deepcopy(plain)
    assert apply_chunked_loss(chunked, chunk_tokens=4) is None
    kw = {"num_items_in_batch": torch.tensor(17.0)} if normalise == "token_rule" else {}
    _compare(plain, chunked, _hf_batch(plain.config.vocab_size), **kw)
    with torch.no_grad():  # evaluation keeps the model's own path and its logits
        batch = _hf_batch(plain.config.vocab_size)
        a, b = plain(**batch), chunked(**batch)
    assert b.logits is not None and torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tied", [False, True])
def test_the_built_in_llama_trains_on_the_same_loss_and_gradients(tied: bool) -> None:
    torch.manual_seed(0)
    plain = LlamaLM(LlamaConfig(vocab_size=97, dim=32, n_layers=2, n_heads=2, max_seq_len=16, tie_embeddings=tied))
    chunked = copy.deepcopy(plain)
    assert apply_chunked_loss(chunked, chunk_tokens=5) is None and chunked.loss_chunk_tokens == 5
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    labels[1, :3] = -100
    for kw in ({"num_items_in_batch": torch.tensor(20.0)}, {}):
        plain.zero_grad(set_to_none=True)
        chunked.zero_grad(set_to_none=True)
        ref, got = plain(input_ids=ids, labels=labels, **kw), chunked(input_ids=ids, labels=labels, **kw)
        ref.backward()
        got.backward()
        assert rel(got, ref) <= RTOL
        want, have = _grads(plain), _grads(chunked)
        for name, g in want.items():
            assert rel(have[name], g) <= RTOL, name


@pytest.mark.timeout(60)
def test_models_it_does_not_know_keep_their_own_loss_with_the_reason() -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from support.hf import tiny_gpt2, tiny_llama

    gpt2 = tiny_gpt2()
    assert "GPT2LMHeadModel's forward is not transformers' common causal-LM forward" in chunked_loss_problem(gpt2)
    assert apply_chunked_loss(gpt2, chunk_tokens=None) is not None and "forward" not in vars(gpt2)
    head_lora = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    assert "lm_head is a Linear" in chunked_loss_problem(head_lora) and "not an nn.Linear" in chunked_loss_problem(
        head_lora)
    assert "neither the built-in LLaMA nor a transformers causal LM" in chunked_loss_problem(torch.nn.Linear(2, 2))
    assert isinstance(tiny_llama(), transformers.LlamaForCausalLM) and chunked_loss_problem(tiny_llama()) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("frozen", [False, True])
def test_under_full_activation_checkpointing_the_chunked_head_is_no_block_and_stays_exact(frozen: bool) -> None:
    """The head keeps nothing to recompute: activation checkpointing leaves it out (the embedding stays in)."""
    transformers = pytest.importorskip("transformers")
    from dptrain.parallel.activation_checkpointing import apply_activation_checkpointing
    from support.pretrained import hf_llama_config

    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(hf_llama_config())
    plain.lm_head.weight.requires_grad_(not frozen)
    chunked = copy.deepcopy(plain)
    assert apply_chunked_loss(chunked, chunk_tokens=4) is None
    blocks = apply_activation_checkpointing(chunked, mode="full")
    assert chunked.lm_head not in blocks and chunked.model.embed_tokens in blocks
    _compare(plain, chunked, _hf_batch(plain.config.vocab_size), num_items_in_batch=torch.tensor(17.0))
