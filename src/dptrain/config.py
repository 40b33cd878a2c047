"""The configuration tree: frozen dataclasses, one docstring per field, validated before launch.

A run is described by a `Config` whose sections are plain frozen dataclasses. Loading
(YAML, DeepSpeed JSON, `section.field=value` overrides) lives in `overrides.py`; this
module only defines the fields and the arithmetic that derives the values a user may
leave out (batch sizes, the scaled learning rate, the world size).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config value is invalid; the message names the value and what would be valid."""


STRATEGIES = ("single", "dp", "ddp", "zero1", "zero2", "fsdp")
DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adamw", "adam")
LR_SCALINGS = ("none", "linear", "sqrt")
SCHEDULES = ("cosine", "constant", "linear")
NONFINITE_POLICIES = ("skip", "error", "off")


def _llama_defaults() -> dict[str, Any]:
    return {"dim": 128, "n_layers": 4, "n_heads": 4, "max_seq_len": 128}


def _corpus_defaults() -> dict[str, Any]:
    return {"seq_len": 128}


@dataclass(frozen=True)
class ModelConfig:
    factory: str = "dptrain.models.llama:build_llama"
    """Import path `pkg.mod:fn` of a function returning an `nn.Module` (called with `kwargs`)."""
    kwargs: dict[str, Any] = field(default_factory=_llama_defaults)
    """Keyword arguments passed to the model factory."""


@dataclass(frozen=True)
class DataConfig:
    factory: str = "dptrain.data.corpus:build_stdlib_lm"
    """Import path of a function returning a map-style Dataset, or a (train, val) pair."""
    kwargs: dict[str, Any] = field(default_factory=_corpus_defaults)
    """Keyword arguments passed to the data factory."""
    collate: str | None = None
    """Optional import path of a collate function (default: torch's default_collate)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 loads in the training process)."""
    pin_memory: bool = True
    """Pin host memory for faster host-to-GPU copies (ignored without CUDA)."""
    shuffle: bool = True
    """Shuffle the global sample order; it is reshuffled every epoch from `train.seed`."""


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 500
    """Number of optimizer steps to train."""
    global_batch_size: int | None = 32
    """Samples per optimizer step over all ranks = micro_batch_size * grad_accum_steps * dp world size."""
    micro_batch_size: int | None = 8
    """Samples per forward/backward on one rank."""
    grad_accum_steps: int | None = None
    """Micro-steps per optimizer step; left out, it is derived from the other two."""
    seed: int = 1234
    """Seed for model initialisation and the data order (the same on every rank)."""
    log_every_steps: int = 10
    """Log metrics (and read the loss off the device) every N steps."""
    eval_every_steps: int = 100
    """Evaluate on the validation split every N steps (0: only at the start and the end)."""
    eval_batches: int = 8
    """Micro-batches per rank in one evaluation."""
    loss: str | None = None
    """Import path `pkg.mod:fn(model, batch) -> loss`; by default the model's forward returns the loss."""


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"
    """Optimizer: sgd, adamw or adam."""
    lr: float = 3e-3
    """Learning rate at `base_batch_size` (scaled by `lr_scaling` to the global batch)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW) or L2 (SGD); not applied to biases and norm weights."""
    momentum: float = 0.0
    """SGD momentum."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    lr_scaling: str = "none"
    """How the lr follows the global batch: none, linear (lr * G / base) or sqrt (lr * sqrt(G / base))."""
    base_batch_size: int | None = None
    """The global batch size `lr` was tuned for (default: the global batch, i.e. no scaling)."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to the peak learning rate."""
    schedule: str = "cosine"
    """After warmup: cosine (to min_lr_ratio * lr), linear (likewise) or constant."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak for the cosine and linear schedules."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm (over all shards) to this value; null disables clipping."""


@dataclass(frozen=True)
class ParallelConfig:
    strategy: str = "ddp"
    """single, dp (legacy nn.DataParallel, GPUs only), ddp, zero1, zero2 or fsdp."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB."""
    sync_each_micro_step: bool = False
    """Reduce gradients on every micro-step instead of only the last (lower memory under FSDP, more traffic)."""
    cpu_offload: bool = False
    """fsdp only: keep parameters, gradients and optimizer state on the CPU (FSDP2 CPUOffloadPolicy)."""
    device: str = "auto"
    """cpu, cuda or auto (cuda when available)."""
    backend: str = "auto"
    """Process-group backend: nccl, gloo or auto (nccl on cuda, gloo on cpu)."""
    timeout_s: float = 600.0
    """Collective and init timeout in seconds."""


@dataclass(frozen=True)
class PrecisionConfig:
    dtype: str = "fp32"
    """fp32, bf16 (autocast) or fp16 (autocast with dynamic loss scaling)."""
    init_scale: float = 2.0**16
    """fp16: initial loss scale."""
    growth_interval: int = 2000
    """fp16: steps without overflow before the loss scale doubles."""


