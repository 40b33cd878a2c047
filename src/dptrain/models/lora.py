"""LoRA adapters through peft: `model.lora` applied to a Hugging Face model or the built-in LLaMA, and what the rest
of dptrain needs to know about a PEFT model (a user's factory may return one itself).

peft is an optional extra (`pip install 'dptrain[lora]'`): it is imported only when a model is wrapped, or found in
`sys.modules` when asking whether a model is a PEFT model (a model cannot hold peft's layers unless peft is loaded).

The adapters' init is peft's own (`LoraLayer.reset_lora_parameters`: A Kaiming-uniform, B zero, so the model starts
equal to its base). A model built on the meta device gets the same values from `parallel/materialize.py`, which
replays the base's init without the adapters and then `replay_adapter_init` for each LoRA layer, in the order
peft's injection drew them (see `replay_adapter_init`).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from dptrain.config import ConfigError, LoraConfig
from dptrain.config.lora import PEFT_MISSING

__all__ = [
    "ADAPTER_WEIGHTS",
    "adapter_config",
    "adapter_modules",
    "apply_lora",
    "base_name",
    "base_of",
    "default_targets",
    "is_peft_model",
    "lora_layers",
    "peft_model_of",
    "replay_adapter_init",
    "unsupported_init",
]

ADAPTER_WEIGHTS = ("lora_A", "lora_B")
"""The LoRA layers' adapter containers dptrain knows how to initialise (peft's nn.Linear adapters)."""
_PREFIX = "base_model.model."


def _peft() -> Any:
    try:
        import peft  # lazy: optional extra (dptrain[lora])
    except ImportError:
        raise ConfigError(f"model.lora.enabled=true {PEFT_MISSING}") from None
    return peft


def _loaded_peft() -> Any | None:
    return sys.modules.get("peft")


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a peft `PeftModel` (what `get_peft_model` returns)."""
    peft = _loaded_peft()
    return peft is not None and isinstance(model, peft.PeftModel)


def peft_model_of(model: nn.Module) -> Any | None:
    """The `PeftModel` `model` is, or None."""
    return model if is_peft_model(model) else None


def base_of(model: nn.Module) -> nn.Module:
    """The model peft wraps (`get_base_model()`: with its LoRA layers in place), or `model` itself."""
    return model.get_base_model() if is_peft_model(model) else model  # type: ignore[operator]


def base_name(name: str) -> str:
    """A PEFT model's module or parameter name as the base model called it: without the `base_model.model.` prefix
    and the `.base_layer` infix (the names of the base's own checkpoint files)."""
    if name == "base_model.model":
        return ""
    if name.startswith(_PREFIX):
        name = name[len(_PREFIX):]
    return name.replace(".base_layer.", ".").removesuffix(".base_layer")


def lora_layers(model: nn.Module) -> list[tuple[str, Any]]:
    """Every peft LoRA layer of `model`, in `named_modules()` order (the order peft injected them)."""
    peft = _loaded_peft()
    if peft is None:
        return []
    from peft.tuners.lora import LoraLayer  # lazy: optional extra (dptrain[lora])

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def adapter_modules(model: nn.Module) -> set[int]:
    """ids of every module inside a LoRA layer's adapter containers (lora_A, lora_B, ...): their tensors are written by
    `replay_adapter_init`, not by the base model's init."""
    out: set[int] = set()
    for _, layer in lora_layers(model):
        for attr in layer.adapter_layer_names:
            container = getattr(layer, attr, None)
            if isinstance(container, nn.Module):
                out.update(id(m) for m in container.modules())
    return out


def adapter_config(model: nn.Module, adapter: str) -> Any | None:
    """peft's config of `adapter` held by `model` (a PeftModel, or a model peft injected adapters into), or None."""
    configs = getattr(model, "peft_config", None)
    return configs.get(adapter) if isinstance(configs, dict) else None


def unsupported_init(model: nn.Module) -> str | None:
    """Why the adapters of `model` cannot be re-initialised by `replay_adapter_init` (so a meta build must be eager),
    or None."""
    for name, layer in lora_layers(model):
        for attr in layer.adapter_layer_names:
            container = getattr(layer, attr, None)
            if attr not in ADAPTER_WEIGHTS and container is not None and len(container) > 0:
                return f"LoRA layer {name!r} has {attr} adapters (only Linear adapters are replayed)"
        for adapter in layer.lora_A:
            config = adapter_config(model, adapter)
            init = True if config is None else config.init_lora_weights
            if init not in (True, False, "gaussian"):
                return f"LoRA adapter {adapter!r} uses init_lora_weights={init!r}, which reads the base weights"
    return None


def replay_adapter_init(model: nn.Module, layer: Any) -> None:
    """Draw `layer`'s adapters as peft's `update_layer` does, from the global RNG: for each adapter, A's and B's
    nn.Linear constructors (`reset_parameters`), then peft's own `reset_lora_parameters` (A Kaiming-uniform, B zero).
    Called by the meta-device init on CPU scratch tensors, in `lora_layers` order, after the base's init."""
    for adapter in layer.lora_A:
        config = adapter_config(model, adapter)
        layer.lora_A[adapter].reset_parameters()
        layer.lora_B[adapter].reset_parameters()
        layer.reset_lora_parameters(adapter, True if config is None else config.init_lora_weights)


def linear_names(model: nn.Module) -> list[str]:
    """Names of every nn.Linear in `model`."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else getattr(model, "head", None)


def default_targets(model: nn.Module) -> list[str]:
    """Every attention and MLP linear of `model` by its last name (peft's suffix match), never the output head
    (Hugging Face's `get_output_embeddings()`, the built-in LLaMA's `head`)."""
    head = _head(model)
    head_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is head}
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    return sorted(names - head_names)


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """`peft.get_peft_model(model, LoraConfig(...))` for `model.lora`: the base frozen, adapters on `cfg`'s targets
    (default: `default_targets`). A Hugging Face model gets task_type CAUSAL_LM when it is a causal LM (what
    `PeftModel.from_pretrained` and `AutoPeftModelForCausalLM` expect); the built-in LLaMA gets none (peft's custom
    model path). Refused with a ConfigError: a model that is already a PEFT model, or a target that matches nothing."""
    if is_peft_model(model):
        raise ConfigError("model.lora.enabled=true, but model.factory already returns a PEFT model (get_peft_model): "
                          "keep one of the two (model.lora.enabled=false uses the factory's adapters as they are)")
    peft = _peft()
    linears = linear_names(model)
    targets = list(cfg.target_modules) if cfg.target_modules is not None else default_targets(model)
    missing = [t for t in targets if not any(_matches(n, t) for n in linears)]
    if missing or not targets:
        have = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ConfigError(
            f"model.lora.target_modules={missing or targets!r} match(es) no linear layer of {type(model).__name__}; "
            f"its linears are named: {', '.join(have) or 'none'}"
        )
    task = "CAUSAL_LM" if _is_hf_causal_lm(model) else None
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                             task_type=task)
    return peft.get_peft_model(model, config)


def _is_hf_causal_lm(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return False
    return type(model).__name__.endswith("ForCausalLM")
