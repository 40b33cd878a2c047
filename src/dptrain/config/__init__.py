"""The config tree (`fields`) and what it resolves to at a given world size (`resolve`)."""

from dptrain.config.fields import (
    DEFAULT_BATCH,
    DTYPES,
    LR_SCALINGS,
    NONFINITE_POLICIES,
    OPTIMIZERS,
    SCHEDULE_CONVENTIONS,
    SCHEDULES,
    STRATEGIES,
    WARMUP_TYPES,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DiagnosticsConfig,
    LaunchConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
    default_out_dir,
    field_docs,
    to_dict,
)
from dptrain.config.resolve import (
    BatchSizeError,
    Resolved,
    hang_timeout,
    local_world_size,
    resolve,
    resolve_batch,
    scaled_lr,
    validate,
    validate_diagnostics,
)

__all__ = [
    "BatchSizeError", "DEFAULT_BATCH", "DTYPES", "LR_SCALINGS", "NONFINITE_POLICIES", "OPTIMIZERS", "SCHEDULES", "SCHEDULE_CONVENTIONS", "STRATEGIES", "WARMUP_TYPES",
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DiagnosticsConfig", "LaunchConfig",
    "LogConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "PrecisionConfig", "Resolved",
    "TrainConfig", "default_out_dir", "field_docs", "hang_timeout", "local_world_size", "resolve",
    "resolve_batch", "scaled_lr", "to_dict", "validate", "validate_diagnostics",
]
