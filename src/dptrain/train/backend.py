"""Speed and memory switches that are process-wide settings rather than wrappers: the CUDA backend flags
(TF32 matmuls and convolutions, cudnn.benchmark), glibc's malloc mmap threshold (host memory), and which
torch.compile backend, if any, the blocks are compiled with (`parallel/compile.py` compiles them).

`train.tf32` and `train.cudnn_benchmark` default to null, meaning on with CUDA; on the CPU they
change nothing (TF32 is a tensor-core format and cuDNN a CUDA library).
"""

from __future__ import annotations

import ctypes
import os
import sys

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


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def apply_malloc_threshold(train: TrainConfig) -> int | None:
    """Fix glibc's mmap threshold at `train.malloc_mmap_threshold_kib` KiB (mallopt), so that host tensors of that size
    and more are mapped on their own and returned to the system when freed, instead of kept by the heap. Nothing when
    the field is null, when MALLOC_MMAP_THRESHOLD_ is in the environment (glibc read it at start), off Linux, or with
    another C library. Returns the bytes set, or None."""
    kib = train.malloc_mmap_threshold_kib
    if kib is None or "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no such threshold)
        return None
    return kib * 1024 if mallopt(_M_MMAP_THRESHOLD, kib * 1024) == 1 else None
