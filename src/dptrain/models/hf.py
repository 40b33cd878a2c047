"""Hugging Face causal LMs built from a local folder's config on the meta device, loaded sharded.

    model.factory=dptrain.models.hf:causal_lm model.kwargs.pretrained=DIR

`causal_lm` builds `AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DIR, local_files_only=True))`
with every parameter on the meta device (nothing downloaded, no weights read) and attaches a
`PretrainedSource` (dptrain/models/pretrained.py): after the model is sharded, each rank reads only its own
shards of `DIR/*.safetensors` (dptrain/parallel/load_pretrained.py). Use it instead of a factory that calls
`from_pretrained` itself, which every rank runs in full before any sharding.

QLoRA (`model.kwargs.quantize=nf4` or `fp4`, with `model.lora`): the frozen base in 4 bits through bitsandbytes,
loaded by transformers' `from_pretrained(quantization_config=BitsAndBytesConfig(...))` onto this rank's GPU, whole
on every rank (strategy single or ddp: bitsandbytes' 4-bit weights are not FSDP2 shards). It needs a CUDA GPU and
the bitsandbytes package, and is refused with the reason on a machine without them. Written, not yet run on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain.config import ConfigError
from dptrain.models.pretrained import files_dtype, meta_parameters, read_index, source_for

__all__ = ["QUANTIZE", "causal_lm", "quantize_problem"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZE = ("nf4", "fp4")
"""`model.kwargs.quantize` values: bitsandbytes' 4-bit types (QLoRA's is nf4)."""


def quantize_problem(quantize: str) -> str | None:
    """Why a 4-bit base cannot be had on this machine, or None."""
    if quantize not in QUANTIZE:
        return f"model.kwargs.quantize={quantize!r} is not one of {', '.join(QUANTIZE)} (or null: no quantization)"
    if not torch.cuda.is_available():
        return (f"model.kwargs.quantize={quantize!r} (QLoRA's 4-bit base) needs a CUDA GPU and bitsandbytes, and this "
                "machine has no CUDA GPU; on a CPU, fine-tune with LoRA on the unquantized base (drop "
                "model.kwargs.quantize). The 4-bit path is written for GPUs and not yet run on one")
    if importlib.util.find_spec("bitsandbytes") is None:
        return (f"model.kwargs.quantize={quantize!r} needs bitsandbytes: pip install bitsandbytes (with the installed "
                "torch as a constraint)")
    return None


def _quantized(pretrained: str, quantize: str, attn: dict[str, Any]) -> nn.Module:
    """The 4-bit base, loaded whole onto this rank's GPU by transformers (not yet run on a GPU)."""
    import transformers  # lazy: the optional hf extra

    if torch.empty(()).device.type == "meta":  # the meta build: bitsandbytes' weights are made on load, eagerly
        raise RuntimeError("a 4-bit base is quantized while it is read, so it is loaded eagerly on every rank")
    bnb = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantize,
                                          bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(Path(pretrained)), quantization_config=bnb, dtype=torch.bfloat16, local_files_only=True,
        device_map={"": int(os.environ.get("LOCAL_RANK", "0"))}, **attn,
    )


def causal_lm(
    pretrained: str, dtype: str = "auto", attn_implementation: str | None = None, quantize: str | None = None
) -> nn.Module:
    """A transformers causal LM of the folder `pretrained` (config.json + model.safetensors[.index.json]),
    parameters on meta, to be loaded sharded. `dtype`: the parameters' dtype, `auto` for the files' own
    (`float32`, `bfloat16`, `float16` convert on load). `attn_implementation`: transformers' (e.g. `eager`,
    `sdpa`), None for its default. `quantize`: `nf4`/`fp4` for a 4-bit base (QLoRA; CUDA and bitsandbytes only,
    see the module docstring)."""
    try:
        import transformers  # lazy: the optional hf extra
    except ImportError:
        raise ConfigError(
            "model.factory='dptrain.models.hf:causal_lm' needs transformers: pip install -e '.[hf]'"
        ) from None
    index = read_index(pretrained)
    extra: dict[str, Any] = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if quantize is not None:
        problem = quantize_problem(quantize)
        if problem is not None:
            raise ConfigError(problem)
        return _quantized(pretrained, quantize, extra)
    if dtype == "auto":
        torch_dtype = files_dtype(index, folder=pretrained)
    elif dtype in _DTYPES:
        torch_dtype = _DTYPES[dtype]
    else:
        raise ConfigError(f"model.kwargs.dtype={dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    try:
        config = transformers.AutoConfig.from_pretrained(str(Path(pretrained)), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.kwargs.pretrained={pretrained!r}: its config.json cannot be used: {e}") from None
    with meta_parameters():
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype, **extra)
        except ValueError as e:  # a config of a model type that is not a causal LM
            raise ConfigError(f"model.kwargs.pretrained={pretrained!r} is not a causal LM's folder: {e}") from None
    source_for(model, pretrained, index, cast=dtype != "auto")
    return model
