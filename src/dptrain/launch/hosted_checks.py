"""The launcher's checks of the user code `dptrain run` hosts, before any worker starts (exit 2, one
line naming the value): `optim.factory`, `optim.scheduler_factory`, `train.eval_fn` and
`data.collate` (+ `collate_kwargs`) import and bind their arguments; and a run directory that holds
records but names no recipe (`check_unnamed_recipe`). Torch-free: `dptrain --help` imports this."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from dptrain.checkpoint.rundir import PENDING_CONFIG, RECORDS
from dptrain.config import Config, ConfigError
from dptrain.config.imports import import_object

_PLACEHOLDER = object()


def _bind(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, what: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C callables: the call itself decides
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        params = ", ".join(n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        raise ConfigError(f"{what}: {e}; its parameters: {params or '(none)'}") from None


def _callable(key: str, spec: str) -> Any:
    obj = import_object(spec)
    if not callable(obj):
        raise ConfigError(f"{key}={spec!r} is a {type(obj).__name__}, not a class or function")
    return obj


def check_hosted(cfg: Config) -> None:
    """Every hosted import path resolves and its arguments bind."""
    o = cfg.optim
    if o.factory is not None:
        opt = _callable("optim.factory", o.factory)
        kwargs = {"lr": o.lr, **({"weight_decay": o.weight_decay} if o.weight_decay else {}), **o.kwargs}
        _bind(opt, (_PLACEHOLDER,), kwargs,
              what=f"optim.factory={o.factory!r} cannot be called as factory(params, {', '.join(kwargs)}=...)"
              f" (lr from optim.lr{', weight_decay from optim.weight_decay' if o.weight_decay else ''}, the rest "
              f"optim.kwargs={o.kwargs!r})")
    if o.scheduler_factory is not None:
        sched = _callable("optim.scheduler_factory", o.scheduler_factory)
        _bind(sched, (_PLACEHOLDER,), o.scheduler_kwargs,
              what=f"optim.scheduler_factory={o.scheduler_factory!r} cannot be called with (optimizer, "
              f"**optim.scheduler_kwargs={o.scheduler_kwargs!r})")
        step = getattr(sched, "step", None) if inspect.isclass(sched) else None
        if step is not None:
            required = [p.name for p in list(inspect.signature(step).parameters.values())[1:]
                        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if required:
                raise ConfigError(
                    f"optim.scheduler_factory={o.scheduler_factory!r}: its step() needs {', '.join(required)} (e.g. "
                    "ReduceLROnPlateau's metric); dptrain steps the scheduler without arguments: choose a scheduler "
                    "that steps on its own"
                )
    if cfg.train.eval_fn is not None:
        fn = _callable("train.eval_fn", cfg.train.eval_fn)
        _bind(fn, (_PLACEHOLDER, _PLACEHOLDER), {},
              what=f"train.eval_fn={cfg.train.eval_fn!r} cannot be called as fn(model, batch)")
    if cfg.train.eval_summary is not None:
        fn = _callable("train.eval_summary", cfg.train.eval_summary)
        _bind(fn, (_PLACEHOLDER,), {}, what=f"train.eval_summary={cfg.train.eval_summary!r} cannot be called as "
              "fn(metrics)")
    if cfg.data.collate is not None:
        fn = _callable("data.collate", cfg.data.collate)
        kw = cfg.data.collate_kwargs
        _bind(fn, (_PLACEHOLDER,), kw,
              what=f"data.collate={cfg.data.collate!r} cannot be called as fn(samples"
              f"{', **data.collate_kwargs=' + repr(kw) if kw else ''})")


def run_records(run_dir: Path) -> list[str]:
    """What an earlier (perhaps never started) run left in `run_dir`, by name: any record, even an empty
    metrics.jsonl or a status/ folder, and the launcher's pending config."""
    if not run_dir.is_dir():
        return []
    names = [*RECORDS, PENDING_CONFIG, "checkpoints"]
    return [n for n in names if (run_dir / n).exists() and n != "config.yaml"]


def check_unnamed_recipe(run_dir: Path, *, items: list[str], resume: str) -> None:
    """`dptrain run --out DIR` without a recipe on the command line continues the run DIR/config.yaml names. A
    directory that holds run records but no config.yaml (e.g. a run stopped during start-up) names no recipe:
    refuse (exit 2) rather than train the built-in one there. A CONFIG file or overrides that name the model or
    the data factory (`items`: the command line's), or `--resume auto` not being asked for, say what to train."""
    named = any("=" not in item or item.split("=", 1)[0].strip() in RECIPE_KEYS for item in items)
    if named or resume != "auto" or (run_dir / "config.yaml").is_file():
        return
    found = run_records(run_dir)
    if not found:
        return
    raise ConfigError(
        f"{run_dir} holds records of an earlier run ({', '.join(found)}) but no config.yaml, so it does not say "
        "which recipe to continue, and dptrain will not train its built-in recipe there. Pass the run's config "
        f"file (dptrain run CONFIG --out {run_dir}) or its model.factory=/data.factory= overrides, or --resume "
        "none to start a new run in it with the recipe the command line gives (the built-in one without CONFIG), "
        "or use a new --out"
    )


RECIPE_KEYS = ("model.factory", "data.factory")
"""Overrides that name a recipe (as a CONFIG file does): with one of them the command line says what to train."""
