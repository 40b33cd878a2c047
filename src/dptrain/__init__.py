"""dptrain: data-parallel training of PyTorch models, from one CPU to many GPU nodes.

Importing the package is cheap: the public names below are loaded on first use (PEP 562), so
`import dptrain` pulls in neither the trainer nor torch.distributed's FSDP and checkpoint
stacks until something that needs them is touched.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
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
    "prepare_model": "dptrain.api",
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
    "prepare_model",
    "print0",
    "rng_state",
    "save_model",
    "sync_gradients",
    "to_device",
    "unwrap",
]


# Modules that moved when the package was laid out by job (issue 20): old name -> new name. Import
# paths that users store in configs, manifests and scripts (`python -m dptrain.worker`, a loss at
# `dptrain.loss:...`) keep working: the old name is the same module object as the new one.
MOVED = {
    "dptrain.build": "dptrain.train.build",
    "dptrain.elastic": "dptrain.launch.elastic",
    "dptrain.evaluation": "dptrain.train.evaluation",
    "dptrain.generate": "dptrain.cli.generate",
    "dptrain.launch_checks": "dptrain.launch.checks",
    "dptrain.loss": "dptrain.train.loss",
    "dptrain.optim": "dptrain.train.optim",
    "dptrain.outputs": "dptrain.train.outputs",
    "dptrain.precision": "dptrain.train.precision",
    "dptrain.record_script": "dptrain.launch.record_script",
    "dptrain.speed": "dptrain.train.backend",
    "dptrain.train_state": "dptrain.train.state",
    "dptrain.trainer": "dptrain.train.trainer",
    "dptrain.worker": "dptrain.launch.worker",
    "dptrain.bench": "dptrain.tools.bench",
    "dptrain.deploy": "dptrain.tools.deploy",
    "dptrain.plan": "dptrain.tools.plan",
    "dptrain.report": "dptrain.tools.report",
    "dptrain.testing": "dptrain.tools",
    "dptrain.parallel.plan": "dptrain.parallel.model",
}


class _MovedFinder:  # a meta path finder and its loader (not importlib.abc's: 0.3 s of imports on a loaded machine)
    """Resolves a moved module's old name (or a name below it) to the module under its new name."""

    @staticmethod
    def _target(fullname: str) -> str | None:
        for old, new in MOVED.items():
            if fullname == old or fullname.startswith(old + "."):
                return new + fullname[len(old) :]
        return None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = self._target(fullname)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        spec = importlib.util.spec_from_loader(  # a loader by its methods (create_module, exec_module)
            fullname, self, origin=real.origin, is_package=real.submodule_search_locations is not None  # type: ignore[arg-type]
        )
        spec.loader_state = new  # type: ignore[union-attr]
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return importlib.import_module(spec.loader_state)  # the same module object as the new name

    def exec_module(self, module: Any) -> None:
        """Nothing to run: the module was executed under its new name."""

    def get_code(self, fullname: str) -> Any:
        """`python -m OLD_NAME` (runpy asks for the code): the new module's code."""
        new = self._target(fullname)
        real = importlib.util.find_spec(new) if new else None
        loader = getattr(real, "loader", None)
        return loader.get_code(new) if loader is not None else None


sys.meta_path.insert(0, _MovedFinder())  # before the path finder, which would load a second copy


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
        prepare_model,
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
