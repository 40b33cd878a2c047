"""Validation and derived values: what a Config means for a given world size.

Everything here runs before any process group starts, so bad input fails in the launcher with
exit code 2 and a message naming the value and what would be valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dptrain.config.fields import (
    ACTIVATION_CHECKPOINTING,
    DEFAULT_BATCH,
    DTYPES,
    LR_SCALINGS,
    MP_DTYPES,
    NONFINITE_POLICIES,
    OPTIMIZERS,
    SCHEDULE_CONVENTIONS,
    SCHEDULES,
    WARMUP_TYPES,
    Config,
    ConfigError,
    DiagnosticsConfig,
    LaunchConfig,
    OptimConfig,
    TrainConfig,
)
from dptrain.config.layout import DataParallelMode, resolve_layout, strategy_mode

if TYPE_CHECKING:
    from dptrain.distributed.mesh import ParallelDims

# ---------------------------------------------------------------------------------------
# Derived values
# ---------------------------------------------------------------------------------------


class BatchSizeError(ConfigError):
    """The batch sizes do not fit together at this data-parallel world size (each value is valid on its
    own): resuming at another world size re-derives gradient accumulation instead."""


def _choice(value: str, valid: tuple[str, ...], name: str) -> None:
    if value not in valid:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of: {', '.join(valid)}")


def local_world_size(launch: LaunchConfig, *, cuda_count: int | None = None) -> int:
    """Worker processes per node, resolving `auto` to the local GPU count (2 on a CPU-only machine)."""
    if launch.nproc_per_node == "auto":
        if cuda_count is None:
            import torch

            cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cuda_count if cuda_count > 0 else 2
    try:
        n = int(launch.nproc_per_node)
    except (TypeError, ValueError):
        raise ConfigError(f"launch.nproc_per_node={launch.nproc_per_node!r} is not valid; use a positive integer or 'auto'") from None
    if n < 1:
        raise ConfigError(f"launch.nproc_per_node={n} is not valid; use a positive integer or 'auto'")
    return n


def resolve_batch(train: TrainConfig, *, dp_world_size: int) -> tuple[int, int, int]:
    """Return (global, micro, accum) with global = micro * accum * dp_world_size, deriving what is missing
    by DeepSpeed's rules (`_set_batch_related_parameters`): global + micro -> accum; global + accum ->
    micro; global only -> accum 1; micro (+ accum) -> global. None of the three given: the built-in
    recipe DEFAULT_BATCH (global 32, micro 8).

    Raises ConfigError naming the equation and valid alternatives when the numbers disagree.
    """
    g, m, a, w = train.global_batch_size, train.micro_batch_size, train.grad_accum_steps, dp_world_size
    if g is None and m is None and a is None:
        g, m = DEFAULT_BATCH
    for name, v in (("train.global_batch_size", g), ("train.micro_batch_size", m), ("train.grad_accum_steps", a)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ConfigError(f"{name}={v!r} is not valid; it must be a positive integer (or left out to derive it)")
    if m is None and a is None:
        a = 1
    if g is None:
        g = (m or 1) * (a or 1) * w
        m, a = m or 1, a or 1
    elif m is None:
        assert a is not None
        if g % (a * w):
            raise BatchSizeError(
                f"train.global_batch_size={g} is not divisible by grad_accum_steps * dp world size = {a} * {w}; "
                f"{_alternatives(g, w)}"
            )
        m = g // (a * w)
    elif a is None:
        if g % (m * w):
            raise BatchSizeError(
                f"train.global_batch_size={g} is not divisible by micro_batch_size * dp world size = {m} * {w}; "
                f"{_alternatives(g, w)}"
            )
        a = g // (m * w)
    if g != m * a * w:
        raise BatchSizeError(
            f"batch sizes disagree: global_batch_size != micro_batch_size * grad_accum_steps * dp_world_size "
            f"({g} != {m} * {a} * {w}); {_alternatives(g, w)}"
        )
    return g, m, a


def _alternatives(g: int, w: int) -> str:
    if g % w:
        near = [x for x in (g - g % w, g - g % w + w) if x > 0]
        return f"the global batch must be a multiple of the dp world size {w}; e.g. train.global_batch_size={' or '.join(map(str, near))}"
    per_rank = g // w
    pairs = [f"micro_batch_size={d} grad_accum_steps={per_rank // d}" for d in range(1, per_rank + 1) if per_rank % d == 0]
    return f"valid for global_batch_size={g} at dp world size {w}: " + "; ".join(pairs[-4:])


def scaled_lr(optim: OptimConfig, *, global_batch_size: int) -> tuple[float, str]:
    """The peak learning rate for this global batch and a sentence saying which rule produced it."""
    _choice(optim.lr_scaling, LR_SCALINGS, "optim.lr_scaling")
    base = optim.base_batch_size or global_batch_size
    if optim.lr_scaling == "none" or base == global_batch_size:
        return optim.lr, f"lr={optim.lr:g} (lr_scaling={optim.lr_scaling}, global batch {global_batch_size})"
    ratio = global_batch_size / base
    factor = ratio if optim.lr_scaling == "linear" else math.sqrt(ratio)
    lr = optim.lr * factor
    rule = "lr * G / base" if optim.lr_scaling == "linear" else "lr * sqrt(G / base)"
    return lr, f"lr={lr:g} = {rule} = {optim.lr:g} * {factor:g} (global batch {global_batch_size}, base {base})"


@dataclass(frozen=True)
class Resolved:
    """Values derived from a Config and the world size; printed by `config show` and logged at start."""

    world_size: int
    dp_world_size: int
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    lr: float
    lr_rule: str
    device: str
    backend: str
    dims: ParallelDims
    """The mesh degrees; dp_world_size = dims.dp_replicate * dims.dp_shard."""
    mode: DataParallelMode
    """How `parallel.strategy` applies data parallelism (wrapper, optimizer sharding, resharding)."""


def resolve(cfg: Config, *, world_size: int | None = None, cuda_available: bool | None = None) -> Resolved:
    """Validate `cfg` and derive everything that depends on the world size. Raises ConfigError."""
    validate(cfg)
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if world_size is None:
        world_size = local_world_size(cfg.launch, cuda_count=None if cuda_available else 0) * cfg.launch.nnodes
    device = cfg.parallel.device
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    if device == "cuda" and not cuda_available:
        raise ConfigError("parallel.device='cuda' but no CUDA device is available; use parallel.device=cpu or auto")
    mode = strategy_mode(cfg.parallel)
    if mode.wrapper == "dataparallel" and device != "cuda":
        raise ConfigError(
            f"parallel.strategy={cfg.parallel.strategy!r} (nn.DataParallel) needs CUDA GPUs and none is available; "
            "use parallel.strategy=ddp, which also runs on the CPU"
        )
    dims, mode = resolve_layout(cfg.parallel, world_size=world_size)
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ConfigError("parallel.backend='nccl' needs CUDA; use gloo (or auto) on the CPU")
    g, m, a = resolve_batch(cfg.train, dp_world_size=dims.dp_size)  # tp/pp ranks share their dp rank's batch
    lr, rule = scaled_lr(cfg.optim, global_batch_size=g)
    return Resolved(world_size, dims.dp_size, g, m, a, lr, rule, device, backend, dims, mode)


def validate(cfg: Config) -> None:
    """Checks that need no world size: choices, ranges, import-path shape."""
    strategy_mode(cfg.parallel)  # a known strategy name
    _choice(cfg.precision.dtype, DTYPES, "precision.dtype")
    _choice(cfg.optim.name, OPTIMIZERS, "optim.name")
    _choice(cfg.optim.lr_scaling, LR_SCALINGS, "optim.lr_scaling")
    _choice(cfg.optim.schedule, SCHEDULES, "optim.schedule")
    _choice(cfg.optim.warmup_type, WARMUP_TYPES, "optim.warmup_type")
    _choice(cfg.optim.schedule_convention, SCHEDULE_CONVENTIONS, "optim.schedule_convention")
    if not 0.0 <= cfg.optim.warmup_start_ratio <= 1.0:
        raise ConfigError(f"optim.warmup_start_ratio={cfg.optim.warmup_start_ratio!r} is not valid; it must be in [0, 1]")
    _choice(cfg.parallel.device, ("auto", "cpu", "cuda"), "parallel.device")
    _choice(cfg.parallel.backend, ("auto", "gloo", "nccl"), "parallel.backend")
    for name, v, required in (("model.factory", cfg.model.factory, True), ("data.factory", cfg.data.factory, True),
                              ("train.loss", cfg.train.loss, False), ("data.collate", cfg.data.collate, False)):
        if (required or v is not None) and (not isinstance(v, str) or ":" not in v):
            raise ConfigError(f"{name}={v!r} is not an import path; write it as 'package.module:function'")
    lower_bounds = {  # name: (value, smallest valid value)
        "train.max_steps": (cfg.train.max_steps, 1),
        "train.log_every_steps": (cfg.train.log_every_steps, 1),
        "train.eval_batches": (cfg.train.eval_batches, 1),
        "launch.nnodes": (cfg.launch.nnodes, 1),
        "train.eval_every_steps": (cfg.train.eval_every_steps, 0),
        "optim.warmup_steps": (cfg.optim.warmup_steps, 0),
        "data.num_workers": (cfg.data.num_workers, 0),
        "launch.max_restarts": (cfg.launch.max_restarts, 0),
        "checkpoint.every_steps": (cfg.checkpoint.every_steps, 0),
    }
    for name, (bound, low) in lower_bounds.items():
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < low:
            rule = "a positive integer" if low == 1 else "an integer >= 0"
            raise ConfigError(f"{name}={bound!r} is not valid; it must be {rule}")
    if not (isinstance(cfg.optim.lr, int | float) and cfg.optim.lr > 0):
        raise ConfigError(f"optim.lr={cfg.optim.lr!r} is not valid; it must be a number > 0")
    if cfg.optim.grad_clip is not None and not cfg.optim.grad_clip > 0:
        raise ConfigError(f"optim.grad_clip={cfg.optim.grad_clip!r} is not valid; use a number > 0 or null to disable")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio!r} is not valid; it must be in [0, 1]")
    if cfg.optim.base_batch_size is not None and cfg.optim.base_batch_size < 1:
        raise ConfigError(f"optim.base_batch_size={cfg.optim.base_batch_size!r} is not valid; use a positive integer")
    validate_parallel(cfg)
    if cfg.checkpoint.keep_last is not None and (
        not isinstance(cfg.checkpoint.keep_last, int) or isinstance(cfg.checkpoint.keep_last, bool) or cfg.checkpoint.keep_last < 1
    ):
        raise ConfigError(f"checkpoint.keep_last={cfg.checkpoint.keep_last!r} is not valid; use a positive integer or null to keep all")
    if cfg.parallel.bucket_cap_mb <= 0:
        raise ConfigError(f"parallel.bucket_cap_mb={cfg.parallel.bucket_cap_mb!r} is not valid; it must be > 0")
    validate_diagnostics(cfg.diagnostics, pg_timeout_s=cfg.parallel.timeout_s)
    if cfg.diagnostics.check_collectives and strategy_mode(cfg.parallel).wrapper == "ddp":
        raise ConfigError(
            f"diagnostics.check_collectives=true cannot be used with parallel.strategy={cfg.parallel.strategy!r}: "
            "DDP's constructor crashes (segmentation fault) under TORCH_DISTRIBUTED_DEBUG=DETAIL in torch 2.13; "
            "debug collectives with parallel.strategy=fsdp, zero2 or single"
        )


def validate_parallel(cfg: Config) -> None:
    """The parallel section's choices that need no world size (the layout is checked in `resolve`)."""
    p = cfg.parallel
    mode = strategy_mode(p)
    _choice(p.activation_checkpointing, ACTIVATION_CHECKPOINTING, "parallel.activation_checkpointing")
    if p.cpu_offload and mode.wrapper != "fsdp":
        raise ConfigError(f"parallel.cpu_offload=true needs parallel.strategy=fsdp or zero2 (got {p.strategy!r})")
    for name in ("fsdp_param_dtype", "fsdp_reduce_dtype"):
        value = getattr(p, name)
        if value is None:
            continue
        _choice(value, MP_DTYPES, f"parallel.{name}")
        if mode.wrapper != "fsdp":
            raise ConfigError(f"parallel.{name}={value!r} applies to FSDP2 only; it needs parallel.strategy=zero2 "
                              f"or fsdp (got {p.strategy!r})")


