"""DeepSpeed's zero_optimization and tensor_parallel blocks -> parallel.*."""

from __future__ import annotations

from typing import Any

from dptrain.config.deepspeed.mapping import DeepSpeedMapping, bad, number
from dptrain.config.fields import ConfigError

ZERO_STAGE = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}


def zero(zero_cfg: Any, m: DeepSpeedMapping) -> None:
    if zero_cfg is None or zero_cfg == "auto":
        return
    if isinstance(zero_cfg, bool):  # legacy form: true is stage 1, as DeepSpeed reads it
        m.put("zero_optimization", "parallel.strategy", "zero1" if zero_cfg else "ddp")
        return
    if not isinstance(zero_cfg, dict):
        raise bad("zero_optimization", zero_cfg, 'use a mapping such as {"stage": 2}, or true/false')
    z = {k: v for k, v in zero_cfg.items() if v != "auto"}
    stage = z.pop("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in ZERO_STAGE:
        raise bad("zero_optimization.stage", stage, "use 0, 1, 2 or 3")
    m.put("zero_optimization.stage", "parallel.strategy", ZERO_STAGE[stage])
    offload = []
    legacy = z.pop("cpu_offload", False)  # DeepSpeed < 0.3.16: "cpu_offload": true == offload_optimizer to cpu
    if legacy is True:
        z.setdefault("offload_optimizer", {"device": "cpu"})
    elif legacy is not False:
        raise bad("zero_optimization.cpu_offload", legacy, "use true or false")
    for k in ("offload_optimizer", "offload_param"):
        sub = z.pop(k, None) or {}
        if not isinstance(sub, dict):
            raise bad(f"zero_optimization.{k}", sub, 'it must be a mapping such as {"device": "cpu"}')
        sub = dict(sub)
        device = sub.pop("device", "none")
        if device not in ("none", "cpu", "nvme", None):
            raise bad(f"zero_optimization.{k}.device", device, "use none, cpu or nvme (DeepSpeed's choices)")
        if device in ("cpu", "nvme"):
            offload.append(k)
        if device == "nvme":  # the optimizer state in files (parallel/nvme_offload.py), on the host as with cpu
            path = sub.pop("nvme_path", None)
            if not isinstance(path, str) or not path:
                raise bad(f"zero_optimization.{k}.nvme_path", path, "NVMe offload needs the directory on the drive, "
                          'e.g. "nvme_path": "/local_nvme"')
            if k == "offload_optimizer":
                m.put(f"zero_optimization.{k}.nvme_path", "parallel.nvme_offload_dir", path)
            else:
                m.notes.append(
                    f"zero_optimization.offload_param.device='nvme' (nvme_path {path!r}): parameters are offloaded to "
                    "host memory (FSDP2 CPUOffloadPolicy), not to the drive; only the optimizer state goes to files "
                    "(offload_optimizer nvme)"
                )
        m.ignored += [f"zero_optimization.{k}.{sk}" for sk in sub]
    if offload and stage in (0, 1):
        raise ConfigError(
            f"DeepSpeed {' and '.join(offload)} with zero_optimization.stage={stage} is not supported: "
            "dptrain offloads through FSDP2's CPUOffloadPolicy, which shards; "
            "use stage 2 (zero2) or 3 (fsdp) with offload"
        )
    if offload:
        m.put(f"zero_optimization.{offload[0]}.device", "parallel.cpu_offload", True)
        if stage == 2:
            m.notes.append(
                "ZeRO-2 with CPU offload maps to zero2 + FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer "
                "state are sharded on the CPU and the optimizer steps there, as in DeepSpeed; unlike DeepSpeed, the "
                "GPU keeps no parameter copy between steps (they are gathered from the host each step)"
            )
    if "reduce_bucket_size" in z and stage == 0:
        size = number("zero_optimization.reduce_bucket_size", z.pop("reduce_bucket_size"), positive=True)
        m.put("zero_optimization.reduce_bucket_size", "parallel.bucket_cap_mb", size * 4 / 2**20)
    m.ignored += [f"zero_optimization.{k}" for k in z]


def tensor_parallel(tp: dict[str, Any] | None, m: DeepSpeedMapping) -> None:
    """DeepSpeed's AutoTP for training (`tensor_parallel.autotp_size`) -> `parallel.tp`: dptrain
    shards the built-in LLaMA with its own plan (or `parallel.tp_plan` for other models)."""
    if tp is None:
        return
    size = tp.pop("autotp_size", tp.pop("tp_size", None))
    if size is not None:
        m.put(
            "tensor_parallel.autotp_size",
            "parallel.tp",
            number("tensor_parallel.autotp_size", size, integer=True, positive=True),
        )
    m.ignored += [f"tensor_parallel.{k}" for k in tp]
