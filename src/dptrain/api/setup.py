"""Setting up an own loop: the process group, and a model made data-parallel.

`init_distributed` joins the job (a world of one without torchrun); `parallelize` (the one public way to
parallelise a model) returns the `ParallelModel`, whose `.module` is the module to call, with the user's attributes
passed through the DDP/DataParallel wrapper (`model.init_hidden(...)` works; FSDP2 shards the module in place, so
its attributes are there anyway). It remembers which strategy made the ParallelModel and its module
(`parallel_model_of`), so a `Checkpointer` picks the full or the DCP format by itself.
"""

from __future__ import annotations

import atexit
import re
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dptrain.config import Config, ConfigError, ParallelConfig, validate
from dptrain.config.layout import resolve_layout
from dptrain.distributed.env import DistEnv
from dptrain.distributed.mesh import ParallelMesh
from dptrain.distributed.process_group import bind_device, destroy_process_group, init_process_group
from dptrain.parallel import ParallelModel, parallelize_model


def in_callers_words(e: ConfigError, call: str, section: str, names: tuple[str, ...]) -> ConfigError:
    """`e` (of the same class) as the API call `call` would say it: the config fields `section.NAME` that
    are parameters of the call are named as the caller wrote them (`global_batch_size=3`, not
    `train.global_batch_size=3`)."""
    text = re.sub(rf"\b{re.escape(section)}\.({'|'.join(map(re.escape, names))})\b", r"\1", str(e))
    return type(e)(f"{call}: {text}")


@dataclass(frozen=True)
class Runtime:
    """What `init_distributed` set up: this process's place in the job and its device."""

    env: DistEnv
    device: torch.device

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.is_main


def init_distributed(*, device: str = "auto", backend: str = "auto", timeout_s: float = 600.0) -> Runtime:
    """Join the job torchrun started (or a world of one without torchrun) and bind this rank's device.
    The process group is destroyed at interpreter exit."""
    env = DistEnv.from_env()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    dev = bind_device(env, device)
    init_process_group(env, backend=backend, device=dev, timeout_s=timeout_s)
    atexit.register(destroy_process_group)
    _SETTINGS["timeout_s"] = timeout_s
    return Runtime(env=env, device=dev)


_SETTINGS: dict[str, float] = {"timeout_s": 600.0}  # what init_distributed was given (the monitor's default)


def process_group_timeout() -> float:
    """The process-group timeout `init_distributed` set (600 s by default)."""
    return _SETTINGS["timeout_s"]


# Which strategy made a module or ParallelModel: a Checkpointer records it and picks full or DCP by it.
_MADE_BY: weakref.WeakKeyDictionary[Any, tuple[ParallelModel, str]] = weakref.WeakKeyDictionary()


def parallel_model_of(model: Any) -> tuple[ParallelModel | None, str | None]:
    """(the `ParallelModel`, its strategy) behind a ParallelModel from `parallelize` or its `.module`; (None, None)
    for a model dptrain did not parallelise."""
    return _MADE_BY.get(model, (None, None))


class _PassThrough:
    """Attribute look-ups that the wrapper does not answer go to the user's module inside it."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            inner = super().__getattr__("module")  # type: ignore[misc]
            return getattr(inner, name)


class PassThroughDDP(_PassThrough, DistributedDataParallel):
    """DistributedDataParallel whose unknown attributes are the wrapped module's (`model.init_hidden`)."""


class PassThroughDataParallel(_PassThrough, nn.DataParallel):
    """nn.DataParallel whose unknown attributes are the wrapped module's."""


def pass_through(module: nn.Module) -> nn.Module:
    """Let a DDP/DataParallel wrapper answer with the wrapped module's attributes (in place: the same object,
    still an instance of its wrapper class). Other modules are returned as they are."""
    if type(module) is DistributedDataParallel:
        module.__class__ = PassThroughDDP
    elif type(module) is nn.DataParallel:
        module.__class__ = PassThroughDataParallel
    return module


PARALLELIZE_ARGS = ("strategy", "bucket_cap_mb", "cpu_offload", "dp_replicate", "dp_shard", "activation_checkpointing",
                    "fsdp_param_dtype", "fsdp_reduce_dtype")
"""`parallelize`'s arguments that are `parallel.*` config fields of the same names."""


def parallelize(
    model: nn.Module, *, strategy: str = "ddp", device: torch.device | None = None, dp_replicate: int = 1,
    dp_shard: int = 1, activation_checkpointing: str = "none", bucket_cap_mb: float = 5.0, cpu_offload: bool = False,
    fsdp_param_dtype: str | None = None, fsdp_reduce_dtype: str | None = None,
    materialize: Callable[[nn.Module], None] | None = None,
) -> ParallelModel:
    """Parallelise a plain model over the current world (after `init_distributed`) exactly as the
    Trainer does, and return the `ParallelModel`: `.module` to call (your module's attributes pass through a
    DDP/DataParallel wrapper; `dptrain.unwrap` is your module), `.optimizer(cls, **kw)` (sharded under zero1: build
    zero1's optimizer there), `.sync_gradients(sync)`, `.clip_grad_norm_(max_norm)`, `.state_dict()`,
    `.full_state_dict()`. The layout arguments mean what the `parallel.*` config fields of the same names mean."""
    cfg = ParallelConfig(
        strategy=strategy,
        bucket_cap_mb=bucket_cap_mb,
        cpu_offload=cpu_offload,
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        activation_checkpointing=activation_checkpointing,
        fsdp_param_dtype=fsdp_param_dtype,
        fsdp_reduce_dtype=fsdp_reduce_dtype,
    )
    try:
        validate(Config(parallel=cfg))
    except ConfigError as e:
        raise in_callers_words(e, "parallelize", "parallel", PARALLELIZE_ARGS) from None
    if not dist.is_initialized():
        raise RuntimeError(
            "dptrain.parallelize needs the process group: call dptrain.init_distributed() first "
            "(without torchrun it makes a world of one)"
        )
    dims, _ = resolve_layout(cfg, world_size=dist.get_world_size())
    device = device or torch.device("cpu")
    mesh = ParallelMesh.build(dims, device_type=device.type)
    pmodel = parallelize_model(model, cfg=cfg, mesh=mesh, device=device, materialize=materialize)
    pass_through(pmodel.module)
    _MADE_BY[pmodel] = _MADE_BY[pmodel.module] = (pmodel, strategy)
    return pmodel


def prepare_model(model: nn.Module, *, strategy: str = "ddp", device: torch.device | None = None,
                  bucket_cap_mb: float = 5.0, cpu_offload: bool = False) -> nn.Module:
    """Deprecated: `dptrain.parallelize(model, ...).module`, which it calls (scripts written for 0.1 keep working,
    with one FutureWarning). zero1 is refused: its optimizer must be sharded too, which a module alone cannot carry."""
    warnings.warn("dptrain.prepare_model is deprecated: use dptrain.parallelize(model, ...).module (the same module; "
                  "keep the ParallelModel for .optimizer(...) and .clip_grad_norm_(...))", FutureWarning, stacklevel=2)
    if strategy == "zero1":
        raise ConfigError(
            "prepare_model(strategy='zero1') cannot shard the optimizer: it returns only the module. Use "
            "pmodel = dptrain.parallelize(model, strategy='zero1'); "
            "optimizer = pmodel.optimizer(torch.optim.AdamW, lr=...); call pmodel.module in the loop"
        )
    return parallelize(model, strategy=strategy, device=device, bucket_cap_mb=bucket_cap_mb,
                       cpu_offload=cpu_offload).module
