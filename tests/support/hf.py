"""Tiny Hugging Face models built in code (nothing downloaded), their dict-batch data, the overrides
that train them with plain SGD, and the single-process reference (tests/test_hf_models.py,
test_hf_pretrained.py, test_tensor_parallel.py, test_plan_measure.py). Importing this needs
transformers: callers `pytest.importorskip("transformers")` first."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch.utils.data import Dataset, default_collate

from dptrain.data import GlobalBatchSampler
from support.parity import SEED

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
        f"model.factory=support.hf:tiny_{model}",
        "data.factory=support.hf:hf_batches",
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
