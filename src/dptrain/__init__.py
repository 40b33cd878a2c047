"""dptrain: data-parallel training of PyTorch models, from one CPU to many GPU nodes."""

__version__ = "0.1.0"

from dptrain.api import (  # noqa: E402
    Runtime,
    grad_accum_steps,
    init_distributed,
    micro_steps,
    prepare_dataloader,
    prepare_model,
)
from dptrain.config import Config, ConfigError  # noqa: E402
from dptrain.overrides import load_config  # noqa: E402
from dptrain.parallel import clip_grad_norm_, full_state_dict, sync_gradients, unwrap  # noqa: E402
from dptrain.trainer import Trainer  # noqa: E402

__all__ = [
    "__version__", "Config", "ConfigError", "Runtime", "Trainer", "clip_grad_norm_", "full_state_dict",
    "grad_accum_steps", "init_distributed", "load_config", "micro_steps", "prepare_dataloader",
    "prepare_model", "sync_gradients", "unwrap",
]
