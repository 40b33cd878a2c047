"""Hugging Face's `save_pretrained` layout for `final/` of a transformers model.

`final/model.safetensors` (checkpoint/storage.save_safetensors, plain parameter names) is already
the file `from_pretrained` reads; beside it this writes what a transformers model needs to be
rebuilt: `config.json` (the model's own config, with `architectures` and `dtype` set as
`save_pretrained` sets them) and `generation_config.json` for a generative model. So
`AutoModelForCausalLM.from_pretrained(RUN_DIR / "final")` loads the trained weights.

It is automatic: a model whose class is a `transformers.PreTrainedModel` gets the files, any
other model gets none (transformers is never imported for it). Tied weights (an `lm_head` tied to
the input embedding) are written under both names with the same values; `from_pretrained`
ties them again, as the config says.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from dptrain.checkpoint.storage import load_full_model_state
from dptrain.config import ConfigError
from dptrain.models.llama import llama_config
from dptrain.models.llama_hf import hf_config, hf_key


def is_pretrained_model(module: nn.Module) -> bool:
    """A transformers model (looked up only when transformers is already imported: it built the model)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def save_pretrained_config(module: nn.Module, state: dict[str, torch.Tensor], final_dir: Path) -> list[str]:
    """Write config.json (and generation_config.json) of `module` into `final_dir`; the file names
    written, none for a model that is not a transformers model."""
    if not is_pretrained_model(module):
        return []
    model: Any = module
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    floating = [t.dtype for t in state.values() if t.is_floating_point()]
    if floating:
        config.dtype = floating[0]  # what the weights were saved in, as save_pretrained records it
    final_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(final_dir))
    written = ["config.json"]
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(str(final_dir))
        written.append("generation_config.json")
    return written


def export_llama_hf(ckpt_dir: Path, *, fmt: str, model_kwargs: dict[str, Any], out_dir: Path) -> list[str]:
    """Write the built-in LLaMA's checkpoint `ckpt_dir` (a step folder of format `fmt`) as a Hugging Face
    Llama folder that `transformers.LlamaForCausalLM.from_pretrained(out_dir)` loads: config.json (dims,
    rope theta, norm eps, the tie flag), generation_config.json and model.safetensors under HF's names (no
    permutation: the rotary layouts agree, see dptrain/models/llama_hf.py). `model_kwargs`: the run's
    model.kwargs of build_llama. A tied head is written once, as `model.embed_tokens.weight`
    (save_pretrained's layout). Needs transformers."""
    llama = llama_config(model_kwargs)
    state = load_full_model_state(ckpt_dir, fmt=fmt)
    try:
        import transformers  # lazy: the optional hf extra
    except ImportError:
        raise ConfigError("ckpt export --format hf needs transformers: pip install -e '.[hf]'") from None
    tensors = {}
    for name, t in state.items():
        if llama.tie_embeddings and name == "head.weight":
            continue
        key = hf_key(name)
        if key == name:
            raise ValueError(f"the built-in LLaMA's state has {name!r}, which has no Hugging Face Llama name")
        tensors[key] = t.detach().to("cpu", torch.float32).contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(**hf_config(llama))
    config.save_pretrained(str(out_dir))
    transformers.GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return ["config.json", "generation_config.json", "model.safetensors"]
