"""DeepSpeed's scheduler block -> optim.* (deepspeed.runtime.lr_schedules: WarmupLR, WarmupDecayLR,
WarmupCosineLR as dptrain's schedules under the deepspeed convention; OneCycle and LRRangeTest as
train/schedules.py's classes with DeepSpeed's own parameters in optim.schedule_params)."""

from __future__ import annotations

from typing import Any

from dptrain.config.deepspeed.mapping import DeepSpeedMapping, bad, number
from dptrain.config.fields import ConfigError

WARMUP_SCHEDULES = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
PARAM_SCHEDULES = {"OneCycle": "onecycle", "LRRangeTest": "lr_range_test"}

# DeepSpeed's own defaults (lr_schedules.py signatures); None: required
ONECYCLE_PARAMS: dict[str, Any] = {
    "cycle_min_lr": None, "cycle_max_lr": None, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
    "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
    "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0,
}
LR_RANGE_TEST_PARAMS: dict[str, Any] = {
    "lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
    "lr_range_test_staircase": False,
}


def scheduler(sch: dict[str, Any] | None, m: DeepSpeedMapping) -> None:
    if sch is None:  # DeepSpeed without a scheduler block: the optimizer's lr, constant
        m.default("scheduler", "optim.schedule", "constant")
        m.default("scheduler", "optim.warmup_steps", 0)
        return
    kind = sch.get("type")
    if not isinstance(kind, str) or kind not in {**WARMUP_SCHEDULES, **PARAM_SCHEDULES}:
        raise bad("scheduler.type", kind, "use WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest")
    raw = sch.get("params", {})
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise bad("scheduler.params", raw, "it must be a mapping (a JSON object)")
    if kind in PARAM_SCHEDULES:
        _param_schedule(kind, raw, m)
        return
    params = {k: v for k, v in raw.items() if v != "auto"}
    m.put("scheduler.type", "optim.schedule", WARMUP_SCHEDULES[kind])
    m.put("scheduler.type", "optim.schedule_convention", "deepspeed")

    def take(pk: str, dflt: Any) -> Any:
        if pk in params:
            return params.pop(pk)
        return None if pk in raw else dflt  # None: "auto"

    if "warmup_num_steps" in params and params["warmup_num_steps"] is None:
        raise ConfigError(  # DeepSpeed's WarmupLR/WarmupCosineLR raise the same
            "DeepSpeed scheduler.params.warmup_num_steps=None is not valid: warmup_num_steps must be a positive "
            'integer (DeepSpeed raises too); give a number, or "auto" for dptrain\'s optim.warmup_steps'
        )
    steps = take("warmup_num_steps", 1000)
    if steps is not None:
        (m.put if "warmup_num_steps" in raw else m.default)(
            "scheduler.params.warmup_num_steps",
            "optim.warmup_steps",
            number("scheduler.params.warmup_num_steps", steps, integer=True, positive=True),
        )
    wtype = take("warmup_type", "log")
    if wtype is not None:
        if wtype not in ("log", "linear"):  # DeepSpeed: a warning, then log
            m.notes.append(f"scheduler.params.warmup_type={wtype!r} is unknown: log is used, as DeepSpeed does")
            wtype = "log"
        (m.put if "warmup_type" in raw else m.default)("scheduler.params.warmup_type", "optim.warmup_type", wtype)
    if kind != "WarmupLR" and "total_num_steps" not in raw:  # DeepSpeed: TypeError, a required argument
        raise ConfigError(
            f'DeepSpeed scheduler {kind} needs params.total_num_steps (DeepSpeed has no default); give it, or "auto" '
            "for dptrain's train.max_steps"
        )
    total = take("total_num_steps", None)
    if total is not None:
        m.put(
            "scheduler.params.total_num_steps",
            "train.max_steps",
            number("scheduler.params.total_num_steps", total, integer=True, positive=True),
        )
    if kind == "WarmupCosineLR":
        _cosine_ratios(take, raw, m)
    else:
        _min_max_lr(kind, take, raw, m)
    m.ignored += [f"scheduler.params.{k}" for k in params]