@dataclass(frozen=True)
class LaunchConfig:
    nproc_per_node: int | str = "auto"
    """Worker processes per node: a number, or auto (every local GPU, else 2 on the CPU)."""
    nnodes: int = 1
    """Number of nodes."""
    node_rank: int = 0
    """This node's rank (multi-node static rendezvous)."""
    rdzv_endpoint: str | None = None
    """host:port of the rendezvous for multi-node runs (default: standalone on this node)."""
    rdzv_id: str = "dptrain"
    """Job id shared by all nodes of one run."""
    max_restarts: int = 0
    """Elastic restarts torchrun grants the worker group."""


@dataclass(frozen=True)
class LogConfig:
    out_dir: str | None = None
    """Run directory (default: runs/<recipe>-<timestamp>)."""
    progress: bool = True
    """Show the live progress line on rank 0."""
    name: str = "default"
    """Recipe name used in the default run directory."""


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory (default: `checkpoints/` inside the run directory); one `step_NNNNNN/` folder per save."""
    every_steps: int = 0
    """Save every N optimizer steps (0: only at the end of the run and on preemption)."""
    keep_last: int | None = 3
    """Keep only the newest N committed checkpoints (older committed ones are deleted); null keeps all."""
    async_save: bool = False
    """Write checkpoint files in a background thread while training continues; committed only once complete."""


@dataclass(frozen=True)
class DiagnosticsConfig:
    hang_timeout_s: float | None = None
    """Seconds without progress before the watchdog writes every rank's stack, names the suspect rank(s) and ends the job (0: off; default: min(300, parallel.timeout_s / 2)). Must be below parallel.timeout_s."""
    check_collectives: bool = False
    """Check that every rank calls the same collective with the same shapes (TORCH_DISTRIBUTED_DEBUG=DETAIL; slow, for debugging; not with ddp/zero1, whose constructor crashes under it)."""
    preflight: bool = True
    """At start, check that all ranks agree on world size, config and model (parameter names, shapes, dtypes)."""
    straggler_every_steps: int = 50
    """Compare ranks' step-time split (data, compute, waiting for others) every N steps (0: off; adds one tiny barrier per step)."""
    straggler_margin: float = 0.25
    """A rank whose data + compute time exceeds the median of the other ranks by this fraction is named a straggler."""
    drift_every_steps: int = 100
    """Compare a checksum of every parameter across data-parallel replicas every N steps (0: off; skipped under zero2/fsdp)."""
    nonfinite: str = "off"
    """Non-finite loss or gradient norm: skip (all ranks skip the step), error (stop naming step and rank) or off (no per-step check)."""
    max_consecutive_skips: int = 5
    """nonfinite=skip: stop with an error after this many consecutive skipped steps."""
    memory_every_steps: int = 50
    """Sample host RSS (and CUDA allocated/reserved/peak) on every rank every N steps (0: off)."""
    memory_window: int = 10
    """Samples in the linear fit that detects steady memory growth."""
    memory_leak_mb: float = 256.0
    """Report a leak when the fitted growth over the window exceeds this many MiB (and the fit is steady, R^2 >= 0.9)."""


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (for `config show` and the README)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)  # type: ignore[union-attr]
    return docs


