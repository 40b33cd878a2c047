"""Named model shapes for the built-in LLaMA (`dptrain plan --model NAME`): `LlamaConfig` kwargs.

Each preset is the published architecture (width, depth, heads, kv-heads, FFN width, vocabulary,
RoPE base, untied embeddings) with the context it was pre-trained at as `max_seq_len` and the
training sequence length. `published` is the parameter count the model's release states (the
Hugging Face checkpoint's `num_parameters`, i.e. its safetensors total); tests/test_plan_search.py
checks that `LlamaLM` with these kwargs has exactly that many parameters. Sources:

- llama-7b: LLaMA (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models",
  table 2): 7B = dim 4096, 32 layers, 32 heads, trained at 2048 tokens; SwiGLU width 11008 and
  vocabulary 32000 from the released params.json / the HF config.
- llama2-7b / llama2-13b / llama2-70b: Llama 2 (Touvron et al. 2023, "Llama 2: Open Foundation
  and Fine-Tuned Chat Models", table 1: context 4096, GQA for 70B) and the HF configs of
  meta-llama/Llama-2-{7b,13b,70b}-hf (13B: dim 5120, 40 layers, 40 heads, FFN 13824; 70B: dim
  8192, 80 layers, 64 heads, 8 kv-heads, FFN 28672).
- llama3-8b / llama3-70b: Llama 3.1 ("The Llama 3 Herd of Models", 2024, table 3: 8B = dim
  4096, 32 layers, 32 heads, 8 kv-heads, FFN 14336; 70B = 8192, 80, 64, 8, 28672; vocabulary
  128256 (the HF config; the paper: 128K), RoPE base 500000), pre-trained at 8192 tokens
  (torchtitan's Llama 3 recipes use the same sequence length).
- llama3-405b: Llama 3.1 405B (same paper, table 3: dim 16384, 126 layers, 128 heads, 8 kv-heads, FFN
  53248; the HF config of meta-llama/Llama-3.1-405B), pre-trained at 8192 tokens.

Plain data: importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preset:
    """One model: its `LlamaConfig` kwargs, training sequence length and published size."""

    name: str
    kwargs: dict[str, Any]
    seq_len: int
    published: int
    source: str


def _llama(dim: int, n_layers: int, n_heads: int, ffn: int, *, kv: int | None = None, vocab: int = 32000,
           ctx: int = 4096, theta: float = 10000.0) -> dict[str, Any]:
    return {"vocab_size": vocab, "dim": dim, "n_layers": n_layers, "n_heads": n_heads,
            "n_kv_heads": kv if kv is not None else n_heads, "ffn_hidden": ffn, "max_seq_len": ctx,
            "tie_embeddings": False, "rope_theta": theta}


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("llama-7b", _llama(4096, 32, 32, 11008, ctx=2048), 2048, 6_738_415_616,
           "LLaMA (Touvron et al. 2023) table 2; HF huggyllama/llama-7b: 6.74B"),
    Preset("llama2-7b", _llama(4096, 32, 32, 11008), 4096, 6_738_415_616,
           "Llama 2 (Touvron et al. 2023) table 1; HF meta-llama/Llama-2-7b-hf: 6.74B"),
    Preset("llama2-13b", _llama(5120, 40, 40, 13824), 4096, 13_015_864_320,
           "Llama 2 table 1; HF meta-llama/Llama-2-13b-hf: 13.0B"),
    Preset("llama2-70b", _llama(8192, 80, 64, 28672, kv=8), 4096, 68_976_648_192,
           "Llama 2 table 1 (GQA); HF meta-llama/Llama-2-70b-hf: 69.0B"),
    Preset("llama3-8b", _llama(4096, 32, 32, 14336, kv=8, vocab=128256, ctx=8192, theta=500000.0), 8192,
           8_030_261_248, "The Llama 3 Herd of Models (2024) table 3; HF meta-llama/Llama-3.1-8B: 8.03B"),
    Preset("llama3-70b", _llama(8192, 80, 64, 28672, kv=8, vocab=128256, ctx=8192, theta=500000.0), 8192,
           70_553_706_496, "The Llama 3 Herd of Models table 3; HF meta-llama/Llama-3.1-70B: 70.6B"),
    Preset("llama3-405b", _llama(16384, 126, 128, 53248, kv=8, vocab=128256, ctx=8192, theta=500000.0), 8192,
           405_853_388_800, "The Llama 3 Herd of Models table 3; HF meta-llama/Llama-3.1-405B: 405.9B"),
]}


def preset(name: str) -> Preset:
    """The preset called `name` (case-insensitive); ValueError naming the valid ones."""
    found = PRESETS.get(name.lower())
    if found is None:
        raise ValueError(f"unknown --model {name!r} (valid: {', '.join(PRESETS)})")
    return found


def preset_overrides(p: Preset) -> dict[str, Any]:
    """The config dict a preset contributes (the lowest layer: CONFIG and overrides go on top)."""
    return {"model": {"factory": "dptrain.models.llama:build_llama", "kwargs": dict(p.kwargs)},
            "data": {"kwargs": {"seq_len": p.seq_len}}}
