"""The merged full model of a LoRA run (`dptrain ckpt export --merge`): the run's model built again from its config
(the base from its folder or its seeded build, then the adapters), a checkpoint's adapters put in, peft's own
`merge_and_unload`, written as `save_pretrained` (Hugging Face models) or DIR/model.safetensors (any other)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dptrain.checkpoint import storage
from dptrain.checkpoint.adapters import merge_adapters
from dptrain.checkpoint.base_identity import base_record, describe, same_base
from dptrain.config import Config, ConfigError
from dptrain.parallel.materialize import materialize
from dptrain.train.build import build_model_meta

__all__ = ["write_merged"]


def write_merged(cfg: Config, *, ckpt: Path, meta: dict[str, Any], out: Path) -> str:
    """Merge the adapters of checkpoint `ckpt` (its manifest's `meta`) into the base `cfg` builds; write the full
    model into the folder `out`; return what was merged into what, in words. ConfigError: the run has no adapters,
    or its base is not the one the adapters were trained on."""
    model, eager = build_model_meta(cfg.model, seed=cfg.train.seed)  # as the run built it
    if eager is None:  # on meta: a pretrained base read from its files, or the seeded init replayed (as eager)
        materialize(model, device="cpu", seed=cfg.train.seed)
    base = base_record(model, factory=cfg.model.factory, kwargs=cfg.model.kwargs, seed=cfg.train.seed)
    if base is None:
        raise ConfigError(f"ckpt export --merge: the run's model ({cfg.model.factory}) has no LoRA adapters to merge; "
                          "export without --merge")
    if not same_base(meta.get("base_model"), base):
        raise ConfigError(f"{ckpt}: its adapters were trained on {describe(meta.get('base_model'))}, but the run's "
                          f"model.factory now builds {describe(base)}")
    merged = merge_adapters(model, storage.load_full_model_state(ckpt, fmt=meta["format"]))
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained = getattr(merged, "save_pretrained", None)
    if callable(save_pretrained):
        save_pretrained(str(out))
    else:
        storage.save_safetensors(merged.state_dict(), out / "model.safetensors")
    return f"the adapters of {ckpt} (step {meta['step']}) merged into {describe(base)}"
