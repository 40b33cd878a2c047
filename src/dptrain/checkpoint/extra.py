"""The caller's own state in a checkpoint (`Checkpointer.save(step, extra={...})`), stored without pickled code.

A dict with string keys whose values are JSON values (str, int, finite or non-finite float, bool, None, and
lists / dicts of them) or tensors, at any depth. The JSON part goes into the manifest's `meta.extra`; each
tensor is replaced there by `{"$tensor": "N"}` and saved under key N in `extra.pt` (a dict of tensors,
hashed in the manifest like every file and read with `torch.load(weights_only=True)`). A non-finite float
(`best_val_loss = float("inf")`) is kept as `{"$float": "inf"}` (the manifest is strict JSON). Tuples come
back as lists.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from dptrain.config import ConfigError

if TYPE_CHECKING:
    import torch

EXTRA_FILE = "extra.pt"
"""The step folder's file of the extra state's tensors (written by rank 0 when there are any)."""


def encode(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the JSON part, the tensors by key); ConfigError naming the first value that is neither."""
    import torch  # lazy: `dptrain ckpt ls` reads `describe` without torch
    if not isinstance(extra, dict):
        raise ConfigError(f"extra={extra!r}: pass a dict of JSON values and tensors")
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = str(len(tensors))
            tensors[key] = value.detach()  # written as it is at the save (no copy, no device sync per step)
            return {"$tensor": key}
        if isinstance(value, float) and not math.isfinite(value):
            return {"$float": repr(value)}
        if value is None or isinstance(value, str | int | float | bool):
            return value
        if isinstance(value, list | tuple):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            bad = next((k for k in value if not isinstance(k, str) or k.startswith("$")), None)
            if bad is not None:
                raise ConfigError(f"extra{where}: key {bad!r}: keys are strings not starting with '$'")
            return {k: walk(v, f"{where}[{k!r}]") for k, v in value.items()}
        raise ConfigError(
            f"extra{where} is a {type(value).__name__}: extra state holds JSON values (str, int, float, bool, None, "
            "lists and dicts of them) and tensors, so that it loads without unpickling code; convert it (e.g. "
            "dataclasses.asdict, .item(), a state_dict())"
        )

    return walk(extra, ""), tensors


def decode(saved: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The value `encode` was given, from its JSON part and its tensors."""
    if isinstance(saved, dict):
        if set(saved) == {"$tensor"}:
            return tensors[saved["$tensor"]]
        if set(saved) == {"$float"}:
            return float(saved["$float"])
        return {k: decode(v, tensors) for k, v in saved.items()}
    if isinstance(saved, list):
        return [decode(v, tensors) for v in saved]
    return saved


def describe(saved: dict[str, Any], *, width: int = 160) -> str:
    """One line for `dptrain ckpt ls`: `key=value, ...` with tensors as `tensor`, cut at `width` characters."""

    def show(v: Any) -> str:
        if isinstance(v, dict) and set(v) == {"$tensor"}:
            return "tensor"
        if isinstance(v, dict) and set(v) == {"$float"}:
            return v["$float"]
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {show(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(map(show, v)) + "]"
        return repr(v)

    line = ", ".join(f"{k}={show(v)}" for k, v in saved.items())
    return line if len(line) <= width else line[: width - 3] + "..."
