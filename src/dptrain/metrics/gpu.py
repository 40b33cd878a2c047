"""This rank's GPU through NVML (nvidia-ml-py): utilisation, temperature, memory and power.

Only a rank bound to a CUDA device has one; on the CPU `GpuSampler.open` returns None and no GPU
metric exists at all (no zeros that would look like an idle GPU). The NVML handle is found by the
device's UUID, so CUDA_VISIBLE_DEVICES remapping cannot point a rank at another rank's GPU.
Sampling is a few NVML calls (microseconds, no CUDA synchronisation): it runs in the exporter's
scrape thread and the status-file thread, never in the training loop.
"""

from __future__ import annotations

from typing import Any

import torch

GPU_KEYS = ("gpu_utilization_percent", "gpu_temperature_celsius", "gpu_memory_used_bytes", "gpu_power_watts")


class GpuSampler:
    """NVML readings of one CUDA device."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml, self._handle = nvml, handle

    @classmethod
    def open(cls, device: torch.device) -> GpuSampler | None:
        """A sampler for `device`, or None on a CPU rank. A CUDA rank without nvidia-ml-py (or without
        a working NVML driver library) raises, naming the fix: a GPU run asked to be monitored."""
        if device.type != "cuda":
            return None
        try:
            import pynvml
        except ImportError as e:
            raise RuntimeError("GPU metrics need nvidia-ml-py: pip install 'dptrain[monitor]'") from e
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        return cls(pynvml, handle)

    def sample(self) -> dict[str, float]:
        """The device now; a reading NVML does not support on this GPU is left out."""
        nvml, h = self._nvml, self._handle
        out: dict[str, float] = {}
        readers = {
            "gpu_utilization_percent": lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu,
            "gpu_temperature_celsius": lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
            "gpu_memory_used_bytes": lambda: nvml.nvmlDeviceGetMemoryInfo(h).used,
            "gpu_power_watts": lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # milliwatts
        }
        for key, read in readers.items():
            try:
                out[key] = float(read())
            except nvml.NVMLError:  # e.g. power on some boards, any reading under MIG
                continue
        return out


def process_memory(device: torch.device) -> dict[str, float]:
    """This process's host RSS and, on CUDA, the caching allocator's allocated bytes (no sync)."""
    import psutil

    out = {"rss_bytes": float(psutil.Process().memory_info().rss)}
    if device.type == "cuda":
        out["cuda_allocated_bytes"] = float(torch.cuda.memory_allocated(device))
        out["cuda_reserved_bytes"] = float(torch.cuda.memory_reserved(device))
    return out
