"""The built-in LLaMA <-> Hugging Face's `LlamaForCausalLM`: configs and parameter names, both ways.

The two compute the same function, so weights move between them by renaming alone:

- rotary embeddings: both rotate the two halves of each head (`apply_rope` here, `rotate_half` in
  transformers), with the same frequencies `theta ** (-2i / head_dim)`, in float32. No permutation of the
  q/k projections is needed (torchtitan's converter permutes because its LLaMA rotates interleaved pairs);
- RMSNorm: x * rsqrt(mean(x^2) + eps) in float32, cast back, times the weight, in both;
- SwiGLU: `w1`/`w3`/`w2` are HF's `gate_proj`/`up_proj`/`down_proj`; attention is scaled dot-product with
  1/sqrt(head_dim), grouped KV heads repeated, no biases.

What the built-in cannot represent (biases, rope scaling, another activation, a head_dim that is not
hidden_size / num_attention_heads, dropout) is refused naming the config.json field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dptrain.config import ConfigError

__all__ = ["hf_config", "hf_key", "llama_kwargs"]

_LAYER = [  # built-in name inside layers.{i} -> HF name inside model.layers.{i}
    ("attn.wq", "self_attn.q_proj"), ("attn.wk", "self_attn.k_proj"), ("attn.wv", "self_attn.v_proj"),
    ("attn.wo", "self_attn.o_proj"), ("mlp.w1", "mlp.gate_proj"), ("mlp.w3", "mlp.up_proj"),
    ("mlp.w2", "mlp.down_proj"), ("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
]
_TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")


def hf_key(name: str) -> str:
    """The HF key of a built-in LLaMA parameter name (`layers.0.attn.wq.weight` -> `model.layers.0.self_attn.
    q_proj.weight`); a name with no counterpart is returned as it is (and then matches no key)."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_RE.match(name)
    if m:
        for ours, theirs in _LAYER:
            if m[2] == ours:
                return f"model.layers.{m[1]}.{theirs}.weight"
    return name


# config.json fields the built-in LLaMA reads: HF field -> build_llama kwarg
_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads", "intermediate_size": "ffn_hidden",
    "max_position_embeddings": "max_seq_len", "tie_word_embeddings": "tie_embeddings",
    "rms_norm_eps": "norm_eps",
}
# fields the built-in cannot represent: field -> (the only value it supports, what it would take)
_FIXED: dict[str, tuple[Any, str]] = {
    "hidden_act": ("silu", "SwiGLU with SiLU only"),
    "attention_bias": (False, "no biases in attention"),
    "mlp_bias": (False, "no biases in the MLP"),
    "attention_dropout": (0.0, "no attention dropout"),
    "pretraining_tp": (1, "no pretraining_tp slicing"),
}
OVERRIDABLE = ("max_seq_len",)
"""build_llama kwargs that may differ from the folder's (a shorter context than max_position_embeddings)."""


def llama_kwargs(config: dict[str, Any], *, folder: str | Path, given: dict[str, Any]) -> dict[str, Any]:
    """build_llama's kwargs for a HF Llama config.json (`config`). `given`: kwargs the user set explicitly,
    which must agree with the folder (max_seq_len may be lower). ConfigError naming the field otherwise."""
    where = f"model.kwargs.pretrained={str(folder)!r}"
    if config.get("model_type") != "llama":
        raise ConfigError(
            f"{where} holds a {config.get('model_type')!r} model (config.json model_type); the built-in LLaMA "
            "loads Hugging Face Llama folders only (model_type 'llama'); use model.factory=dptrain.models.hf:causal_lm"
        )
    for name, (ok, why) in _FIXED.items():
        if name in config and config[name] not in (ok, None):
            raise ConfigError(f"{where}: config.json {name}={config[name]!r}; the built-in LLaMA has {why}")
    kwargs = {ours: config[theirs] for theirs, ours in _FIELDS.items() if config.get(theirs) is not None}
    kwargs.setdefault("tie_embeddings", False)
    kwargs["rope_theta"] = float(_rope_theta(config, where=where))
    heads, hidden = kwargs.get("n_heads"), kwargs.get("dim")
    head_dim = config.get("head_dim")
    if head_dim is not None and isinstance(heads, int) and isinstance(hidden, int) and head_dim * heads != hidden:
        raise ConfigError(
            f"{where}: config.json head_dim={head_dim} is not hidden_size/num_attention_heads={hidden}/{heads}; the "
            "built-in LLaMA derives the head size from those two"
        )
    for name, value in given.items():
        mine = kwargs.get(name)
        if name in OVERRIDABLE and isinstance(mine, int) and isinstance(value, int) and value <= mine:
            kwargs[name] = value
        elif mine != value:
            field = next((k for k, v in _FIELDS.items() if v == name), name)
            raise ConfigError(
                f"model.kwargs.{name}={value!r} contradicts {where} (config.json {field}={mine!r}); with pretrained, "
                "the folder's config sets the model's dimensions: drop model.kwargs." + name
            )
    return kwargs


def _rope_theta(config: dict[str, Any], *, where: str) -> Any:
    """rope_theta of a transformers 5 (`rope_parameters`) or 4 (`rope_theta`, `rope_scaling`) config.json."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        field = "rope_parameters" if params else "rope_scaling"
        raise ConfigError(
            f"{where}: config.json {field} has rope_type={kind!r}; the built-in LLaMA has plain rotary embeddings "
            "(rope_type 'default') only"
        )
    return params.get("rope_theta", config.get("rope_theta", 10000.0))


def hf_config(cfg: Any) -> dict[str, Any]:
    """The LlamaConfig(**...) arguments of transformers for a built-in `dptrain.models.llama.LlamaConfig`."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "dtype": "float32",
    }
