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
    "Checkpointer": "dptrain.api",
    "LoopMonitor": "dptrain.api",
    "MixedPrecision": "dptrain.api",
    "Runtime": "dptrain.api",
    "all_reduce_mean": "dptrain.api",
    "barrier": "dptrain.api",
    "broadcast": "dptrain.api",
    "check_loader": "dptrain.api",
    "epochs": "dptrain.api",
    "gather_for_metrics": "dptrain.api",
    "grad_accum_steps": "dptrain.api",
    "init_distributed": "dptrain.api",
    "micro_steps": "dptrain.api",
    "mixed_precision": "dptrain.api",
    "monitor": "dptrain.api",
    "parallelize": "dptrain.api",
    "prepare_dataloader": "dptrain.api",
    "prepare_eval_dataloader": "dptrain.api",
    "print0": "dptrain.api",
    "rng_state": "dptrain.api",
    "save_model": "dptrain.api",
    "notebook_launch": "dptrain.launch.notebook",
    "BatchSizeError": "dptrain.config",
    "CheckpointError": "dptrain.checkpoint.manifest",
    "Config": "dptrain.config",
    "ConfigError": "dptrain.config",
    "load_config": "dptrain.config.load",
    "clip_grad_norm_": "dptrain.parallel",
    "full_state_dict": "dptrain.parallel",
    "ParallelModel": "dptrain.parallel",
    "sync_gradients": "dptrain.parallel",
    "unwrap": "dptrain.parallel",
    "Trainer": "dptrain.train.trainer",
    "to_device": "dptrain.train.build",
}

# deprecated names, still resolved for 0.1's scripts (each warns when called); not in __all__
_DEPRECATED = {"prepare_model": "dptrain.api.setup"}

__all__ = [
    "__version__",
    "BatchSizeError",
    "CheckpointError",
    "Checkpointer",
    "Config",
    "ConfigError",
    "LoopMonitor",
    "MixedPrecision",
    "ParallelModel",
    "Runtime",
    "Trainer",
    "all_reduce_mean",
    "barrier",
    "broadcast",
    "check_loader",
    "clip_grad_norm_",
    "epochs",
    "full_state_dict",
    "gather_for_metrics",
    "grad_accum_steps",
    "init_distributed",
    "load_config",
    "micro_steps",
    "mixed_precision",
    "monitor",
    "notebook_launch",
    "parallelize",
    "prepare_dataloader",
    "prepare_eval_dataloader",
    "print0",
    "rng_state",
    "save_model",
    "sync_gradients",
    "to_device",
    "unwrap",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name) or _DEPRECATED.get(name)
    if module is None:
        raise AttributeError(f"module 'dptrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from dptrain.api import (
        Checkpointer,
        LoopMonitor,
        MixedPrecision,
        Runtime,
        all_reduce_mean,
        barrier,
        broadcast,
        check_loader,
        epochs,
        gather_for_metrics,
        grad_accum_steps,
        init_distributed,
        micro_steps,
        mixed_precision,
        monitor,
        parallelize,
        prepare_dataloader,
        prepare_eval_dataloader,
        print0,
        rng_state,
        save_model,
    )
    from dptrain.checkpoint.manifest import CheckpointError
    from dptrain.config import BatchSizeError, Config, ConfigError
    from dptrain.config.load import load_config
    from dptrain.launch.notebook import notebook_launch
    from dptrain.parallel import ParallelModel, clip_grad_norm_, full_state_dict, sync_gradients, unwrap
    from dptrain.train.build import to_device
    from dptrain.train.trainer import Trainer
