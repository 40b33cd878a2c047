"""`dptrain ckpt export RUN_OR_CKPT --merge --out DIR`: a LoRA run's adapters merged into its base, written as a
full model (peft's own `merge_and_unload`). A Hugging Face base: `save_pretrained(DIR)` (config.json +
model.safetensors, loadable by AutoModelForCausalLM.from_pretrained); any other model: DIR/model.safetensors under
the base model's names."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint.resume import EXPORT, choose_checkpoint
from dptrain.config import ConfigError
from dptrain.config.load import load_config

__all__ = ["chosen_for_export", "export_merged", "run_config_of"]


def chosen_for_export(target: Path, *, root: Path, trust: bool) -> tuple[Path, dict[str, Any]]:
    """The step folder `ckpt export` reads from `target` (a step folder or a run dir's newest valid one) and its
    manifest's meta, the choice's messages printed; ConfigError in the command's own words when there is none."""
    choice = choose_checkpoint(str(target), root=root, trust=trust, words=EXPORT)
    if choice.error or choice.path is None:
        raise ConfigError(choice.error or f"no valid checkpoint under {target}")
    for line in choice.messages:
        print(line, file=sys.stderr)
    return Path(choice.path), choice.meta


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
    from dptrain.train.merge_export import write_merged

    out, target = Path(args.out), Path(args.target)
    if out.is_file():
        raise ConfigError(f"ckpt export --merge --out {args.out!r} is a file; --merge writes a folder (config.json "
                          "and model.safetensors): name a directory")
    cfg = load_config(run_config_of(target))
    path, meta = chosen_for_export(target, root=root, trust=args.trust_checkpoint)
    try:
        what = write_merged(cfg, ckpt=path, meta=meta, out=out)
    except mf.CheckpointError as e:
        print(f"dptrain: error: {e}", file=sys.stderr)
        return 1
    print(f"{what}; wrote {out}")
    return 0
