"""Validation and derived values: what a Config means for a given world size.

Everything here runs before any process group starts, so bad input fails in the launcher with
exit code 2 and a message naming the value and what would be valid.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dptrain.config.compression import validate_compression, validate_compression_choice, validate_onebit_adam
from dptrain.config.context import validate_context_parallel
from dptrain.config.ds_fields import validate_ds_fields
from dptrain.config.fields import (
    ACTIVATION_CHECKPOINTING,
    DEFAULT_BATCH,
    DTYPES,
    LR_SCALINGS,
    MP_DTYPES,
    NONFINITE_POLICIES,
    OPTIMIZERS,
    RANK_SPLITS,
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
from dptrain.config.hosting import validate_hosting
from dptrain.config.layout import DataParallelMode, resolve_layout, strategy_mode
from dptrain.config.lora import validate_lora
from dptrain.config.nodes import max_nodes, node_range, parse_rdzv_conf
from dptrain.config.pipeline import describe_pipeline, settle_pipeline, validate_pipeline
from dptrain.config.ranges import RANGES, Range, check_ranges
from dptrain.config.speed_checks import validate_compile, validate_fsdp_tuning, validate_speed

if TYPE_CHECKING:
    from dptrain.config.dims import ParallelDims

# ---------------------------------------------------------------------------------------
# Derived values
# ---------------------------------------------------------------------------------------


class BatchSizeError(ConfigError):
    """The batch sizes do not fit together at this data-parallel world size (each value is valid on its
    own): resuming at another world size re-derives gradient accumulation instead."""


def _choice(value: str, valid: tuple[str, ...], name: str) -> None:
    if value not in valid:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of: {', '.join(valid)}")


def _torch_build_has_gpu() -> bool:
    """False when the installed torch is a CPU-only build (its version.py says cuda = hip = None),
    read without importing torch (seconds); True when it may have GPU support."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        return not all(re.search(rf"^{name}\b.*=\s*None\s*$", text, re.M) for name in ("cuda", "hip"))
    return True


def cuda_device_count() -> int:
    """torch.cuda.device_count() when CUDA is usable, else 0; a CPU build of torch is not imported."""
    if not _torch_build_has_gpu():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_world_size(launch: LaunchConfig, *, cuda_count: int | None = None) -> int:
    """Worker processes per node, resolving `auto` to the local GPU count (2 on a CPU-only machine)."""
    if launch.nproc_per_node == "auto":
        if cuda_count is None:
            cuda_count = cuda_device_count()
        return cuda_count if cuda_count > 0 else 2
    try:
        n = int(launch.nproc_per_node)
    except (TypeError, ValueError):
        raise ConfigError(
            f"launch.nproc_per_node={launch.nproc_per_node!r} is not valid; use a positive integer or 'auto'"
        ) from None
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
        return (f"the global batch must be a multiple of the dp world size {w}; "
                f"e.g. train.global_batch_size={' or '.join(map(str, near))}")
    per_rank = g // w
    pairs = [
        f"micro_batch_size={d} grad_accum_steps={per_rank // d}" for d in range(1, per_rank + 1) if per_rank % d == 0
    ]
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
    pipeline: str | None = None
    """pp > 1: stages, blocks per stage, schedule and how each micro-batch is split (config/pipeline.py)."""


def resolve(cfg: Config, *, world_size: int | None = None, cuda_available: bool | None = None) -> Resolved:
    """Validate `cfg` and derive everything that depends on the world size. Raises ConfigError."""
    validate(cfg)
    if cuda_available is None:
        cuda_available = cuda_device_count() > 0
    if world_size is None:
        world_size = local_world_size(cfg.launch, cuda_count=None if cuda_available else 0) * max_nodes(cfg.launch)
    device = cfg.parallel.device
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    if device == "cuda" and not cuda_available:
        raise ConfigError("parallel.device='cuda' but no CUDA device is available; use parallel.device=cpu or auto")
    if cfg.parallel.nvme_offload_dir is not None and device == "cuda" and not cfg.parallel.cpu_offload:
        raise ConfigError(
            f"parallel.nvme_offload_dir={cfg.parallel.nvme_offload_dir!r} on CUDA needs parallel.cpu_offload=true: the "
            "optimizer state is mapped from files in host memory, so the optimizer must step on the host "
            "(DeepSpeed's NVMe offload steps on the CPU too)"
        )
    mode = strategy_mode(cfg.parallel)
    if mode.wrapper == "dataparallel" and device != "cuda":
        raise ConfigError(
            f"parallel.strategy={cfg.parallel.strategy!r} (nn.DataParallel) needs CUDA GPUs and none is available; "
            "use parallel.strategy=ddp, which also runs on the CPU"
        )
    dims, mode = resolve_layout(cfg.parallel, world_size=world_size)
    validate_context_parallel(cfg, dims=dims, mode=mode)  # cp > 1: what it composes with (config/context.py)
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ConfigError("parallel.backend='nccl' needs CUDA; use gloo (or auto) on the CPU")
    validate_compression(cfg.parallel, mode=mode, dims=dims, backend=backend)
    validate_onebit_adam(cfg.optim, cfg.parallel, dims=dims)
    validate_compile(cfg.train, device=device, pp=dims.pp)  # inductor on the CPU needs a C++ compiler
    validate_fsdp_tuning(cfg.parallel, wrapper=mode.wrapper, dp_shard=dims.dp_shard)  # an int reshard size
    g, m, a = resolve_batch(cfg.train, dp_world_size=dims.dp_size)  # tp/pp ranks share their dp rank's batch
    parallel = settle_pipeline(cfg.parallel, micro_batch_size=m, pp=dims.pp)  # DeepSpeed's rows per micro-batch
    validate_pipeline(
        parallel=parallel,
        model=cfg.model,
        pp=dims.pp,
        micro_batch_size=m,
        grad_accum_steps=a,
        dp_size=dims.dp_size,
        loss=cfg.train.loss,
    )
    lr, rule = scaled_lr(cfg.optim, global_batch_size=g)
    pipe = describe_pipeline(parallel=parallel, model=cfg.model, pp=dims.pp, micro_batch_size=m)
    return Resolved(world_size, dims.dp_size, g, m, a, lr, rule, device, backend, dims, mode, pipe)


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