# ---------------------------------------------------------------------------------------
# Derived values
# ---------------------------------------------------------------------------------------


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
    """Return (global, micro, accum) with global = micro * accum * dp_world_size, deriving what is missing.

    Raises ConfigError naming the equation and valid alternatives when the numbers disagree.
    """
    g, m, a, w = train.global_batch_size, train.micro_batch_size, train.grad_accum_steps, dp_world_size
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
            raise ConfigError(
                f"train.global_batch_size={g} is not divisible by grad_accum_steps * dp world size = {a} * {w}; "
                f"{_alternatives(g, w)}"
            )
        m = g // (a * w)
    elif a is None:
        if g % (m * w):
            raise ConfigError(
                f"train.global_batch_size={g} is not divisible by micro_batch_size * dp world size = {m} * {w}; "
                f"{_alternatives(g, w)}"
            )
        a = g // (m * w)
    if g != m * a * w:
        raise ConfigError(
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
    if cfg.parallel.strategy == "dp" and device != "cuda":
        raise ConfigError(
            "parallel.strategy='dp' (nn.DataParallel) needs CUDA GPUs and none is available; "
            "use parallel.strategy=ddp, which also runs on the CPU"
        )
    if cfg.parallel.strategy in ("single", "dp") and world_size != 1:
        raise ConfigError(
            f"parallel.strategy={cfg.parallel.strategy!r} runs in one process but the world size is {world_size}; "
            "use launch.nproc_per_node=1 (--nproc-per-node 1) or a multi-process strategy (ddp, zero1, zero2, fsdp)"
        )
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ConfigError("parallel.backend='nccl' needs CUDA; use gloo (or auto) on the CPU")
    dp = world_size  # pure data parallelism: every rank is a data-parallel replica
    g, m, a = resolve_batch(cfg.train, dp_world_size=dp)
    lr, rule = scaled_lr(cfg.optim, global_batch_size=g)
    return Resolved(world_size, dp, g, m, a, lr, rule, device, backend)


def validate(cfg: Config) -> None:
    """Checks that need no world size: choices, ranges, import-path shape."""
    _choice(cfg.parallel.strategy, STRATEGIES, "parallel.strategy")
    _choice(cfg.precision.dtype, DTYPES, "precision.dtype")
    _choice(cfg.optim.name, OPTIMIZERS, "optim.name")
    _choice(cfg.optim.lr_scaling, LR_SCALINGS, "optim.lr_scaling")
    _choice(cfg.optim.schedule, SCHEDULES, "optim.schedule")
    _choice(cfg.parallel.device, ("auto", "cpu", "cuda"), "parallel.device")
    _choice(cfg.parallel.backend, ("auto", "gloo", "nccl"), "parallel.backend")
    for name, v in (("model.factory", cfg.model.factory), ("data.factory", cfg.data.factory)):
        if not isinstance(v, str) or ":" not in v:
            raise ConfigError(f"{name}={v!r} is not an import path; write it as 'package.module:function'")
    for name, v in (("train.loss", cfg.train.loss), ("data.collate", cfg.data.collate)):
        if v is not None and (not isinstance(v, str) or ":" not in v):
            raise ConfigError(f"{name}={v!r} is not an import path; write it as 'package.module:function'")
    positive = {
        "train.max_steps": cfg.train.max_steps,
        "train.log_every_steps": cfg.train.log_every_steps,
        "train.eval_batches": cfg.train.eval_batches,
        "launch.nnodes": cfg.launch.nnodes,
    }
    for name, v in positive.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name}={v!r} is not valid; it must be a positive integer")
    nonneg = {
        "train.eval_every_steps": cfg.train.eval_every_steps,
        "optim.warmup_steps": cfg.optim.warmup_steps,
        "data.num_workers": cfg.data.num_workers,
        "launch.max_restarts": cfg.launch.max_restarts,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
    }
    for name, v in nonneg.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"{name}={v!r} is not valid; it must be an integer >= 0")
    if not (isinstance(cfg.optim.lr, int | float) and cfg.optim.lr > 0):
        raise ConfigError(f"optim.lr={cfg.optim.lr!r} is not valid; it must be a number > 0")
    if cfg.optim.grad_clip is not None and not cfg.optim.grad_clip > 0:
        raise ConfigError(f"optim.grad_clip={cfg.optim.grad_clip!r} is not valid; use a number > 0 or null to disable")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio!r} is not valid; it must be in [0, 1]")
    if cfg.optim.base_batch_size is not None and cfg.optim.base_batch_size < 1:
        raise ConfigError(f"optim.base_batch_size={cfg.optim.base_batch_size!r} is not valid; use a positive integer")
    if cfg.parallel.cpu_offload and cfg.parallel.strategy != "fsdp":
        raise ConfigError(
            f"parallel.cpu_offload=true needs parallel.strategy=fsdp (got {cfg.parallel.strategy!r})"
        )
    if cfg.checkpoint.keep_last is not None and (
        not isinstance(cfg.checkpoint.keep_last, int) or isinstance(cfg.checkpoint.keep_last, bool) or cfg.checkpoint.keep_last < 1
    ):
        raise ConfigError(f"checkpoint.keep_last={cfg.checkpoint.keep_last!r} is not valid; use a positive integer or null to keep all")
    if cfg.parallel.bucket_cap_mb <= 0:
        raise ConfigError(f"parallel.bucket_cap_mb={cfg.parallel.bucket_cap_mb!r} is not valid; it must be > 0")
    validate_diagnostics(cfg.diagnostics, pg_timeout_s=cfg.parallel.timeout_s)
    if cfg.diagnostics.check_collectives and cfg.parallel.strategy in ("ddp", "zero1"):
        raise ConfigError(
            f"diagnostics.check_collectives=true cannot be used with parallel.strategy={cfg.parallel.strategy!r}: "
            "DDP's constructor crashes (segmentation fault) under TORCH_DISTRIBUTED_DEBUG=DETAIL in torch 2.13; "
            "debug collectives with parallel.strategy=fsdp, zero2 or single"
        )


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


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict (tuples as lists) suitable for YAML/JSON."""
    d = dataclasses.asdict(cfg)

    def fix(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, tuple | list):
            return [fix(v) for v in x]
        return x

    return fix(d)


def default_out_dir(cfg: Config) -> str:
    """runs/<recipe>-<timestamp> unless log.out_dir is set."""
    import time

    if cfg.log.out_dir:
        return cfg.log.out_dir
    return os.path.join("runs", f"{cfg.log.name}-{time.strftime('%Y%m%d-%H%M%S')}")
