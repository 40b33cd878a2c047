"""GPU specification table: memory, dense peak FLOP/s per dtype, NVLink and PCIe bandwidth.

The one source of the peaks `dptrain.metrics.mfu` uses for MFU and of the devices `dptrain plan
--gpu-type` plans for. Peaks are dense (no 2:4 sparsity: the datasheets' starred figures halved).
Bandwidths are GB/s (1e9 bytes/s) per GPU, both directions together, as the datasheets state them
(NVLink: the GPU's total NVLink bandwidth; PCIe: the host link, x16); 0 means no NVLink.
Memory is GB (1e9 bytes) as marketed; the usable part is a little less (the CUDA context).
"""

from __future__ import annotations

from dataclasses import dataclass

T = 1e12


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model. `pattern` is matched against `torch.cuda.get_device_name` (first match wins)."""

    key: str
    pattern: str
    name: str
    memory_gb: float
    peaks: dict[str, float]
    nvlink_gbps: float
    pcie_gbps: float


def _p(fp32: float, tf32: float | None, half: float, *, bf16: bool = True) -> dict[str, float]:
    peaks = {"fp32": fp32 * T, "fp16": half * T}
    if tf32 is not None:
        peaks["tf32"] = tf32 * T
    if bf16:
        peaks["bf16"] = half * T
    return peaks


SPECS: list[GpuSpec] = [
    # NVIDIA H200 Tensor Core GPU datasheet (2024): H200 NVL 141 GB, FP32 60, TF32 835*, BF16/FP16
    # 1671* TFLOPS; NVLink bridge 900 GB/s, PCIe Gen5 128 GB/s
    GpuSpec("H200-NVL", r"H200.*NVL", "H200 NVL", 141, _p(60, 417.5, 835.5), 900, 128),
    # same datasheet: H200 SXM 141 GB, FP32 67, TF32 989*, BF16/FP16 1979*; NVLink 900, PCIe Gen5 128
    GpuSpec("H200", r"H200", "H200 SXM", 141, _p(67, 494.5, 989.5), 900, 128),
    # NVIDIA H100 Tensor Core GPU datasheet (2023): H100 NVL 94 GB, FP32 60, TF32 835*, BF16/FP16
    # 1671*; NVLink bridge 600 GB/s, PCIe Gen5 128 GB/s
    GpuSpec("H100-NVL", r"H100.*NVL", "H100 NVL", 94, _p(60, 417.5, 835.5), 600, 128),
    # same datasheet: H100 PCIe 80 GB, FP32 51, TF32 756*, BF16/FP16 1513*; NVLink bridge 600, PCIe Gen5 128
    GpuSpec("H100-PCIe", r"H100.*PCIe", "H100 PCIe", 80, _p(51, 378, 756.5), 600, 128),
    # same datasheet: H100 SXM 80 GB, FP32 67, TF32 989*, BF16/FP16 1979*; NVLink 900, PCIe Gen5 128
    GpuSpec("H100-SXM", r"H100", "H100 SXM", 80, _p(67, 494.5, 989.5), 900, 128),
    # NVIDIA A100 Tensor Core GPU datasheet (2021): A100 80GB, FP32 19.5, TF32 156 (312*),
    # BF16/FP16 312 (624*); NVLink 600 GB/s (SXM; PCIe cards: bridge for 2 GPUs), PCIe Gen4 64 GB/s
    GpuSpec("A100-80GB", r"A100.*80", "A100 80GB", 80, _p(19.5, 156, 312), 600, 64),
    # same datasheet: A100 40GB, same compute and links
    GpuSpec("A100-40GB", r"A100", "A100 40GB", 40, _p(19.5, 156, 312), 600, 64),
    # NVIDIA L40S datasheet (2023): 48 GB, FP32 91.6, TF32 183 (366*), BF16/FP16 362.05 (733*);
    # no NVLink, PCIe Gen4 x16 64 GB/s
    GpuSpec("L40S", r"L40S", "L40S", 48, _p(91.6, 183, 362.05), 0, 64),
    # NVIDIA Ada Lovelace GPU architecture whitepaper v1.0, RTX 4090: 24 GB, FP32 82.6; tensor
    # FP16/BF16 with FP32 accumulate (what training uses) 165.2 dense; TF32 82.6 dense; no NVLink,
    # PCIe Gen4 x16 64 GB/s
    GpuSpec("RTX4090", r"RTX 4090", "RTX 4090", 24, _p(82.6, 82.6, 165.2), 0, 64),
    # NVIDIA Ampere GA102 GPU architecture whitepaper v2.0, RTX 3090: 24 GB, FP32 35.6; tensor
    # FP16/BF16 with FP32 accumulate 71 dense; TF32 35.6 dense; NVLink bridge 112.5 GB/s, PCIe Gen4 64
    GpuSpec("RTX3090", r"RTX 3090", "RTX 3090", 24, _p(35.6, 35.6, 71), 112.5, 64),
    # NVIDIA V100 Tensor Core GPU datasheet (2020): PCIe 32/16 GB, FP32 14, tensor FP16 112; no
    # bf16, no tf32; no NVLink, PCIe Gen3 32 GB/s
    GpuSpec("V100-PCIe", r"V100.*PCI", "V100 PCIe", 32, _p(14, None, 112, bf16=False), 0, 32),
    # same datasheet: V100 SXM2 32/16 GB, FP32 15.7, tensor FP16 125 TFLOPS; NVLink 300 GB/s, PCIe Gen3 32
    GpuSpec("V100-SXM2", r"V100", "V100 SXM2", 32, _p(15.7, None, 125, bf16=False), 300, 32),
]

# Short names `--gpu-type` also accepts (case-insensitive), for the common variant.
ALIASES = {"H100": "H100-SXM", "A100": "A100-80GB", "V100": "V100-SXM2", "RTX-4090": "RTX4090",
           "RTX-3090": "RTX3090", "4090": "RTX4090", "3090": "RTX3090"}


def gpu_keys() -> list[str]:
    """The `--gpu-type` choices, table order."""
    return [s.key for s in SPECS]


def gpu_spec(key: str) -> GpuSpec:
    """The spec of a `--gpu-type` key or alias (case-insensitive); ValueError naming the choices."""
    by_name = {s.key.lower(): s for s in SPECS}
    by_name.update({alias.lower(): by_name[target.lower()] for alias, target in ALIASES.items()})
    if key.lower() in by_name:
        return by_name[key.lower()]
    raise ValueError(f"unknown GPU type {key!r} (valid: {', '.join(gpu_keys())}; aliases: {', '.join(ALIASES)})")