def validate(cfg: Config) -> None:
    """Checks that need no world size: choices, ranges, import-path shape, endpoints."""
    strategy_mode(cfg.parallel)  # a known strategy name
    _choice(cfg.precision.dtype, DTYPES, "precision.dtype")
    _choice(cfg.optim.name, OPTIMIZERS, "optim.name")
    if cfg.optim.min_coeff > cfg.optim.max_coeff:
        raise ConfigError(f"optim.min_coeff={cfg.optim.min_coeff!r} is above optim.max_coeff={cfg.optim.max_coeff!r}: "
                          "LAMB clamps its trust ratio to [min_coeff, max_coeff]")
    _choice(cfg.optim.lr_scaling, LR_SCALINGS, "optim.lr_scaling")
    _choice(cfg.optim.schedule, SCHEDULES, "optim.schedule")
    _choice(cfg.optim.warmup_type, WARMUP_TYPES, "optim.warmup_type")
    _choice(cfg.optim.schedule_convention, SCHEDULE_CONVENTIONS, "optim.schedule_convention")
    validate_ds_fields(cfg)  # loss scaler, DeepSpeed's OneCycle/LRRangeTest parameters
    _choice(cfg.parallel.device, ("auto", "cpu", "cuda"), "parallel.device")
    _choice(cfg.data.rank_split, RANK_SPLITS, "data.rank_split")
    if cfg.data.rank_split != "contiguous" and cfg.data.factory == "dptrain.data.finetune:build_finetune":
        raise ConfigError(f"data.rank_split={cfg.data.rank_split!r} applies to fixed-size global batches; fine-tuning "
                          "rows are batched under a token budget (data.source, data.finetune): leave it contiguous")
    _choice(cfg.parallel.backend, ("auto", "gloo", "nccl"), "parallel.backend")
    for name, v, required in (
        ("model.factory", cfg.model.factory, True),
        ("data.factory", cfg.data.factory, True),
        ("train.loss", cfg.train.loss, False),
        ("data.collate", cfg.data.collate, False),
        ("parallel.tp_plan", cfg.parallel.tp_plan, False),
    ):
        if (required or v is not None) and (not isinstance(v, str) or ":" not in v):
            raise ConfigError(f"{name}={v!r} is not an import path; write it as 'package.module:function'")
    for section in RANGES:
        if section != "diagnostics":
            check_ranges(section, functools.reduce(getattr, section.split("."), cfg))  # "model.lora": a sub-section
    validate_lora(cfg)
    beta = Range(float, 0, 1, high_open=True)
    for i, b in enumerate(cfg.optim.betas):
        if not beta.accepts(b):
            raise ConfigError(
                f"optim.betas={list(cfg.optim.betas)!r} is not valid; betas[{i}]={b!r} must be {beta.describe()}"
            )
    validate_hosting(cfg)  # optim.factory, scheduler, eval_fn, collate_kwargs (config/hosting.py)
    validate_launch(cfg.launch)
    _check_seq_len(cfg)
    validate_parallel(cfg)
    validate_diagnostics(cfg.diagnostics, pg_timeout_s=cfg.parallel.timeout_s)
    validate_speed(cfg, wrapper=strategy_mode(cfg.parallel).wrapper)  # config/speed.py
    if cfg.diagnostics.check_collectives and strategy_mode(cfg.parallel).wrapper == "ddp":
        raise ConfigError(
            f"diagnostics.check_collectives=true cannot be used with parallel.strategy={cfg.parallel.strategy!r}: "
            "DDP's constructor crashes (segmentation fault) under TORCH_DISTRIBUTED_DEBUG=DETAIL in torch 2.13; "
            "debug collectives with parallel.strategy=fsdp, zero2 or single"
        )


