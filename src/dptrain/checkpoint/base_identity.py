"""The identity of the frozen base model under LoRA adapters: what an adapter checkpoint records instead of the base's
weights, and what a resume compares (`CheckpointManager` refuses another base, naming both).

What is hashed, and why (`folder_fingerprint`): a base may be 140 GB, and a run computes its identity once at the
start, so reading every byte (minutes for 140 GB) is too slow to do on every start. The fingerprint is the SHA-256
of `config.json` and, for each `*.safetensors` file in name order, its name, its size, its whole header (every
tensor's name, dtype, shape and offsets) and 16 samples of 4 KiB spread evenly over its data (64 KiB per file; about
1.3 MB read for a 70B model's 20 files). Two bases of the same architecture, such as a model and a fine-tune of it,
share headers and sizes but differ in nearly every weight, so the samples tell them apart. A change confined to a few
weights between the samples is not seen: such a base counts as the same one.

A base with no folder (a factory that builds it from scratch) is identified by the model section (factory and
kwargs) and the seed it was initialised with (`random_base`); the record says so (`folder`: null).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

from torch import nn

from dptrain.models import lora

__all__ = [
    "SAMPLES", "SAMPLE_BYTES", "base_record", "base_folder", "describe", "folder_base", "folder_fingerprint",
    "random_base", "same_base",
]

SAMPLES = 16
SAMPLE_BYTES = 4096


def _file_digest(h: Any, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        head = f.read(8)
        h.update(head)
        if len(head) < 8:
            return
        (n,) = struct.unpack("<Q", head)
        h.update(f.read(min(n, max(size - 8, 0))))
        start = 8 + n
        span = max(size - start - SAMPLE_BYTES, 0)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(SAMPLES - 1, 1))
            h.update(f.read(SAMPLE_BYTES))


def folder_fingerprint(folder: str | os.PathLike[str]) -> str:
    """SHA-256 of a pretrained folder's config.json and its safetensors files' names, sizes, headers and data samples
    (see the module docstring)."""
    root = Path(folder)
    h = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        h.update(b"config.json\0" + config.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        _file_digest(h, path)
    return h.hexdigest()


def folder_base(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The identity record of a base read from `folder`."""
    path = os.path.abspath(folder)
    return {"folder": path, "hash": folder_fingerprint(path),
            "hashed": f"config.json + safetensors headers, sizes and {SAMPLES} samples of {SAMPLE_BYTES} B per file"}


def random_base(*, factory: str, kwargs: dict[str, Any], seed: int) -> dict[str, Any]:
    """The identity record of a base with no folder: built by `factory(**kwargs)` under `seed`."""
    what = json.dumps({"factory": factory, "kwargs": kwargs, "seed": seed}, sort_keys=True, default=repr)
    return {"folder": None, "hash": hashlib.sha256(what.encode()).hexdigest(),
            "hashed": f"no folder: a base built by {factory} under seed {seed}"}


def same_base(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two identity records name the same base (folder and hash)."""
    if a is None or b is None:
        return a is b
    return (a.get("folder"), a.get("hash")) == (b.get("folder"), b.get("hash"))


def describe(record: dict[str, Any] | None) -> str:
    """One phrase for a message: the folder (or the random build) and the start of the hash."""
    if record is None:
        return "no base model (not a LoRA run)"
    where = record.get("folder") or record.get("hashed", "a base built from scratch")
    return f"{where} (hash {str(record.get('hash'))[:12]})"


def base_folder(model: nn.Module, kwargs: dict[str, Any]) -> str | None:
    """Where the base of the PEFT model `model` was read from: the factory's `pretrained` keyword when it is a folder
    (the built-in LLaMA, dptrain's HF factory), else the base's `config.name_or_path` when that is a folder
    (`from_pretrained(DIR)` sets it), else None."""
    pretrained = kwargs.get("pretrained")
    if isinstance(pretrained, str | os.PathLike) and os.path.isdir(pretrained):
        return os.fspath(pretrained)
    name = getattr(getattr(lora.base_of(model), "config", None), "name_or_path", None)
    return name if isinstance(name, str) and name and os.path.isdir(name) else None


def base_record(model: nn.Module, *, factory: str, kwargs: dict[str, Any], seed: int) -> dict[str, Any] | None:
    """The identity of `model`'s frozen base when `model` is a PEFT model (its folder's fingerprint, or the random
    build's factory, kwargs and seed), else None."""
    if not lora.is_peft_model(model):
        return None
    folder = base_folder(model, kwargs)
    return folder_base(folder) if folder else random_base(factory=factory, kwargs=kwargs, seed=seed)