def _param_schedule(kind: str, raw: dict[str, Any], m: DeepSpeedMapping) -> None:
    """OneCycle / LRRangeTest: DeepSpeed's parameters, checked as its constructors check them, kept whole
    for train/schedules.py; the peak lr (cycle_max_lr, or the range test's start) becomes optim.lr."""
    table = ONECYCLE_PARAMS if kind == "OneCycle" else LR_RANGE_TEST_PARAMS
    auto = [k for k, v in raw.items() if v == "auto"]
    if auto:
        raise bad(f"scheduler.params.{auto[0]}", "auto", f"{kind} needs explicit values (dptrain has no default)")
    unknown = [k for k in raw if k not in table]
    if unknown:  # DeepSpeed: TypeError, unexpected keyword argument
        raise bad(f"scheduler.params.{unknown[0]}", raw[unknown[0]], f"{kind} takes: {', '.join(table)}")
    params = {k: raw.get(k, v) for k, v in table.items()}
    for k, v in params.items():
        key = f"scheduler.params.{k}"
        if k in ("cycle_min_lr", "cycle_max_lr") and v is None:
            raise bad(key, v, f"{kind} needs it (DeepSpeed has no default)")
        if k in ("cycle_momentum", "lr_range_test_staircase"):
            if not isinstance(v, bool):
                raise bad(key, v, "use true or false")
        elif v is not None:
            number(key, v)
    if kind == "OneCycle":
        if params["cycle_first_step_size"] <= 0:
            raise bad("scheduler.params.cycle_first_step_size", params["cycle_first_step_size"], "it must be > 0")
        second = params["cycle_second_step_size"]
        if second is not None and second < 0:
            raise bad("scheduler.params.cycle_second_step_size", second, "it must be >= 0")
        peak = params["cycle_max_lr"]
    else:
        size = params["lr_range_test_step_size"]
        if not isinstance(size, int) or size <= 0:
            raise bad("scheduler.params.lr_range_test_step_size", size, "it must be a positive integer")
        peak = params["lr_range_test_min_lr"]
    m.put("scheduler.type", "optim.schedule", PARAM_SCHEDULES[kind])
    m.put("scheduler.params", "optim.schedule_params", params)
    m.put(f"scheduler.params ({kind}'s starting/peak lr)", "optim.lr", peak)
    m.default("scheduler", "optim.warmup_steps", 0)


def _cosine_ratios(take: Any, raw: dict[str, Any], m: DeepSpeedMapping) -> None:
    for pk, target, dflt in (
        ("warmup_min_ratio", "optim.warmup_start_ratio", 0.0),
        ("cos_min_ratio", "optim.min_lr_ratio", 1e-4),
    ):
        v = take(pk, dflt)
        if v is not None:
            key = f"scheduler.params.{pk}"
            (m.put if pk in raw else m.default)(key, target, number(key, v))


def _min_max_lr(kind: str, take: Any, raw: dict[str, Any], m: DeepSpeedMapping) -> None:
    """WarmupLR/WarmupDecayLR: absolute warmup_min_lr/warmup_max_lr become the peak lr and ratios of it.
    warmup_max_lr defaults to the optimizer's lr for WarmupLR and to 0.001 for WarmupDecayLR."""
    max_lr = take("warmup_max_lr", None if kind == "WarmupLR" else 1e-3)
    min_lr = take("warmup_min_lr", 0.0)
    if max_lr is not None:
        number("scheduler.params.warmup_max_lr", max_lr, positive=True)
        (m.put if "warmup_max_lr" in raw else m.default)("scheduler.params.warmup_max_lr", "optim.lr", max_lr)
    if min_lr is None:
        return
    number("scheduler.params.warmup_min_lr", min_lr)
    peak = max_lr if max_lr is not None else m.config.get("optim", {}).get("lr")
    if min_lr and peak is None:
        m.ignored.append('scheduler.params.warmup_min_lr (the peak lr is "auto"; set optim.warmup_start_ratio)')
        return
    ratio = min_lr / peak if min_lr else 0.0
    if not 0.0 <= ratio <= 1.0:
        raise bad("scheduler.params.warmup_min_lr", min_lr, f"it must lie between 0 and the peak lr {peak!r}")
    put = m.put if "warmup_min_lr" in raw else m.default
    put("scheduler.params.warmup_min_lr", "optim.warmup_start_ratio", ratio)
    if kind == "WarmupDecayLR":  # decays to warmup_min_lr
        put("scheduler.params.warmup_min_lr", "optim.min_lr_ratio", ratio)