def validate_diagnostics(d: DiagnosticsConfig, *, pg_timeout_s: float) -> None:
    """Ranges of the diagnostics section; the watchdog must fire before the process-group timeout."""
    _choice(d.nonfinite, NONFINITE_POLICIES, "diagnostics.nonfinite")
    for name in ("straggler_every_steps", "drift_every_steps", "memory_every_steps"):
        v = getattr(d, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"diagnostics.{name}={v!r} is not valid; it must be an integer >= 0 (0 turns it off)")
    for name, low in (("max_consecutive_skips", 1), ("memory_window", 3)):
        v = getattr(d, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ConfigError(f"diagnostics.{name}={v!r} is not valid; it must be an integer >= {low}")
    for name in ("hang_timeout_s", "straggler_margin", "memory_leak_mb"):
        v, off_ok = getattr(d, name), name == "hang_timeout_s"
        if v is None and off_ok:
            continue
        if not isinstance(v, int | float) or isinstance(v, bool) or v < 0 or (v == 0 and not off_ok):
            rule = "a number >= 0 (0 turns the watchdog off)" if off_ok else "a number > 0"
            raise ConfigError(f"diagnostics.{name}={v!r} is not valid; it must be {rule}")
    if d.hang_timeout_s and d.hang_timeout_s >= pg_timeout_s:
        raise ConfigError(
            f"diagnostics.hang_timeout_s={d.hang_timeout_s:g} must be below parallel.timeout_s={pg_timeout_s:g}, "
            "or the collective timeout fires first without naming the hung rank; lower it or raise parallel.timeout_s"
        )


def hang_timeout(d: DiagnosticsConfig, *, pg_timeout_s: float) -> float:
    """The watchdog's timeout: as set, or min(300 s, half the process-group timeout); 0 means off."""
    return d.hang_timeout_s if d.hang_timeout_s is not None else min(300.0, pg_timeout_s / 2)
