"""Model FLOPs utilisation: achieved model FLOPs per second per device / the device's peak.

FLOPs per token (training: forward + backward), `model_flops_per_token`:
- a model with a `flops_per_token(seq_len)` method (the built-in LLaMA: `6*N + 12*L*d*T`, N the
  non-embedding parameters, L layers, d model width, T context; PaLM's convention, the causal
  mask not discounted) is asked;
- otherwise the stated approximation `6*N`, N the parameters less input embedding tables (an
  `nn.Embedding` whose weight is not also a `nn.Linear`'s), attention's T-dependent part ignored;
- `train.flops_per_token` overrides both.

Peak FLOP/s per device, `peak_flops`: `log.peak_tflops` if set; on a GPU the dense (no sparsity)
tensor/vector peak of `PEAKS` for the run's compute dtype (fp32 matmuls count as tf32 when
`torch.get_float32_matmul_precision()` allows it); on CPU a measured fp32 matmul peak
(`cpu_matmul_peak`: a few hundred ms at setup, all ranks at once so they contend as in training,
the mean over ranks; measured once per run). MFU = tokens/s x FLOPs per token / (devices x peak):
activation recomputation is not model FLOPs, so it lowers MFU (that is the definition).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
from torch import nn

from dptrain.metrics.hardware import SPECS

T = 1e12
# Dense peaks in FLOP/s per GPU (no 2:4 sparsity), from the one GPU table `dptrain.metrics.hardware.SPECS`
# (sources there): (pattern matched against torch.cuda.get_device_name, first match wins; name; {dtype: peak})
PEAKS: list[tuple[str, str, dict[str, float]]] = [(s.pattern, s.name, s.peaks) for s in SPECS]


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s per device and where the figure comes from (for the log and the summary)."""

    flops: float | None
    source: str


def lookup_peak(device_name: str, dtype: str) -> Peak:
    """The table's dense peak for a GPU name and compute dtype (fp32, tf32, bf16, fp16)."""
    for pattern, name, peaks in PEAKS:
        if re.search(pattern, device_name, re.IGNORECASE):
            if dtype not in peaks:
                return Peak(None, f"{name} has no {dtype} peak in the table (valid: {', '.join(peaks)})")
            return Peak(peaks[dtype], f"{name} {dtype} datasheet peak (dense)")
    names = ", ".join(n for _, n, _ in PEAKS)
    return Peak(None, f"{device_name!r} is not in the peak table ({names}); set log.peak_tflops")


def compute_dtype(precision: str) -> str:
    """The dtype the matmuls run in: bf16/fp16 under autocast, else fp32 or tf32 (when allowed)."""
    if precision in ("bf16", "fp16"):
        return precision
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def cpu_matmul_peak(*, size: int = 512, seconds: float = 0.2) -> float:
    """FLOP/s of fp32 `size` x `size` matmuls on this process's threads, timed for about `seconds`."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up (thread pool, allocator)
    flops_each, done, start = 2 * size**3, 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or done < 3:
        torch.mm(a, b)
        done += 1
    return done * flops_each / elapsed


def peak_flops(*, device: torch.device, precision: str, override_tflops: float | None) -> Peak:
    """Peak FLOP/s per device: the override, the GPU table, or (CPU) a measured matmul peak."""
    if override_tflops is not None:
        return Peak(override_tflops * T, "log.peak_tflops")
    if device.type == "cuda":
        return lookup_peak(torch.cuda.get_device_name(device), compute_dtype(precision))
    if device.type == "cpu":
        return Peak(cpu_matmul_peak(), f"measured fp32 {512}x{512} matmul on {torch.get_num_threads()} thread(s)")
    return Peak(None, f"no peak known for device type {device.type!r}; set log.peak_tflops")


def _input_embeddings(model: nn.Module) -> int:
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, nn.Embedding) and id(m.weight) not in linear)


def model_flops_per_token(model: nn.Module, *, seq_len: int | None, override: float | None) -> tuple[float, str]:
    """(training FLOPs per token, how they were counted). Works on meta-device models."""
    if override is not None:
        return float(override), "train.flops_per_token"
    count = getattr(model, "flops_per_token", None)
    if callable(count) and seq_len:
        return float(count(seq_len)), f"{type(model).__name__}.flops_per_token({seq_len})"
    n = sum(p.numel() for p in model.parameters()) - _input_embeddings(model)
    return 6.0 * n, "6N approximation (N: parameters less input embeddings; attention not counted)"


def mfu(*, tokens_per_s: float, flops_per_token: float, devices: int, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s per device over the peak per device."""
    return tokens_per_s * flops_per_token / devices / peak
