"""A tiny Hugging Face Llama over bytes and one prompt/response to memorise (tests/test_labels.py,
tests/test_labels_follow_model.py): nothing downloaded, the bytes tokenizer (256 ids, end of document 0).
Importing this needs transformers: callers `pytest.importorskip("transformers")` first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from dptrain.data.finetune import FineTuneRows, build_finetune

PROMPT, RESPONSE = "Q: the colours? ", "blue green red gold"


def tiny_byte_llama() -> transformers.LlamaForCausalLM:
    """A 2-layer LlamaForCausalLM over the bytes tokenizer's 256 ids (pad = end of document = 0)."""
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, bos_token_id=None, eos_token_id=0, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


def write_one_example(path: Path) -> Path:
    path.write_text(json.dumps({"prompt": PROMPT, "response": RESPONSE}) + "\n")
    return path


def shifted_rows(**kwargs: Any) -> tuple[FineTuneRows, FineTuneRows | None]:
    """The fine-tuning rows with `shift=True` forced, as `data.source=FILE.jsonl` gave every model before its
    labels followed the model: a data factory of the user's own, below the check of `data.kwargs.shift`."""
    return build_finetune(**kwargs, shift=True)


def true_next_token_loss(model: torch.nn.Module) -> float:
    """The response's next-token cross-entropy under the model, by transformers' own loss (labels = the
    inputs, the prompt masked, shifted inside the model): what memorising the response means."""
    ids = torch.tensor([[*PROMPT.encode(), *RESPONSE.encode(), 0]])
    labels = ids.clone()
    labels[:, : len(PROMPT.encode())] = -100
    with torch.no_grad():
        return float(model(input_ids=ids, labels=labels).loss)


def greedy_response(model: torch.nn.Module) -> str:
    """The model's greedy continuation of the prompt, as many bytes as the response (and its end) has."""
    ids = torch.tensor([list(PROMPT.encode())])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(RESPONSE) + 1,
                             do_sample=False, pad_token_id=0, eos_token_id=0)
    return bytes(t for t in out[0, ids.shape[1]:].tolist() if t != 0).decode(errors="replace")
