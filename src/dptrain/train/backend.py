"""Speed switches that are process-wide settings rather than wrappers: the CUDA backend flags
(TF32 matmuls and convolutions, cudnn.benchmark) and which torch.compile backend, if any, the
blocks are compiled with (`parallel/compile.py` compiles them).

`train.tf32` and `train.cudnn_benchmark` default to null, meaning on with CUDA; on the CPU they
change nothing (TF32 is a tensor-core format and cuDNN a CUDA library).
"""

from __future__ import annotations

import torch

from dptrain.config import TrainConfig


def backend_flags(train: TrainConfig, device: torch.device) -> dict[str, bool]:
    """The flags `apply_backend_flags` sets for this device: {} on the CPU."""
    if device.type != "cuda":
        return {}
    return {"tf32": True if train.tf32 is None else train.tf32,
            "cudnn_benchmark": True if train.cudnn_benchmark is None else train.cudnn_benchmark}


def apply_backend_flags(train: TrainConfig, device: torch.device) -> dict[str, bool]:
    """Set TF32 (fp32 matmuls at 'high' precision, cuDNN's allow_tf32) and cudnn.benchmark for a CUDA
    `device` (the values `backend_flags` gives); nothing on the CPU. Returns what was set."""
    flags = backend_flags(train, device)
    if flags:
        torch.set_float32_matmul_precision("high" if flags["tf32"] else "highest")
        torch.backends.cudnn.allow_tf32 = flags["tf32"]
        torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    return flags


def compile_backend(train: TrainConfig) -> str | None:
    """The torch.compile backend for the blocks when train.compile is on, else None."""
    return train.compile_backend if train.compile else None