def snapshot_every(cfg: Config, *, max_restarts: int) -> int:
    """checkpoint.snapshot_every_steps as it applies (null: every step when the run can restart; the run itself then
    widens the interval when a snapshot costs more than its time budget, checkpoint/snapshots/pace.py)."""
    n = cfg.checkpoint.snapshot_every_steps
    if n is not None:
        return n
    return 1 if max_restarts > 0 else 0


def validate_parallel(cfg: Config) -> None:
    """The parallel section's choices that need no world size (the layout is checked in `resolve`)."""
    p = cfg.parallel
    mode = strategy_mode(p)
    _choice(p.activation_checkpointing, ACTIVATION_CHECKPOINTING, "parallel.activation_checkpointing")
    validate_compression_choice(p)
    validate_onebit_adam(cfg.optim, p)
    if p.cpu_offload and mode.wrapper != "fsdp":
        raise ConfigError(f"parallel.cpu_offload=true needs parallel.strategy=fsdp or zero2 (got {p.strategy!r})")
    for name in ("fsdp_param_dtype", "fsdp_reduce_dtype"):
        value = getattr(p, name)
        if value is None:
            continue
        _choice(value, MP_DTYPES, f"parallel.{name}")
        if mode.wrapper != "fsdp":
            raise ConfigError(
                f"parallel.{name}={value!r} applies to FSDP2 only; it needs parallel.strategy=zero2 "
                f"or fsdp (got {p.strategy!r})"
            )


def validate_launch(launch: LaunchConfig) -> None:
    """nnodes a count or MIN:MAX; node_rank below it; a multi-node run names a well-formed rendezvous endpoint."""
    nodes = node_range(launch.nnodes)[1]
    parse_rdzv_conf(launch.rdzv_conf)
    if launch.node_rank >= nodes:
        raise ConfigError(
            f"launch.node_rank={launch.node_rank} is not valid for launch.nnodes={launch.nnodes!r}; "
            f"it must be in [0, {nodes - 1}]"
        )
    if launch.rdzv_endpoint is not None:
        parse_endpoint(launch.rdzv_endpoint)
    elif nodes > 1:
        raise ConfigError(
            f"launch.nnodes={launch.nnodes!r} needs launch.rdzv_endpoint=host:port (the node running rank 0; "
            "the same value on every node)"
        )


_ENDPOINT = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)):(?P<port>[0-9]+)$"
)


def parse_endpoint(text: str) -> tuple[str, int]:
    """`host:port` or `[ipv6]:port` -> (host, port); ConfigError naming the value otherwise."""
    m = _ENDPOINT.match(text)
    port = int(m["port"]) if m else 0
    if not m or not 1 <= port <= 65535:
        raise ConfigError(
            f"launch.rdzv_endpoint={text!r} is not valid; write host:port with a port in 1..65535 "
            "(an IPv6 address in brackets: [fd00::1]:29500)"
        )
    return m["v6"] or m["host"], port


_BUILTIN_LM = ("dptrain.models.llama:build_llama", "dptrain.data.corpus:build_stdlib_lm")
_BUILTIN_DATA = ("dptrain.data.corpus:build_stdlib_lm", "dptrain.data.packed:build_packed")


def _check_seq_len(cfg: Config) -> None:
    """The built-in LM on the built-in corpus or a prepared one: a sample cannot be longer than the model's context."""
    if cfg.model.factory != _BUILTIN_LM[0] or cfg.data.factory not in _BUILTIN_DATA:
        return
    seq, ctx = cfg.data.kwargs.get("seq_len"), cfg.model.kwargs.get("max_seq_len")
    if isinstance(seq, int) and isinstance(ctx, int) and seq > ctx:
        raise ConfigError(
            f"data.kwargs.seq_len={seq} is longer than the model's context model.kwargs.max_seq_len={ctx}; "
            f"lower seq_len to at most {ctx} or raise max_seq_len"
        )


def validate_diagnostics(d: DiagnosticsConfig, *, pg_timeout_s: float) -> None:
    """Ranges of the diagnostics section; the watchdog must fire before the process-group timeout."""
    _choice(d.nonfinite, NONFINITE_POLICIES, "diagnostics.nonfinite")
    check_ranges("diagnostics", d)
    if d.hang_timeout_s and d.hang_timeout_s >= pg_timeout_s:
        raise ConfigError(
            f"diagnostics.hang_timeout_s={d.hang_timeout_s:g} must be below parallel.timeout_s={pg_timeout_s:g}, "
            "or the collective timeout fires first without naming the hung rank; lower it or raise parallel.timeout_s"
        )


def hang_timeout(d: DiagnosticsConfig, *, pg_timeout_s: float) -> float:
    """The watchdog's timeout: as set, or min(300 s, half the process-group timeout); 0 means off."""
    return d.hang_timeout_s if d.hang_timeout_s is not None else min(300.0, pg_timeout_s / 2)
