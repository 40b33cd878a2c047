"""Hugging Face causal LMs built from a local folder's config on the meta device, loaded sharded.

    model.factory=dptrain.models.hf:causal_lm model.kwargs.pretrained=DIR

`causal_lm` builds `AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DIR, local_files_only=True))`
with every parameter on the meta device (nothing downloaded, no weights read) and attaches a
`PretrainedSource` (dptrain/models/pretrained.py): after the model is sharded, each rank reads only its own
shards of `DIR/*.safetensors` (dptrain/parallel/load_pretrained.py). Use it instead of a factory that calls
`from_pretrained` itself, which every rank runs in full before any sharding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain.config import ConfigError
from dptrain.models.pretrained import files_dtype, meta_parameters, read_index, source_for

__all__ = ["causal_lm"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def causal_lm(pretrained: str, dtype: str = "auto", attn_implementation: str | None = None) -> nn.Module:
    """A transformers causal LM of the folder `pretrained` (config.json + model.safetensors[.index.json]),
    parameters on meta, to be loaded sharded. `dtype`: the parameters' dtype, `auto` for the files' own
    (`float32`, `bfloat16`, `float16` convert on load). `attn_implementation`: transformers' (e.g. `eager`,
    `sdpa`), None for its default."""
    try:
        import transformers  # lazy: the optional hf extra
    except ImportError:
        raise ConfigError(
            "model.factory='dptrain.models.hf:causal_lm' needs transformers: pip install -e '.[hf]'"
        ) from None
    index = read_index(pretrained)
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
    extra: dict[str, Any] = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with meta_parameters():
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype, **extra)
        except ValueError as e:  # a config of a model type that is not a causal LM
            raise ConfigError(f"model.kwargs.pretrained={pretrained!r} is not a causal LM's folder: {e}") from None
    source_for(model, pretrained, index, cast=dtype != "auto")
    return model
