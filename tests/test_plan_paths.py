"""The planner's memory paths (plan/llama.py, plan/memory.py) against what this CPU really holds: pure half-precision
parameters (fsdp_param_dtype) against autocast over fp32, dptrain's selective and full activation checkpointing, the
recompute working set once per stage, interleaved pipeline schedules, and torchtitan's selective policy (what the
published torchtitan rows are predicted with)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dptrain.models.llama import LlamaConfig, LlamaLM
from dptrain.parallel.activation_checkpointing import apply_activation_checkpointing
from dptrain.tools.plan import memory
from dptrain.tools.plan.gpt import Block, torchtitan_layer_bytes
from dptrain.tools.plan.llama import (
    activation_parts,
    block_activation_bytes,
    kept_block_bytes,
    outside_activation_bytes,
)
from support.alive import alive_after_forward

pytestmark = pytest.mark.fast

CONFIGS = [
    dict(vocab_size=256, dim=64, n_layers=1, n_heads=4),
    dict(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, tie_embeddings=True),
    dict(vocab_size=300, dim=96, n_layers=2, n_heads=6, n_kv_heads=1, ffn_hidden=200, max_seq_len=40),
]
PATHS = [("fp32", None), ("bf16", None), ("bf16", "bf16"), ("fp16", "fp16")]  # (autocast dtype, parameter dtype)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _measured(kw: dict, precision: str, param_dtype: str | None, checkpointing: str, batch: int, seq: int) -> int:
    cfg = LlamaConfig(**kw)
    torch.manual_seed(0)
    model = LlamaLM(cfg)
    if param_dtype:  # what FSDP2's MixedPrecisionPolicy(param_dtype) hands the forward: half parameters
        model = model.to(DTYPES[param_dtype])
    # the planner counts the rope tables (the cos/sin slices the graph saves keep them alive): a table of another
    # dtype makes the forward rebuild them (LlamaLM._rope), so that they are storages the forward made, as under .to()
    model.rope_cos = model.rope_cos.double()
    apply_activation_checkpointing(model, mode=checkpointing)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    return alive_after_forward(model, ids, DTYPES.get(precision))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kw", CONFIGS)
@pytest.mark.parametrize("precision,param_dtype", PATHS)
@pytest.mark.parametrize("checkpointing", ["none", "selective", "selective_torchtitan", "full"])
def test_what_each_path_keeps_equals_what_stays_alive(kw, precision, param_dtype, checkpointing):
    B, T = 3, 24
    measured = _measured(kw, precision, param_dtype, checkpointing, B, T)
    kept, _ = activation_parts(LlamaConfig(**kw), batch=B, seq=T, precision=precision, checkpointing=checkpointing,
                               param_dtype=param_dtype)
    assert kept == pytest.approx(measured, rel=0.10)  # the bar; exact on torch 2.13 CPU
    assert kept == measured


@pytest.mark.timeout(60)
def test_pure_half_saves_no_weight_copy_and_a_half_residual_stream():
    cfg = LlamaConfig(**CONFIGS[1])
    kw = dict(batch=2, seq=16, precision="bf16")
    autocast = block_activation_bytes(cfg, **kw)
    pure = block_activation_bytes(cfg, param_dtype="bf16", **kw)
    assert pure < autocast
    assert kept_block_bytes(cfg, checkpointing="full", param_dtype="bf16", **kw) == 2 * 2 * 16 * cfg.dim
    assert kept_block_bytes(cfg, checkpointing="full", **kw) == 4 * 2 * 16 * cfg.dim
    sel = kept_block_bytes(cfg, checkpointing="selective", param_dtype="bf16", **kw)
    titan = kept_block_bytes(cfg, checkpointing="selective_torchtitan", param_dtype="bf16", **kw)
    assert kept_block_bytes(cfg, checkpointing="full", param_dtype="bf16", **kw) < titan < sel < pure


def _layout(**kw) -> memory.Layout:
    base = dict(strategy="fsdp", dp_shard=8, tp=1, pp=1, micro_batch=1, seq=2048, precision="bf16", optimizer="adamw")
    return memory.Layout(**{**base, **kw})


@pytest.mark.timeout(30)
def test_recompute_working_set_is_counted_once_per_stage():
    cfg = LlamaConfig(vocab_size=32000, dim=1024, n_layers=16, n_heads=16, max_seq_len=2048)
    for ckpt in ("full", "selective", "selective_torchtitan"):
        one = memory.rank_memory(cfg, _layout(pp=4, pp_microbatches=1, micro_batch=1, checkpointing=ckpt), 0)
        four = memory.rank_memory(cfg, _layout(pp=4, pp_microbatches=4, micro_batch=4, checkpointing=ckpt), 0)
        kept, work = activation_parts(cfg, batch=1, seq=2048, precision="bf16", checkpointing=ckpt, n_layers=4,
                                      outside=False)
        assert one["in_flight"] == 1 and four["in_flight"] == 4 and four["stage"] == 0
        assert one["activations"] == kept + work  # stage 0 has the embedding only: no outside part
        assert four["activations"] == 4 * kept + work  # the working set once, not per micro-batch in flight


@pytest.mark.timeout(30)
def test_interleaved_schedule_holds_more_micro_batches_on_fewer_layers():
    cfg = LlamaConfig(vocab_size=32000, dim=1024, n_layers=16, n_heads=16, max_seq_len=2048)
    plain = memory.rank_memory(cfg, _layout(pp=4, pp_microbatches=8, micro_batch=8), 0)
    inter = memory.rank_memory(cfg, _layout(pp=4, pp_microbatches=8, micro_batch=8, pp_schedule="interleaved_1f1b",
                                            pp_stages_per_rank=2), 0)
    # torch's ScheduleInterleaved1F1B: rank 0 runs (v-1)*p + 2*(p-1) + 1 forward chunks of L/(p*v) layers before
    # its first backward, here 4 + 6 + 1 = 11 chunks of 2 layers, against 1F1B's 4 micro-batches of 4 layers
    assert plain["in_flight"] == 4 and inter["in_flight"] == 11
    per_layer, _ = activation_parts(cfg, batch=1, seq=2048, precision="bf16", n_layers=1, outside=False)
    assert plain["activations"] == 16 * per_layer and inter["activations"] == 22 * per_layer
    assert memory.pipeline_bubble(4, 8, 2) == pytest.approx(3 / 19) and memory.pipeline_bubble(4, 8, 1) == 3 / 11


def _torchtitan_context():
    """torchtitan's op-level selective policy (torchtitan/distributed/activation_checkpoint.py, Dec 2024): save the
    outputs of mm and attention, except every second mm of the block."""
    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default}
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == aten.mm.default:
            meta[key] += 1
        keep = func in save and not (func == aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kw", CONFIGS[1:])
def test_torchtitan_selective_saved_set_equals_what_stays_alive(kw):
    # plan/gpt.py's torchtitan count (used for the published torchtitan rows), on dptrain's LLaMA block, whose seven
    # linears run in torchtitan's order (wq, wk, wv, wo, w1, w3, w2), with bf16 parameters as FSDP2 gathers them
    cfg = LlamaConfig(**kw)
    torch.manual_seed(0)
    model = LlamaLM(cfg).to(torch.bfloat16)
    model.rope_cos = model.rope_cos.double()  # rebuilt by the forward: counted, as the formulas count it
    for block in model.layers:
        checkpoint(block, context_fn=_torchtitan_context)
    B, T = 3, 24
    measured = alive_after_forward(model, torch.randint(0, cfg.vocab_size, (B, T + 1)), torch.bfloat16)
    blk = Block(h=cfg.dim, a=cfg.n_heads, layers=cfg.n_layers, ffn=cfg.ffn_hidden, kv=cfg.n_kv_heads * cfg.head_dim,
                vocab=cfg.vocab_size)
    predicted = cfg.n_layers * torchtitan_layer_bytes(s=T, b=B, blk=blk, checkpointing="selective")
    predicted += outside_activation_bytes(cfg, batch=B, seq=T, precision="bf16", param_dtype="bf16")
    assert predicted == measured


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kw", CONFIGS[1:])
@pytest.mark.parametrize("precision,param_dtype", [("fp32", None), ("bf16", None), ("bf16", "bf16")])
def test_selective_torchtitan_keeps_what_torchtitans_own_policy_keeps(kw, precision, param_dtype):
    """dptrain's `selective_torchtitan` against a transcription of torchtitan's policy (`_torchtitan_context`, above),
    applied by hand: the same storages stay alive, on every precision path."""
    B, T = 3, 24
    mine = _measured(kw, precision, param_dtype, "selective_torchtitan", B, T)
    cfg = LlamaConfig(**kw)
    torch.manual_seed(0)
    model = LlamaLM(cfg)
    if param_dtype:
        model = model.to(DTYPES[param_dtype])
    model.rope_cos = model.rope_cos.double()
    for block in model.layers:
        checkpoint(block, context_fn=_torchtitan_context)
    theirs = alive_after_forward(model, torch.randint(0, cfg.vocab_size, (B, T + 1)), DTYPES.get(precision))
    assert mine == theirs
    assert mine < _measured(kw, precision, param_dtype, "selective", B, T)
