"""`dptrain ckpt export RUN_OR_CKPT --merge --out DIR`: a LoRA run's adapters merged into its base, written as a
full model (peft's own `merge_and_unload`). A Hugging Face base: `save_pretrained(DIR)` (config.json +
model.safetensors, loadable by AutoModelForCausalLM.from_pretrained); any other model: DIR/model.safetensors under
the base model's names."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint.resume import choose_checkpoint
from dptrain.config import ConfigError
from dptrain.config.load import load_config

__all__ = ["export_merged", "run_config_of"]


def run_config_of(target: Path) -> Path:
    """The config.yaml of the run `target` (a run directory, its checkpoints/ folder or a step folder) belongs to."""
    for folder in (target, target.parent, target.parent.parent):
        if (folder / "config.yaml").is_file():
            return folder / "config.yaml"
    raise ConfigError(f"ckpt export --merge: no config.yaml in {target} or the two folders above it; --merge "
                      "rebuilds the run's base model from its config: pass the run directory of `dptrain run`")


def export_merged(args: argparse.Namespace, *, root: Path) -> int:
    """The body of `ckpt export --merge` (`root`: the folder holding the step folders)."""
    # lazy: torch: loaded only when a checkpoint is read
    from dptrain.checkpoint import storage
    from dptrain.checkpoint.adapters import merge_adapters
    from dptrain.checkpoint.base_identity import base_record, describe, same_base
    from dptrain.train.build import build_model

    out, target = Path(args.out), Path(args.target)
    if out.is_file():
        raise ConfigError(f"ckpt export --merge --out {args.out!r} is a file; --merge writes a folder (config.json "
                          "and model.safetensors): name a directory")
    cfg = load_config(run_config_of(target))
    choice = choose_checkpoint(str(target), root=root, trust=args.trust_checkpoint)
    if choice.error or choice.path is None:
        raise ConfigError(choice.error or f"no valid checkpoint under {target}")
    model = build_model(cfg.model, seed=cfg.train.seed)  # the base (its folder, or its seeded build) + adapters
    base = base_record(model, factory=cfg.model.factory, kwargs=cfg.model.kwargs, seed=cfg.train.seed)
    if base is None:
        raise ConfigError(f"ckpt export --merge: the run's model ({cfg.model.factory}) has no LoRA adapters to merge; "
                          "export without --merge")
    if not same_base(choice.meta.get("base_model"), base):
        raise ConfigError(f"{choice.path}: its adapters were trained on {describe(choice.meta.get('base_model'))}, "
                          f"but the run's model.factory now builds {describe(base)}")
    try:
        state = storage.load_full_model_state(Path(choice.path), fmt=choice.meta["format"])
    except mf.CheckpointError as e:
        print(f"dptrain: error: {e}", file=sys.stderr)
        return 1
    merged = merge_adapters(model, state)
    out.mkdir(parents=True, exist_ok=True)
    if callable(getattr(merged, "save_pretrained", None)):
        merged.save_pretrained(str(out))
    else:
        storage.save_safetensors(merged.state_dict(), out / "model.safetensors")
    print(f"merged the adapters of {choice.path} (step {choice.meta['step']}) into {describe(base)}; wrote {out}")
    return 0
