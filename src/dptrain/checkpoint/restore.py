"""Loading a committed checkpoint folder into a `CheckpointState`: what the manager does once it has chosen one
(resume.py), from disk or from an in-memory snapshot rebuilt into a folder (snapshots/).

`meta.format_version` says how the files are laid out (`FORMAT_VERSION`; a manifest without one
was written before it existed: version 1). This dptrain reads `READABLE_VERSIONS` and refuses
any other, naming it. Version 2 keys the full format's `optim.pt` by parameter name (DCP's
layout) instead of by parameter index; everything else is as in version 1. Version 3 writes the
dcp format's optimizer state in DCP's flattened layout (hyperparameters keyed by parameter name,
checkpoint/state.py `_options`), so that ranks holding different parameters (pipeline stages)
never write the same key; everything else is as in version 2.

Before anything is loaded the checkpoint must fit this run: its format version, the base model its LoRA adapters
were trained on (base_identity.py), and the model section's hash (`model_config_hash`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dptrain import __version__
from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint import storage
from dptrain.checkpoint.base_identity import describe, same_base
from dptrain.checkpoint.state import CheckpointState, RngState
from dptrain.config import ModelConfig, to_dict

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


def config_hash(section: Any) -> str:
    """SHA-256 of a config (section) as canonical JSON."""
    return hashlib.sha256(json.dumps(to_dict(section), sort_keys=True).encode()).hexdigest()


def model_config_hash(model: ModelConfig) -> str:
    """`config_hash` of the model section, leaving out `lora` while it is disabled: a run written before the
    section existed, or one without LoRA, keeps the hash it was saved with and resumes."""
    body = to_dict(model)
    if not model.lora.enabled:
        body.pop("lora", None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def check_format_version(path: Path, meta: dict[str, Any], *, fresh: str = "--resume none") -> int:
    """The checkpoint's format version (1 when the manifest has none); CheckpointError naming it
    when this dptrain cannot read it."""
    version = meta.get("format_version", 1)
    if version not in READABLE_VERSIONS:
        raise mf.CheckpointError(
            f"{path}: checkpoint format version {version!r}, but this dptrain ({__version__}) reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; resume it with the dptrain that wrote it "
            f"(dptrain_version {meta.get('dptrain_version', 'unknown')}), or start afresh with {fresh}"
        )
    return int(version)


def load_checkpoint(state: CheckpointState, path: Path, meta: dict[str, Any], *, model: ModelConfig, rank: int,
                    world_size: int, fresh: str) -> int:
    """Load the committed checkpoint `path` (its manifest's `meta`) into `state`; the step it holds. Refused with a
    CheckpointError naming the way out (`fresh`: how the caller starts afresh): a format version this dptrain cannot
    read, adapters trained on another base model, another model config."""
    version = check_format_version(path, meta, fresh=fresh)
    saved_base, this_base = meta.get("base_model"), state.meta.get("base_model")
    if not same_base(saved_base, this_base):  # LoRA adapters hold no base weights: they fit only their own base
        raise mf.CheckpointError(
            f"{path}: its adapters were trained on the base model {describe(saved_base)}, but this run's base is "
            f"{describe(this_base)}; resume with the same base (model.factory, model.kwargs), or start afresh "
            f"with {fresh}"
        )
    want = model_config_hash(model)
    if meta.get("model_config_hash") not in (None, want):
        raise mf.CheckpointError(
            f"{path}: written for another model config (model section hash {meta['model_config_hash'][:12]}, "
            f"this run {want[:12]}); resume with the run's own model settings"
        )
    storage.load_model_optim(path, fmt=meta["format"], state=state, version=version)
    train = storage.load_torch(path / "train.pt")
    state.schedule.load_state_dict(train["scheduler"])
    if train["scaler"] and state.scaler is not None:
        state.scaler.load_state_dict(train["scaler"])
    state.train.load_state_dict(
        {
            "step": int(meta["step"]),
            "samples_seen": int(meta["samples_seen"]),
            "skipped_steps": int(meta.get("skipped_steps", 0)),
        }
    )
    state.data.load_state_dict(meta["sampler"])
    own = path / f"rank_{rank:05d}.pt"
    if own.is_file():
        rank_state = storage.load_torch(own)
        RngState().load_state_dict(rank_state["rng"])
        if meta["world_size"] == world_size:  # at a new world size the rest starts afresh
            for name, obj in state.per_rank.items():
                if name in rank_state:  # e.g. a compression hook's state, absent when saved without one
                    obj.load_state_dict(rank_state[name])
    return int(meta["step"])
