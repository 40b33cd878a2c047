"""dptrain: data-parallel training of PyTorch models, from one CPU to many GPU nodes.

Importing the package is cheap: the public names below are loaded on first use (PEP 562), so
`import dptrain` pulls in neither the trainer nor torch.distributed's FSDP and checkpoint
stacks until something that needs them is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "Runtime": "dptrain.api",
    "grad_accum_steps": "dptrain.api",
    "init_distributed": "dptrain.api",
    "micro_steps": "dptrain.api",
    "notebook_launch": "dptrain.deploy.notebook",
    "parallelize": "dptrain.api",
    "prepare_dataloader": "dptrain.api",
    "prepare_model": "dptrain.api",
    "Config": "dptrain.config",
    "ConfigError": "dptrain.config",
    "load_config": "dptrain.config.load",
    "clip_grad_norm_": "dptrain.parallel",
    "full_state_dict": "dptrain.parallel",
    "ParallelModel": "dptrain.parallel",
    "sync_gradients": "dptrain.parallel",
    "unwrap": "dptrain.parallel",
    "Trainer": "dptrain.trainer",
    "to_device": "dptrain.build",
}

__all__ = [
    "__version__", "Config", "ConfigError", "ParallelModel", "Runtime", "Trainer", "clip_grad_norm_",
    "full_state_dict", "grad_accum_steps", "init_distributed", "load_config", "micro_steps", "notebook_launch", "parallelize",
    "prepare_dataloader", "prepare_model", "sync_gradients", "to_device", "unwrap",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dptrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from dptrain.api import (
        Runtime,
        grad_accum_steps,
        init_distributed,
        micro_steps,
        parallelize,
        prepare_dataloader,
        prepare_model,
    )
    from dptrain.build import to_device
    from dptrain.config import Config, ConfigError
    from dptrain.config.load import load_config
    from dptrain.deploy.notebook import notebook_launch
    from dptrain.parallel import ParallelModel, clip_grad_norm_, full_state_dict, sync_gradients, unwrap
    from dptrain.trainer import Trainer
