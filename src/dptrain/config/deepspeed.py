"""DeepSpeed-style JSON: translate a DeepSpeed config dict into dptrain's nested config dict."""

from __future__ import annotations

from typing import Any

from dptrain.config.fields import ConfigError
from dptrain.config.load import set_dotted


def _no_auto(d: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of a DeepSpeed block without its "auto" values (HF Trainer style: keep dptrain's own value)."""
    return {k: v for k, v in (d or {}).items() if v != "auto"}


_ZERO_STAGE = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}
_DS_OPTIM = {"sgd": "sgd", "adam": "adam", "adamw": "adamw"}


def from_deepspeed(ds: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Translate a DeepSpeed config dict; return (nested dptrain dict, dotted keys not understood)."""
    out: dict[str, Any] = {}
    unknown: list[str] = []
    ds = dict(ds)

    def put(key: str, value: Any) -> None:
        set_dotted(out, key, value)

    simple = {
        "train_batch_size": "train.global_batch_size",
        "train_micro_batch_size_per_gpu": "train.micro_batch_size",
        "gradient_accumulation_steps": "train.grad_accum_steps",
        "gradient_clipping": "optim.grad_clip",
        "seed": "train.seed",
        "steps_per_print": "train.log_every_steps",
    }
    for k, target in simple.items():
        if k in ds:
            v = ds.pop(k)
            if v == "auto":
                continue
            put(target, v)
    if out.get("optim", {}).get("grad_clip") == 0:
        out["optim"]["grad_clip"] = None

    if "optimizer" in ds:
        opt = ds.pop("optimizer") or {}
        kind = str(opt.get("type", "")).lower()
        if kind not in _DS_OPTIM:
            raise ConfigError(f"DeepSpeed optimizer.type={opt.get('type')!r} is not supported; use one of: SGD, Adam, AdamW")
        put("optim.name", _DS_OPTIM[kind])
        params = _no_auto(opt.get("params"))
        for pk, target in (("lr", "optim.lr"), ("weight_decay", "optim.weight_decay"), ("momentum", "optim.momentum"), ("eps", "optim.eps")):
            if pk in params:
                put(target, params.pop(pk))
        if "betas" in params:
            put("optim.betas", list(params.pop("betas")))
        unknown += [f"optimizer.params.{k}" for k in params]
        unknown += [f"optimizer.{k}" for k in opt if k not in ("type", "params")]

    if "scheduler" in ds:
        sch = ds.pop("scheduler") or {}
        sched_kind = sch.get("type")
        params = _no_auto(sch.get("params"))
        if sched_kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
            raise ConfigError(
                f"DeepSpeed scheduler.type={sched_kind!r} is not supported; use WarmupLR, WarmupDecayLR or WarmupCosineLR"
            )
        put("optim.schedule", {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}[sched_kind])
        if "warmup_num_steps" in params:
            put("optim.warmup_steps", params.pop("warmup_num_steps"))
        if "total_num_steps" in params:
            put("train.max_steps", params.pop("total_num_steps"))
        if "warmup_max_lr" in params:
            put("optim.lr", params.pop("warmup_max_lr"))
        if "cos_min_ratio" in params:
            put("optim.min_lr_ratio", params.pop("cos_min_ratio"))
        # Defaults that match dptrain's behaviour (warm up linearly from zero) are not "unknown".
        for k, same in (("warmup_min_lr", 0), ("warmup_type", "linear"), ("warmup_min_ratio", 0)):
            if params.get(k, same) == same:
                params.pop(k, None)
        unknown += [f"scheduler.params.{k}" for k in params]

    fp16 = _no_auto(ds.pop("fp16", None))
    bf16 = _no_auto(ds.pop("bf16", None))
    if fp16.get("enabled") is True and bf16.get("enabled") is True:
        raise ConfigError("DeepSpeed config enables both fp16 and bf16; enable at most one")
    if fp16.get("enabled") is True:
        put("precision.dtype", "fp16")
        if "initial_scale_power" in fp16:
            put("precision.init_scale", float(2 ** fp16["initial_scale_power"]))
        if "loss_scale_window" in fp16:
            put("precision.growth_interval", fp16["loss_scale_window"])
        if fp16.get("loss_scale", 0) != 0:
            unknown.append("fp16.loss_scale (static loss scale; dptrain uses dynamic scaling)")
        unknown += [f"fp16.{k}" for k in fp16 if k not in ("enabled", "initial_scale_power", "loss_scale_window", "loss_scale")]
    if bf16.get("enabled") is True:
        put("precision.dtype", "bf16")
        unknown += [f"bf16.{k}" for k in bf16 if k != "enabled"]

    if "zero_optimization" in ds:
        zero = _no_auto(ds.pop("zero_optimization"))
        stage = zero.pop("stage", 0)
        if stage not in _ZERO_STAGE:
            raise ConfigError(f"DeepSpeed zero_optimization.stage={stage!r} is not valid; use 0, 1, 2 or 3")
        put("parallel.strategy", _ZERO_STAGE[stage])
        offload = [k for k in ("offload_optimizer", "offload_param") if (zero.get(k) or {}).get("device", "none") != "none"]
        nvme = [k for k in offload if zero[k].get("device") != "cpu"]
        if nvme:
            raise ConfigError(
                f"DeepSpeed zero_optimization.{nvme[0]}.device={zero[nvme[0]].get('device')!r} is not supported; "
                "dptrain offloads to the CPU only (device: cpu)"
            )
        for k in ("offload_optimizer", "offload_param"):
            sub = zero.pop(k, None) or {}
            unknown += [f"zero_optimization.{k}.{sk}" for sk in sub if sk != "device"]
        if offload:
            if stage != 3:
                raise ConfigError(
                    f"DeepSpeed {' and '.join(offload)} with zero_optimization.stage={stage} is not supported: "
                    "dptrain offloads through FSDP2's CPUOffloadPolicy, which needs stage 3"
                )
            put("parallel.cpu_offload", True)
        if "reduce_bucket_size" in zero and stage == 0:
            put("parallel.bucket_cap_mb", zero.pop("reduce_bucket_size") * 4 / 2**20)
        unknown += [f"zero_optimization.{k}" for k in zero]

    if "dptrain" in ds:  # native sections may ride along inside a DeepSpeed file
        native = ds.pop("dptrain")
        for section, values in (native or {}).items():
            for k, v in (values or {}).items():
                put(f"{section}.{k}", v)
    unknown += list(ds)
    return out, unknown
