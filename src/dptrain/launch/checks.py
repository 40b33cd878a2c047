"""What the launcher checks before any worker starts, so that bad input is one clean message
(exit 2) instead of a traceback per rank: directories, factory signatures, and the model and
data factories actually called once.
"""

from __future__ import annotations

import inspect
import os
import traceback
from pathlib import Path
from typing import Any

from dptrain.config import ConfigError


def check_dir_writable(path: str | Path, *, what: str) -> None:
    """`path` is a directory we can write, or can be created as one. `what` names the option."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{what}={str(p)!r} is a file, not a directory; pass a directory (it is created if missing)")
    probe = p
    while not probe.exists():  # the nearest existing ancestor decides whether mkdir can succeed
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"{what}={str(p)!r} cannot be created: {str(probe)!r} is a file, not a directory")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{what}={str(p)!r} is not writable ({str(probe)!r} denies write access to this user)")


def check_signature(fn: Any, kwargs: dict[str, Any], *, key: str, spec: str) -> None:
    """`fn(**kwargs)` binds: no unknown keyword, no missing required argument (named with the valid ones)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C callables: let the call itself decide
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        params = ", ".join(n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        section = key.rsplit(".", 1)[0]
        raise ConfigError(
            f"{key}={spec!r} cannot be called with {section}.kwargs={kwargs!r}: {e}; its parameters: {params or '(none)'}"
        ) from None


class FactoryFailed(Exception):
    """A user factory raised: `report` is one header line naming it plus the user's own traceback."""

    def __init__(self, report: str) -> None:
        super().__init__(report)
        self.report = report


def call_factory(fn: Any, kwargs: dict[str, Any], *, key: str, spec: str) -> Any:
    """Call a factory once; on an exception raise FactoryFailed carrying only the user's frames."""
    try:
        return fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - any error of user code is reported, not re-raised
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not _is_ours(f.filename)]
        body = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(type(e), e))
        raise FactoryFailed(
            f"dptrain: error: {key}={spec!r} raised {type(e).__name__} when called with its kwargs "
            f"(no worker was started); its traceback:\n{body}"
        ) from None


def _is_ours(filename: str) -> bool:
    here = Path(__file__).resolve()
    try:
        resolved = Path(filename).resolve()
    except OSError:
        return False
    return resolved == here or resolved.parts[-3:] == ("torch", "utils", "_device.py")


def check_model(cfg: Any) -> Any:
    """Build the model once on the meta device (no memory, no compute): the factory must accept
    its kwargs and return an `nn.Module`, which is returned. Falls back to the CPU if the factory
    cannot run on meta."""
    import torch
    from torch import nn

    from dptrain.config.imports import import_object

    fn = import_object(cfg.factory)
    check_signature(fn, cfg.kwargs, key="model.factory", spec=cfg.factory)
    try:
        with torch.device("meta"):
            model = fn(**cfg.kwargs)
    except Exception:  # noqa: BLE001 - some factories need real tensors; the CPU call below reports errors
        model = call_factory(fn, cfg.kwargs, key="model.factory", spec=cfg.factory)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.factory={cfg.factory!r} returned {type(model).__name__}, not a torch.nn.Module; "
            "a model factory must return the module to train"
        )
    return model


def check_tensor_parallel(model: Any, *, parallel: Any, tp: int, sample: Any = None) -> None:
    """With tp > 1: the (meta-built) model can be split over the tp ranks (a plan exists; heads,
    kv-heads, FFN width and vocabulary divisible by tp; under sequence parallelism the input
    length too, read off a training `sample`). ConfigError naming the numbers."""
    if tp <= 1:
        return
    from dptrain.parallel.tensor import load_plan, tp_problem

    if parallel.tp_plan is not None:
        try:
            load_plan(parallel.tp_plan)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            raise ConfigError(f"parallel.tp_plan={parallel.tp_plan!r} cannot be used: {e}") from None
    why = tp_problem(model, tp=tp, tp_plan=parallel.tp_plan, sequence_parallel=parallel.sequence_parallel,
                     seq_len=_input_length(sample))
    if why is not None:
        raise ConfigError(why)


def _input_length(sample: Any) -> int | None:
    """The length of the sequence a sample feeds the model: a token row [T+1] (inputs [:-1]), or a
    mapping's `input_ids`; None when it cannot be told."""
    import torch

    if isinstance(sample, dict) and isinstance(sample.get("input_ids"), torch.Tensor):
        return int(sample["input_ids"].shape[-1])
    if isinstance(sample, torch.Tensor) and sample.ndim == 1 and not sample.is_floating_point():
        return int(sample.shape[0]) - 1
    return None
