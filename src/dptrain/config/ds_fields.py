"""Torch-free checks of the fields a DeepSpeed file sets beyond dptrain's own recipe (run by `validate`):
the loss scaler's choice and DeepSpeed's OneCycle / LRRangeTest parameters (optim.schedule_params)."""

from __future__ import annotations

from dptrain.config.fields import LOSS_SCALERS, Config, ConfigError

PARAM_SCHEDULE_KEYS = {
    "onecycle": ("cycle_min_lr", "cycle_max_lr"),
    "lr_range_test": ("lr_range_test_min_lr",),
}
"""optim.schedule values that take DeepSpeed's parameters, and the ones each needs."""


def validate_ds_fields(cfg: Config) -> None:
    p = cfg.precision
    if p.loss_scaler not in LOSS_SCALERS:
        raise ConfigError(f"precision.loss_scaler={p.loss_scaler!r} is not valid; choose one of: torch, deepspeed")
    if p.loss_scaler == "torch":
        changed = [f for f, d in (("hysteresis", 2), ("min_loss_scale", 1.0), ("static_loss_scale", 0.0),
                                  ("consecutive_hysteresis", False)) if getattr(p, f) != d]
        if changed:
            raise ConfigError(
                f"precision.{changed[0]} is DeepSpeed's loss scaler's setting; torch's GradScaler has none: "
                "set precision.loss_scaler=deepspeed, or leave it out"
            )
    o = cfg.optim
    needs = PARAM_SCHEDULE_KEYS.get(o.schedule)
    if needs is None:
        if o.schedule_params:
            raise ConfigError(
                f"optim.schedule_params is for optim.schedule=onecycle or lr_range_test, not {o.schedule!r}; remove it"
            )
        return
    missing = [k for k in needs if not isinstance(o.schedule_params.get(k), int | float)]
    if missing:
        raise ConfigError(
            f"optim.schedule={o.schedule} needs optim.schedule_params.{missing[0]} (a number: DeepSpeed's parameter "
            f"of that name); given: {sorted(o.schedule_params) or 'none'}"
        )
