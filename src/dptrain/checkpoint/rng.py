"""RNG states of one rank as plain data that `torch.load(weights_only=True)` accepts.

numpy's state holds an ndarray (not allowed by the weights-only unpickler), so it is stored as
a tensor and rebuilt on load.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch


def get_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when initialised) CUDA generator states of this process."""
    # numpy's stub types the result as dict | tuple; the default (legacy=True) is the tuple.
    name, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `get_rng_state` returned (CUDA only when both sides have it)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
