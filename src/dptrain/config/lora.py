"""Torch-free checks of `model.lora` (LoRA adapters through peft), run by `validate` before any process starts.
The checks that need the model (a target that matches no module) run where the model is built
(`dptrain.models.lora.apply_lora`, also called by the launcher's meta build)."""

from __future__ import annotations

import importlib.util

from dptrain.config.fields import Config, ConfigError, LoraConfig

__all__ = ["PEFT_MISSING", "peft_missing", "validate_lora"]

PEFT_MISSING = ("needs peft, which is not installed: pip install 'dptrain[lora]' (peft>=0.21,<1), with the installed "
                "torch as a constraint")


def peft_missing() -> bool:
    """True when `import peft` would fail (checked without importing it)."""
    return importlib.util.find_spec("peft") is None


def validate_lora(cfg: Config) -> None:
    """model.lora: peft importable, target names, and the layouts LoRA is not built for yet (tp, pp)."""
    lora: LoraConfig = cfg.model.lora
    quantize = cfg.model.kwargs.get("quantize") if isinstance(cfg.model.kwargs, dict) else None
    if quantize is not None and not lora.enabled:
        raise ConfigError(f"model.kwargs.quantize={quantize!r}: a 4-bit base cannot be trained itself, only adapters "
                          "on it (QLoRA); set model.lora.enabled=true, or drop model.kwargs.quantize")
    if not lora.enabled:
        return
    if peft_missing():
        raise ConfigError(f"model.lora.enabled=true {PEFT_MISSING}")
    targets = lora.target_modules
    if targets is not None and (not targets or not all(isinstance(t, str) and t.strip() for t in targets)):
        raise ConfigError(f"model.lora.target_modules={list(targets)!r} is not valid; give module names such as "
                          "[q_proj, v_proj], or null for every attention and MLP linear")
    if quantize is not None and cfg.parallel.strategy not in ("single", "ddp"):
        raise ConfigError(
            f"model.kwargs.quantize={quantize!r} (a 4-bit base, QLoRA) with parallel.strategy="
            f"{cfg.parallel.strategy!r}: bitsandbytes' 4-bit weights are not FSDP2 or ZeRO shards; use "
            "parallel.strategy=ddp (every rank holds the 4-bit base, only the adapters are reduced) or single"
        )
    for name, degree in (("tp", cfg.parallel.tp), ("pp", cfg.parallel.pp)):
        if degree != 1:
            raise ConfigError(
                f"model.lora.enabled=true cannot be used with parallel.{name}={degree} yet: the tensor-parallel plans "
                "and the pipeline split are written for the plain model's linears, not for peft's LoRA layers; use "
                "parallel.strategy=ddp, zero1, zero2 or fsdp (LoRA's base weights are frozen, so fsdp already keeps "
                "only 1/world of them per rank)"
            )
