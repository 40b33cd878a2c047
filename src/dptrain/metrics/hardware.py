"""GPU specification table: memory, dense peak FLOP/s per dtype, NVLink and PCIe bandwidth.

The one source of the peaks `dptrain.metrics.mfu` uses for MFU and of the devices `dptrain plan
--gpu-type` plans for. Peaks are dense (no 2:4 sparsity: the datasheets' starred figures halved).
Bandwidths are GB/s (1e9 bytes/s) per GPU, both directions together, as the datasheets state them
(NVLink: the GPU's total NVLink bandwidth; PCIe: the host link, x16); 0 means no NVLink.
Memory is GB (1e9 bytes) as marketed; the usable part is a little less (the CUDA context).
`hbm_gbps` is the datasheet's memory bandwidth (GB/s). `mamf` is the share of the dense bf16 peak a
large, well-shaped bf16 matmul reaches, measured (Maximum Achievable Matmul FLOPS): S. Bekman,
"Machine Learning Engineering", compute/accelerator/README.md, MAMF comparison table (A100 SXM
267.9/312 = 85.9%, A100 PCIe 82.2%, H100 SXM 792.1/989 = 80.1%, H100/H200 SXM 794.5 = 80.3%); a GPU
not in that table takes its architecture's figure (Hopper 0.80, Ampere/Ada/Volta 0.82: the PCIe
A100's, the lower Ampere one), stated here as the assumption it is. `note` says what is estimated.
"""

from __future__ import annotations

import dataclasses
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
    hbm_gbps: float = 0.0
    mamf: float = 0.82
    note: str = ""


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
    GpuSpec("H200-NVL", r"H200.*NVL", "H200 NVL", 141, _p(60, 417.5, 835.5), 900, 128, 4800, 0.80),
    # same datasheet: H200 SXM 141 GB, FP32 67, TF32 989*, BF16/FP16 1979*; NVLink 900, PCIe Gen5 128
    GpuSpec("H200", r"H200", "H200 SXM", 141, _p(67, 494.5, 989.5), 900, 128, 4800, 0.803),
    # NVIDIA H100 Tensor Core GPU datasheet (2023): H100 NVL 94 GB, FP32 60, TF32 835*, BF16/FP16
    # 1671*; NVLink bridge 600 GB/s, PCIe Gen5 128 GB/s
    GpuSpec("H100-NVL", r"H100.*NVL", "H100 NVL", 94, _p(60, 417.5, 835.5), 600, 128, 3900, 0.80),
    # same datasheet: H100 PCIe 80 GB, FP32 51, TF32 756*, BF16/FP16 1513*; NVLink bridge 600, PCIe Gen5 128
    GpuSpec("H100-PCIe", r"H100.*PCIe", "H100 PCIe", 80, _p(51, 378, 756.5), 600, 128, 2000, 0.80),
    # The 96 GB HBM2e SXM H100 at a 500 W limit (Meta's Grand Teton; torchtitan's benchmarks/
    # llama3_h100_202412_torchtitan.md: 96 GB HBM2e, 2.4 TB/s, 500 W): no datasheet gives its peak;
    # torchtitan says it lies between the NVL's (835.5, 350-400 W) and the SXM's (989.5, 700 W).
    # Planned at the power-weighted point 835.5 + (500 - 400) / (700 - 400) * (989.5 - 835.5) = 886.8.
    GpuSpec("H100-96GB", r"H100.*(96|HBM2e)", "H100 SXM 96GB HBM2e 500W", 96, _p(62.3, 443.4, 886.8), 900, 128, 2400,
            0.80, note="peak not published: between H100 NVL (835.5) and SXM (989.5) TFLOPS; planned at 886.8"),
    # same datasheet: H100 SXM 80 GB, FP32 67, TF32 989*, BF16/FP16 1979*; NVLink 900, PCIe Gen5 128
    GpuSpec("H100-SXM", r"H100", "H100 SXM", 80, _p(67, 494.5, 989.5), 900, 128, 3350, 0.801),
    # NVIDIA A100 Tensor Core GPU datasheet (2021): A100 80GB, FP32 19.5, TF32 156 (312*),
    # BF16/FP16 312 (624*); NVLink 600 GB/s (SXM; PCIe cards: bridge for 2 GPUs), PCIe Gen4 64 GB/s
    GpuSpec("A100-80GB", r"A100.*80", "A100 80GB", 80, _p(19.5, 156, 312), 600, 64, 2039, 0.859),
    # same datasheet: A100 40GB, same compute and links
    GpuSpec("A100-40GB", r"A100", "A100 40GB", 40, _p(19.5, 156, 312), 600, 64, 1555, 0.859),
    # NVIDIA L40S datasheet (2023): 48 GB, FP32 91.6, TF32 183 (366*), BF16/FP16 362.05 (733*);
    # no NVLink, PCIe Gen4 x16 64 GB/s
    GpuSpec("L40S", r"L40S", "L40S", 48, _p(91.6, 183, 362.05), 0, 64, 864),
    # NVIDIA Ada Lovelace GPU architecture whitepaper v1.0, RTX 4090: 24 GB, FP32 82.6; tensor
    # FP16/BF16 with FP32 accumulate (what training uses) 165.2 dense; TF32 82.6 dense; no NVLink,
    # PCIe Gen4 x16 64 GB/s
    GpuSpec("RTX4090", r"RTX 4090", "RTX 4090", 24, _p(82.6, 82.6, 165.2), 0, 64, 1008),
    # NVIDIA Ampere GA102 GPU architecture whitepaper v2.0, RTX 3090: 24 GB, FP32 35.6; tensor
    # FP16/BF16 with FP32 accumulate 71 dense; TF32 35.6 dense; NVLink bridge 112.5 GB/s, PCIe Gen4 64
    GpuSpec("RTX3090", r"RTX 3090", "RTX 3090", 24, _p(35.6, 35.6, 71), 112.5, 64, 936),
    # NVIDIA V100 Tensor Core GPU datasheet (2020): PCIe 32/16 GB, FP32 14, tensor FP16 112; no
    # bf16, no tf32; no NVLink, PCIe Gen3 32 GB/s
    GpuSpec("V100-PCIe", r"V100.*PCI", "V100 PCIe", 32, _p(14, None, 112, bf16=False), 0, 32, 900),
    # same datasheet: V100 SXM2 32/16 GB, FP32 15.7, tensor FP16 125 TFLOPS; NVLink 300 GB/s, PCIe Gen3 32
    GpuSpec("V100-SXM2", r"V100", "V100 SXM2", 32, _p(15.7, None, 125, bf16=False), 300, 32, 900),
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


def with_memory(spec: GpuSpec, memory_gb: float | None) -> GpuSpec:
    """`spec` with another memory size (`dptrain plan --gpu-memory`: a variant the table lacks)."""
    if memory_gb is None:
        return spec
    if not memory_gb > 0:
        raise ValueError(f"--gpu-memory {memory_gb} must be > 0 (GB)")
    return dataclasses.replace(spec, memory_gb=memory_gb, name=f"{spec.name} ({memory_gb:g} GB)")
