"""Checks of the config fields that host a user's own code in `dptrain run`: an optimizer and an LR
scheduler named by import path (`optim.factory`, `optim.scheduler_factory`), evaluation metrics
(`train.eval_fn`, `train.eval_samples`) and collate arguments (`data.collate_kwargs`). Only what needs no
import here; the launcher imports the paths and binds the arguments (launch/checks.py: `check_hosted`).

Also `TORCH_DEFAULTS`, the `--defaults torch` preset: the fields whose dptrain default differs from
plain PyTorch's semantics, set to PyTorch's."""

from __future__ import annotations

from typing import Any

from dptrain.config.fields import Config, ConfigError

SCHEDULER_INTERVALS = ("step", "epoch")

TORCH_DEFAULTS: dict[str, Any] = {
    "optim.weight_decay": 0.0,
    "optim.warmup_steps": 0,
    "optim.schedule": "constant",
    "optim.grad_clip": None,
    "optim.betas": [0.9, 0.999],
    "optim.min_lr_ratio": 1.0,
}
"""`--defaults torch`: what plain PyTorch does without being asked (torch.optim's own defaults: no weight decay,
betas (0.9, 0.999); a constant learning rate: no warm-up, no decay; no gradient clipping). Applied under the
config file and the overrides, so anything they set wins."""

DEFAULTS_PRESETS = {"dptrain": {}, "torch": TORCH_DEFAULTS}
"""`--defaults NAME` -> the fields it changes (dptrain: none)."""


def preset_overrides(name: str) -> list[str]:
    """The `field=value` overrides of `--defaults NAME`, or ConfigError naming the valid names."""
    if name not in DEFAULTS_PRESETS:
        raise ConfigError(f"--defaults {name!r} is not valid; choose one of: {', '.join(DEFAULTS_PRESETS)}")
    return [f"{k}={_yaml(v)}" for k, v in DEFAULTS_PRESETS[name].items()]


def _yaml(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, list):
        return "[" + ", ".join(str(x) for x in v) + "]"
    return str(v)


def _import_path(name: str, v: Any) -> None:
    if not isinstance(v, str) or not ("." in v or ":" in v) or v.startswith((".", ":")) or v.endswith((".", ":")):
        raise ConfigError(
            f"{name}={v!r} is not an import path; write it as 'package.module:name' or 'package.module.Name' "
            "(e.g. torch.optim.Adadelta)"
        )


def validate_hosting(cfg: Config) -> None:
    """Shapes and combinations of the hosting fields (no import)."""
    o, t, d = cfg.optim, cfg.train, cfg.data
    if o.factory is not None:
        _import_path("optim.factory", o.factory)
    elif o.kwargs:
        raise ConfigError(f"optim.kwargs={o.kwargs!r} is given without optim.factory; they are the factory's "
                          "arguments: set optim.factory (e.g. torch.optim.Adadelta) or drop them")
    for key, field in (("lr", "optim.lr"), ("weight_decay", "optim.weight_decay")):
        if key in o.kwargs:
            how = "scaled by optim.lr_scaling" if key == "lr" else "on matrices only"
            raise ConfigError(f"optim.kwargs.{key}={o.kwargs[key]!r}: set {field} instead (dptrain passes it to "
                              f"the factory as {key}=, {how})")
    if o.scheduler_factory is not None:
        _import_path("optim.scheduler_factory", o.scheduler_factory)
    elif o.scheduler_kwargs:
        raise ConfigError(f"optim.scheduler_kwargs={o.scheduler_kwargs!r} is given without optim.scheduler_factory; "
                          "set optim.scheduler_factory (e.g. torch.optim.lr_scheduler.StepLR) or drop them")
    if o.scheduler_interval not in SCHEDULER_INTERVALS:
        raise ConfigError(f"optim.scheduler_interval={o.scheduler_interval!r} is not valid; choose one of: "
                          f"{', '.join(SCHEDULER_INTERVALS)}")
    if o.scheduler_interval != "step" and o.scheduler_factory is None:
        raise ConfigError(f"optim.scheduler_interval={o.scheduler_interval!r} applies to optim.scheduler_factory, "
                          "which is not set (dptrain's own schedule steps every optimizer step)")
    if t.eval_fn is not None:
        _import_path("train.eval_fn", t.eval_fn)
    if t.eval_summary is not None:
        _import_path("train.eval_summary", t.eval_summary)
        if t.eval_fn is None:
            raise ConfigError(f"train.eval_summary={t.eval_summary!r} summarises train.eval_fn's metrics, which is "
                              "not set; set train.eval_fn")
    if t.eval_samples is not None and (isinstance(t.eval_samples, bool) or not isinstance(t.eval_samples, int)
                                       or t.eval_samples < -1 or t.eval_samples == 0):
        raise ConfigError(f"train.eval_samples={t.eval_samples!r} is not valid; it must be a positive integer, "
                          "-1 (the whole validation set) or null (train.eval_batches per rank)")
    if t.eval_fn is not None and cfg.parallel.pp > 1:
        raise ConfigError(f"train.eval_fn={t.eval_fn!r} cannot be used with parallel.pp={cfg.parallel.pp}: a "
                          "pipeline stage holds only part of the model; evaluate with parallel.pp=1")
    if d.collate_kwargs and d.collate is None:
        raise ConfigError(f"data.collate_kwargs={d.collate_kwargs!r} is given without data.collate; set "
                          "data.collate to the function they are bound to")
    for name, v in (("optim.kwargs", o.kwargs), ("optim.scheduler_kwargs", o.scheduler_kwargs),
                    ("data.collate_kwargs", d.collate_kwargs)):
        if not isinstance(v, dict):
            raise ConfigError(f"{name}={v!r} is not a mapping of keyword arguments")
