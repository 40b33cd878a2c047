"""`import_object`: the objects a config names by import path (`pkg.mod:attr`): model, data, loss,
collate and tensor-parallel plan factories. Here, beside the config, so that every layer that
reads such a path (the step, `parallel/tensor.py`, the launcher's checks, the CLI) imports it
from below itself."""

from __future__ import annotations

import importlib
from typing import Any

from dptrain.config import ConfigError


def import_object(spec: str) -> Any:
    """Import `"pkg.mod:attr"` (or `"pkg.mod.attr"`); the attribute part may be dotted."""
    if ":" in spec:
        mod_name, attr = spec.split(":", 1)
    else:
        mod_name, _, attr = spec.rpartition(".")
    if not mod_name or not attr:
        raise ConfigError(f"expected an import path 'package.module:name', got {spec!r}")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"cannot import module {mod_name!r} named in {spec!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"module {mod_name!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    return obj
