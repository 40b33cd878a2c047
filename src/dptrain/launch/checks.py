"""What the launcher checks before any worker starts, so that bad input is one clean message
(exit 2) instead of a traceback per rank: directories, factory signatures, and the model and
data factories actually called once.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any

from dptrain.config import ConfigError
from dptrain.config.context import check_seq_len
from dptrain.config.imports import import_object
from dptrain.config.resolve import parse_endpoint


def check_dir_writable(path: str | Path, *, what: str) -> None:
    """`path` is a directory we can write, or is created as one now (a run directory under /proc, a
    read-only or full file system, a file in the way: refused naming the option and the reason). `what`
    names the option."""
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
    created = [d for d in (p, *p.parents) if not d.exists()]  # made for the probe, removed after it
    try:  # root passes os.access everywhere: only trying tells /proc, /sys and full disks apart
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ConfigError(f"{what}={str(p)!r} cannot hold files: {e.strerror or e}") from None
    finally:
        for d in created:  # deepest first; a refused start leaves no directory behind
            with contextlib.suppress(OSError):
                d.rmdir()


WORKERS_PER_CORE = 8
"""More workers per CPU core than this is a typo, not a plan (each worker is a process with its own
interpreter, memory and threads; even an 8-GPU node has many cores per GPU)."""


def check_workers_fit(nproc: int, *, cores: int | None = None) -> None:
    """`--nproc-per-node` a machine can start: at most WORKERS_PER_CORE per core (`cores`: this one's)."""
    cores = cores or os.cpu_count() or 1
    if nproc > WORKERS_PER_CORE * cores:
        raise ConfigError(
            f"launch.nproc_per_node={nproc} workers on this node's {cores} CPU core(s): each worker is a process of "
            f"its own (an interpreter, its memory and threads), and more than {WORKERS_PER_CORE} per core "
            f"({WORKERS_PER_CORE * cores} here) cannot run; use one per GPU, or a few per node on the CPU"
        )


def check_rdzv_endpoint(endpoint: str | None) -> None:
    """`launch.rdzv_endpoint`'s host resolves (torchrun would retry an unknown name until its store
    timeout, printing C++ warnings); refused at once naming the host otherwise."""
    if endpoint is None:
        return
    host, port = parse_endpoint(endpoint)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(
            f"launch.rdzv_endpoint={endpoint!r}: the host {host!r} does not resolve ({getattr(e, 'strerror', e)}); "
            "give the host name or address of the node that runs launch.node_rank=0"
        ) from None


def check_file_writable(path: str | Path, *, what: str) -> None:
    """`path` can be written as a file: not a directory, in a directory that exists or can be made."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what}={str(p)!r} is a directory; pass a file name")
    check_dir_writable(p.parent if str(p.parent) else ".", what=f"{what}'s folder")


def check_signature(fn: Any, kwargs: dict[str, Any], *, key: str, spec: str) -> None:
    """`fn(**kwargs)` binds: no unknown keyword, no missing required argument (named with the valid ones)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C callables: let the call itself decide
    for name, value in kwargs.items():  # `seq_len=16.5`: a float where the factory says int
        p = sig.parameters.get(name)
        if p is not None and p.annotation in (int, "int") and isinstance(value, float):
            raise ConfigError(
                f"{key.rsplit('.', 1)[0]}.kwargs.{name}={value!r} is not an integer, but {spec} takes {name}: int; "
                f"give a whole number"
            )
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        params = ", ".join(n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        section = key.rsplit(".", 1)[0]
        raise ConfigError(
            f"{key}={spec!r} cannot be called with {section}.kwargs={kwargs!r}: {e}; "
            f"its parameters: {params or '(none)'}"
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


    fn = import_object(cfg.factory)
    check_signature(fn, cfg.kwargs, key="model.factory", spec=cfg.factory)
    try:
        with torch.device("meta"):
            model = fn(**cfg.kwargs)
    except ConfigError:  # the factory's own refusal (a pretrained folder that cannot be used): as it is
        raise
    except Exception:  # noqa: BLE001 - some factories need real tensors; the CPU call below reports errors
        model = call_factory(fn, cfg.kwargs, key="model.factory", spec=cfg.factory)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.factory={cfg.factory!r} returned {type(model).__name__}, not a torch.nn.Module; "
            "a model factory must return the module to train"
        )
    check_model_trains(model, spec=cfg.factory)
    return model


def check_model_trains(model: Any, *, spec: str) -> None:
    """The model has parameters to train (DDP and the optimizer refuse a model without any)."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"model.factory={spec!r} returned {type(model).__name__} with no trainable parameters; "
            "there is nothing to train (parameters with requires_grad=True are needed)"
        )


def check_vocabulary(model: Any, train: Any) -> None:
    """A language model's vocabulary holds every token id of the data (else the embedding lookup fails
    on the first step with an IndexError): the data says `vocab_size`, the model its config's."""
    data_vocab = getattr(train, "vocab_size", None)
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    model_vocab = getattr(cfg, "vocab_size", None)
    if isinstance(data_vocab, int) and isinstance(model_vocab, int) and model_vocab < data_vocab:
        raise ConfigError(
            f"model vocab_size={model_vocab} is smaller than the data's vocabulary ({type(train).__name__} token ids "
            f"go up to {data_vocab - 1}); set model.kwargs.vocab_size >= {data_vocab}"
        )


def check_tensor_parallel(model: Any, *, parallel: Any, tp: int, sample: Any = None, cp: int = 1) -> None:
    """With tp > 1: the (meta-built) model can be split over the tp ranks (a plan exists; heads,
    kv-heads, FFN width and vocabulary divisible by tp; under sequence parallelism the input
    length too, read off a training `sample`: with context parallelism (`cp` > 1) each cp rank's share of it).
    ConfigError naming the numbers."""
    if tp <= 1:
        return
    # lazy: torch: only with tp > 1
    from dptrain.parallel.tensor import load_plan, tp_problem

    if parallel.tp_plan is not None:
        try:
            load_plan(parallel.tp_plan)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            raise ConfigError(f"parallel.tp_plan={parallel.tp_plan!r} cannot be used: {e}") from None
    seq_len = _input_length(sample)
    if cp > 1 and seq_len is not None:  # each cp rank feeds its seq_len/cp tokens (config/context.py: check_seq_len)
        check_seq_len(seq_len=seq_len, cp=cp, sp=tp if parallel.sequence_parallel else 1)
        seq_len //= cp
    why = tp_problem(
        model,
        tp=tp,
        tp_plan=parallel.tp_plan,
        sequence_parallel=parallel.sequence_parallel,
        seq_len=seq_len,
    )
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
