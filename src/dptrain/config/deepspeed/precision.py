"""DeepSpeed's fp16 / bf16 blocks -> precision.* (fp16: DeepSpeed's own dynamic loss scaler)."""

from __future__ import annotations

import math
from typing import Any

from dptrain.config.deepspeed.mapping import DeepSpeedMapping, bad, block, enabled, number
from dptrain.config.fields import ConfigError

# DeepSpeedFP16Config's fields and defaults -> precision.* (loss_scale 0: dynamic)
FP16_FIELDS: dict[str, tuple[str, Any]] = {
    "loss_scale": ("precision.static_loss_scale", 0.0),
    "initial_scale_power": ("precision.init_scale", 16),
    "loss_scale_window": ("precision.growth_interval", 1000),
    "hysteresis": ("precision.hysteresis", 2),
    "consecutive_hysteresis": ("precision.consecutive_hysteresis", False),
    "min_loss_scale": ("precision.min_loss_scale", 1),
}


def precision(ds: dict[str, Any], m: DeepSpeedMapping) -> None:
    ds_raw = {k: v for k, v in ds.items() if isinstance(v, dict)}
    blocks = {}
    for key, alias in (("fp16", None), ("bf16", "bfloat16")):
        for name in (key, alias):
            if name and name in ds:
                b = block(ds, name)
                ds.pop(name)
                if key in blocks and b is not None:
                    raise ConfigError(f"DeepSpeed config has both {key} and {name}; keep one")
                blocks[key] = (name, b or {})
    on = {k: enabled(f"{name}.enabled", b["enabled"], m) for k, (name, b) in blocks.items() if "enabled" in b}
    if on.get("fp16") and on.get("bf16"):
        raise ConfigError("DeepSpeed config enables both fp16 and bf16; enable at most one")
    for key, (name, b) in blocks.items():
        extra = [k for k in b if k != "enabled"]
        if not on.get(key):
            if extra and (ds_raw.get(name) or {}).get("enabled") != "auto":  # "auto": the HF Trainer decides
                m.ignored.append(f"{name}.{{{', '.join(extra)}}} ({name} is not enabled)")
            continue
        m.put(f"{name}.enabled", "precision.dtype", key)
        if key == "bf16":
            m.ignored += [f"{name}.{k}" for k in extra]
            continue
        fp16_scaler(b, m)


def fp16_scaler(b: dict[str, Any], m: DeepSpeedMapping) -> None:
    """fp16's loss scaling as DeepSpeed's DynamicLossScaler does it (train/loss_scaler.py), checked as
    DeepSpeedFP16Config checks it."""
    b = dict(b)
    b.pop("enabled", None)
    m.put("fp16.enabled", "precision.loss_scaler", "deepspeed")
    values: dict[str, Any] = {}
    static = b.get("loss_scale", 0) not in (0, 0.0, "auto")
    for k, (target, dflt) in FP16_FIELDS.items():
        given = k in b
        v = b.pop(k) if given else dflt
        if static and k != "loss_scale":  # a static scale: DeepSpeed neither checks nor uses the dynamic settings
            if given:
                m.ignored.append(f"fp16.{k}={v!r} (a static loss_scale is set)")
            continue
        key = f"fp16.{k}"
        if k == "consecutive_hysteresis":
            if not isinstance(v, bool):
                raise bad(key, v, "use true or false")
        elif k == "loss_scale":
            v = float(number(key, v))
            if not math.isfinite(v) or v < 0:
                raise bad(key, v, "it must be a finite number >= 0 (0 enables dynamic loss scaling)")
        elif k == "initial_scale_power":
            v = number(key, v, integer=True)
            if not 0 <= v <= 64:
                raise bad(key, v, "use an integer from 0 to 64 (the scale starts at 2**power)")
        else:
            v = number(key, v, integer=k != "min_loss_scale")
        values[k] = v
        (m.put if given else m.default)(key, target, float(2**v) if k == "initial_scale_power" else v)
    if not static:  # DeepSpeed checks these only under dynamic scaling
        for k in ("loss_scale_window", "min_loss_scale"):
            if values[k] <= 0:
                raise bad(f"fp16.{k}", values[k], "it must be > 0 when dynamic loss scaling is enabled (loss_scale=0)")
        if values["hysteresis"] < 1:
            raise bad("fp16.hysteresis", values["hysteresis"], "it must be >= 1 (overflows absorbed before halving)")
    m.ignored += [f"fp16.{k}" for k in b]
