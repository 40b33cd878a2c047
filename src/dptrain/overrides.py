"""Loading configs: YAML recipes, DeepSpeed-style JSON, and `section.field=value` overrides.

Everything goes through one path: file -> nested dict -> overrides applied to the dict ->
`build_config` which turns the dict into the frozen dataclass tree, refusing unknown keys
with the list of valid ones.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
import warnings
from pathlib import Path
from typing import Any

import yaml

from dptrain.config import Config, ConfigError, to_dict


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML recipe or a JSON file (native or DeepSpeed-style), then apply dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        data = load_file(path)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    return build_config(data)


def load_file(path: str | Path) -> dict[str, Any]:
    """The nested dict a config file describes; DeepSpeed JSON is translated (unknown keys warned about)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    text = p.read_text()
    try:
        raw = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot parse config file {str(p)!r}: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level, not {type(raw).__name__}")
    sections = {f.name for f in dataclasses.fields(Config)}
    if p.suffix == ".json" and not set(raw) <= sections:
        data, unknown = from_deepspeed(raw)
        if unknown:
            warnings.warn(
                f"{p.name}: DeepSpeed keys dptrain does not use (ignored): {', '.join(sorted(unknown))}",
                stacklevel=2,
            )
        return data
    return raw


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", value parsed as a YAML scalar)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.field=value")
    key, _, text = item.partition("=")
    key = key.strip()
    if not key or "." not in key:
        raise ConfigError(f"override {item!r}: the key must be dotted, e.g. train.max_steps=100")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    return key, value


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set data[a][b][c] = value for key 'a.b.c', creating dicts on the way."""
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(f"override {key!r}: {part!r} holds a value, not a section")
        node = nxt
    node[parts[-1]] = value


def build_config(data: dict[str, Any]) -> Config:
    """Nested dict -> Config; unknown keys raise ConfigError naming the valid keys."""
    return _build(Config, data, prefix="")


def _build(cls: type, data: dict[str, Any], *, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        where = prefix.rstrip(".") or "the top level"
        raise ConfigError(
            f"unknown config key {prefix + unknown[0]!r}; valid keys in {where}: {', '.join(fields)}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if value is None:  # `train:` with nothing under it
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix + name!r} must be a section (mapping), not {value!r}")
            kwargs[name] = _build(hint, value, prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**_merge_kwargs(cls, kwargs))


def _merge_kwargs(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Dict-valued fields (`kwargs`) given partially are merged over their defaults only when the
    factory is the default one; a different factory starts from an empty dict."""
    out = dict(kwargs)
    for f in dataclasses.fields(cls):
        if f.name == "kwargs" and "kwargs" in out and "factory" not in out:
            out["kwargs"] = {**f.default_factory(), **(out["kwargs"] or {})}  # type: ignore[misc]
        elif f.name == "kwargs" and "factory" in out and "kwargs" not in out:
            out["kwargs"] = {}
    return out


def _coerce(value: Any, hint: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{name} cannot be null")
    if origin in (typing.Union, types.UnionType):
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, name)
            except ConfigError:
                continue
        raise ConfigError(f"{name}={value!r} has the wrong type; expected {_hint_name(hint)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, str):  # "3e2", "1_000": YAML 1.1 leaves some numbers as strings
            value = _number(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            value = _number(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # e.g. launch.rdzv_id=42
        if isinstance(value, bool):
            return "on" if value else "off"  # YAML 1.1 reads off/no/false as False: diagnostics.nonfinite=off
    elif origin is dict:
        if isinstance(value, dict):
            return value
    elif origin is tuple:
        if isinstance(value, list | tuple) and len(value) == len(args):
            return tuple(_coerce(v, a, name) for v, a in zip(value, args, strict=True))
    else:
        return value
    raise ConfigError(f"{name}={value!r} has the wrong type; expected {_hint_name(hint)}")


def _number(text: str) -> Any:
    """`text` as an int or float when it spells one, else unchanged (the caller reports the type error)."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            continue
    return text


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def dump_yaml(cfg: Config, extra: dict[str, Any] | None = None) -> str:
    """The config as YAML (plus an optional `resolved` section of derived values, ignored when loaded back)."""
    d = to_dict(cfg)
    text = yaml.safe_dump(d, sort_keys=False)
    if extra:
        text += "# derived values (not read back):\n" + "".join(
            f"#   {k}: {v}\n" for k, v in extra.items()
        )
    return text


# ---------------------------------------------------------------------------------------
# DeepSpeed-style JSON
# ---------------------------------------------------------------------------------------

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
        kind = sch.get("type")
        params = _no_auto(sch.get("params"))
        if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
            raise ConfigError(
                f"DeepSpeed scheduler.type={kind!r} is not supported; use WarmupLR, WarmupDecayLR or WarmupCosineLR"
            )
        put("optim.schedule", {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}[kind])
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
