"""`parallel.grad_compression`: where each compression applies, checked before any process starts.

| value    | under DDP (ddp, zero1)                  | under FSDP2 (zero2, fsdp, HSDP)       |
|----------|-----------------------------------------|---------------------------------------|
| none     | no hook (DDP's own fp32 all-reduce)     | the reduce dtype of fsdp_reduce_dtype |
| fp16     | torch's fp16_compress_hook              | MixedPrecisionPolicy reduce_dtype fp16 |
| bf16     | torch's bf16_compress_hook (NCCL only)  | MixedPrecisionPolicy reduce_dtype bf16 |
| powersgd | torch's powerSGD_hook, error feedback   | refused (FSDP2 has no DDP hook)       |
| onebit   | dptrain's sign hook, error feedback     | refused (FSDP2 has no DDP hook)       |

`optim.name=onebit_adam` (1-bit Adam) compresses the momentum instead, in its optimizer step, with
a DDP hook of its own: plain DDP only (`validate_onebit_adam`).

The hooks themselves live in `dptrain/parallel/comm_hooks.py`; this module imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dptrain.config.fields import GRAD_COMPRESSIONS, ConfigError, OptimConfig, ParallelConfig
from dptrain.config.layout import DataParallelMode, strategy_mode

if TYPE_CHECKING:
    from dptrain.config.dims import ParallelDims

CAST = ("fp16", "bf16")
"""Compressions that are a dtype cast of the reduction (a DDP hook, or FSDP2's reduce dtype)."""
HOOK_ONLY = ("powersgd", "onebit")
"""Compressions that exist only as DDP communication hooks (with per-rank error-feedback state)."""


def validate_compression_choice(p: ParallelConfig) -> None:
    """What needs no world size: a known name, and combinations that can never work."""
    if p.grad_compression not in GRAD_COMPRESSIONS:
        raise ConfigError(f"parallel.grad_compression={p.grad_compression!r} is not valid; "
                          f"choose one of: {', '.join(GRAD_COMPRESSIONS)}")
    c = p.grad_compression
    if c == "none":
        return
    mode = strategy_mode(p)
    if mode.wrapper not in ("ddp", "fsdp"):
        raise ConfigError(f"parallel.grad_compression={c!r} needs gradient communication between processes; "
                          f"parallel.strategy={p.strategy!r} has none to compress (use ddp, zero1, zero2 or fsdp)")
    if c in HOOK_ONLY and mode.wrapper == "fsdp":
        raise ConfigError(f"parallel.grad_compression={c!r} is a DDP communication hook and "
                          f"parallel.strategy={p.strategy!r} is FSDP2, whose reduce-scatter has no hook; use "
                          "strategy ddp or zero1, or fp16/bf16 (FSDP2's reduce dtype)")
    if c in HOOK_ONLY and p.sync_each_micro_step:
        raise ConfigError(
            f"parallel.grad_compression={c!r} cannot be combined with parallel.sync_each_micro_step=true: "
            "the hook would run on every micro-step and compress the already-reduced gradient of the "
            "earlier micro-steps again, with its error feedback and step counter advancing per "
            "micro-step; reduce once per step (sync_each_micro_step=false)"
        )
    if c in CAST and mode.wrapper == "fsdp" and p.fsdp_reduce_dtype not in (None, c):
        raise ConfigError(
            f"parallel.grad_compression={c!r} sets FSDP2's reduce dtype to {c}, but "
            f"parallel.fsdp_reduce_dtype={p.fsdp_reduce_dtype!r} asks for another; drop one of them"
        )


def validate_compression(p: ParallelConfig, *, mode: DataParallelMode, dims: ParallelDims, backend: str) -> None:
    """The checks that need the layout and the backend (called by `resolve`)."""
    validate_compression_choice(p)
    c = p.grad_compression
    if c == "none":
        return
    if dims.dp_size < 2:
        raise ConfigError(
            f"parallel.grad_compression={c!r} with a data-parallel world size of {dims.dp_size}: "
            "there is no gradient communication to compress, and a lossy compression would only "
            "change the optimizer; set parallel.grad_compression=none or use >= 2 data-parallel ranks"
        )
    if mode.wrapper == "ddp" and (dims.tp > 1 or dims.pp > 1):
        what = "tensor" if dims.tp > 1 else "pipeline"
        raise ConfigError(
            f"parallel.grad_compression={c!r} with {what} parallelism: data parallelism there is "
            "FSDP2's replicate, which has no DDP communication hook; use grad_compression=none, or "
            "strategy fsdp/zero2 with fp16/bf16 (the reduce dtype)"
        )
    if c in HOOK_ONLY and (dims.tp > 1 or dims.pp > 1):
        raise ConfigError(
            f"parallel.grad_compression={c!r} applies to plain DDP only; it is refused with tp={dims.tp}, pp={dims.pp}"
        )
    if c == "bf16" and backend != "nccl" and mode.wrapper == "ddp":
        raise ConfigError(
            "parallel.grad_compression='bf16' under DDP needs the nccl backend: torch's "
            f"bf16_compress_hook refuses any other (measured on {backend}: 'BF16 all reduce "
            "communication hook required CUDA 11+ and NCCL 2.10+'); use fp16 on gloo"
        )


def validate_onebit_adam(optim: OptimConfig, p: ParallelConfig, *, dims: ParallelDims | None = None) -> None:
    """optim.name=onebit_adam (or onebit_lamb, the same exchange) needs whole momenta on every rank and DDP's hook:
    strategy ddp (or a single process), no gradient compression of its own, no tp/pp (checked once `dims` is
    known)."""
    if optim.name not in ("onebit_adam", "onebit_lamb"):
        return
    what = "1-bit Adam" if optim.name == "onebit_adam" else "1-bit LAMB"
    if p.strategy not in ("ddp", "single"):
        raise ConfigError(
            f"optim.name={optim.name!r} with parallel.strategy={p.strategy!r}: {what} exchanges whole momenta "
            "and silences DDP's gradient all-reduce through its communication hook, so it needs "
            "parallel.strategy=ddp (or single); zero1/zero2/fsdp shard the optimizer state, dp has no hook"
        )
    if p.grad_compression != "none":
        raise ConfigError(
            f"optim.name={optim.name!r} with parallel.grad_compression={p.grad_compression!r}: {what} compresses "
            "the momentum itself (after its warm-up DDP sends no gradients); set parallel.grad_compression=none"
        )
    if dims is not None and (dims.tp > 1 or dims.pp > 1):
        raise ConfigError(
            f"optim.name={optim.name!r} with tp={dims.tp}, pp={dims.pp}: {what} runs on plain DDP only "
            "(data parallelism under tp/pp is FSDP2's replicate, which has no communication hook)"
        )


def fsdp_reduce_dtype(p: ParallelConfig) -> str | None:
    """FSDP2's reduce dtype: parallel.fsdp_reduce_dtype, or the fp16/bf16 of grad_compression."""
    if p.grad_compression in CAST and strategy_mode(p).wrapper == "fsdp":
        return p.grad_compression
    return p.fsdp_reduce_dtype
