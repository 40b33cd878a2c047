"""Pretrained folders for the loading tests: tiny Hugging Face Llamas with random weights, saved with
`save_pretrained` into a test's tmp_path (nothing downloaded), and the helpers that build, lay out and
materialize a model on forked ranks exactly as the Trainer does (tests/test_pretrained_load.py,
tests/test_llama_hf.py). Importing this needs transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from support.hf import HEADS, HIDDEN, LAYERS, SEQ, VOCAB

PROBE = torch.arange(3, 3 + 2 * SEQ).reshape(2, SEQ) % VOCAB  # a fixed input for the logits


def hf_llama_config(*, tied: bool = False, **extra: Any) -> transformers.LlamaConfig:
    fields: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=2 * SEQ,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=tied, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    return transformers.LlamaConfig(**{**fields, **extra})


def save_hf_llama(folder: Path, *, tied: bool = False, seed: int = 0, std: float = 0.2, **extra: Any) -> Path:
    """A random tiny LlamaForCausalLM saved with save_pretrained. `std`: the weights' spread (HF's 0.02 makes
    every logit nearly equal, which would hide a wrong or missing weight)."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_llama_config(tied=tied, **extra))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    model.save_pretrained(str(folder))
    return folder


def hf_logits(folder: Path, ids: torch.Tensor = PROBE) -> torch.Tensor:
    """The logits of transformers' own `from_pretrained` of `folder` (the oracle)."""
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def layout_and_load(factory: str, kwargs: dict[str, Any], *, strategy: str, tp: int = 1) -> tuple[Any, Any]:
    """In a process group: build the model on meta (build_model_meta), lay it out over the world as the Trainer
    does (parallelize_model), materialize it with dptrain's Materializer. Returns (pmodel, materializer)."""
    import torch.distributed as dist

    from dptrain.config import ModelConfig, ParallelConfig
    from dptrain.config.layout import resolve_layout
    from dptrain.distributed.mesh import ParallelMesh
    from dptrain.parallel import parallelize_model
    from dptrain.parallel.materialize import make_materializer
    from dptrain.train.build import build_model_meta

    model, reason = build_model_meta(ModelConfig(factory=factory, kwargs=kwargs), seed=0)
    assert reason is None, reason
    cfg = ParallelConfig(strategy=strategy, tp=tp)
    dims, _ = resolve_layout(cfg, world_size=dist.get_world_size())
    mesh = ParallelMesh.build(dims, device_type="cpu")
    mat = make_materializer(device="cpu", seed=0)
    pmodel = parallelize_model(model, cfg=cfg, mesh=mesh, device=torch.device("cpu"), materialize=mat)
    return pmodel, mat
