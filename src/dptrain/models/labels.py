"""Which labels a language model expects: does it shift them itself, or must the data do it?

A next-token model is trained on ``labels[t] = input_ids[t + 1]``. Someone has to shift: the data
(the built-in LLaMA takes labels aligned with its predictions) or the model (a Hugging Face
``*ForCausalLM`` takes ``labels = input_ids`` and drops the first label inside its loss). Shifted
twice, every token learns to predict the one two places ahead; the loss still falls and nothing
fails. :func:`labels_shifted_by` tells which one a model is, so the data is built to match
(``dptrain.train.build.align_labels``).

A model says so itself with a class attribute ``shifts_labels`` (``True`` or ``False``); without one,
a ``transformers.PreTrainedModel`` whose class (or a base class) is a ``*ForCausalLM`` shifts, also
inside PEFT's ``PeftModel`` (looked through with ``get_base_model``).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["labels_shifted_by", "model_kind"]


def labels_shifted_by(model: Any) -> bool | None:
    """True: `model` shifts its labels itself (it wants ``labels = input_ids``, the prompt masked: a
    transformers causal LM); False: it wants labels aligned with its predictions (the built-in LLaMA,
    or any model declaring ``shifts_labels = False``); None: it does not say (the data's own default)."""
    model = _unwrapped(model)
    declared = getattr(type(model), "shifts_labels", None)
    if isinstance(declared, bool):
        return declared
    if _is_hf_causal_lm(model):
        return True
    return None


def model_kind(model: Any) -> str:
    """The model's class name for messages, with the PEFT wrapper named too (``PeftModelForCausalLM
    around LlamaForCausalLM``)."""
    inner = _unwrapped(model)
    if inner is model:
        return type(model).__name__
    return f"{type(model).__name__} around {type(inner).__name__}"


def _unwrapped(model: Any) -> Any:
    """The model under PEFT's wrapper (``PeftModel.get_base_model()``), else `model` itself. Only PEFT's
    classes are unwrapped: a transformers model's own ``base_model`` is its decoder without the head."""
    peft = sys.modules.get("peft")  # a model of peft's exists only once peft is imported
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def _is_hf_causal_lm(model: Any) -> bool:
    """A transformers model whose class, or a base class, is a causal LM of transformers' own registry
    (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: ``*ForCausalLM``, ``GPT2LMHeadModel``, ...) or named
    ``*ForCausalLM`` (a user's subclass of one, a model with remote code)."""
    transformers = sys.modules.get("transformers")  # likewise: no import of transformers for other models
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return False
    causal: set[str] = set()  # transformers' own registry of causal LMs (an attribute of the loaded module)
    for names in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        causal.update([names] if isinstance(names, str) else names)
    return any(c.__name__ in causal or c.__name__.endswith("ForCausalLM") for c in type(model).__mro__)
