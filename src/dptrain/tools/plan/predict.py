"""One layout's prediction from a config (memory and time per step), and its scaling from 1 rank.

The config is resolved exactly as `dptrain run` resolves it at that world size (batch arithmetic,
mesh degrees, validation), so what is predicted is what would run; the built-in LLaMA's exact
formulas (plan/llama.py, memory.py) and the α-β model (timing.py) do the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dptrain.config.context import cp_attention_of
from dptrain.config.fields import ConfigError
from dptrain.config.resolve import resolve
from dptrain.metrics.hardware import GpuSpec, gpu_spec, with_memory
from dptrain.tools.plan.calibrate import cpu_spec
from dptrain.tools.plan.memory import FRAMEWORK_OVERHEAD, STRATEGIES, Layout, layout_memory
from dptrain.tools.plan.timing import Link, step_time

if TYPE_CHECKING:  # the planner imports no torch at import time (`dptrain --help` stays fast)
    from dptrain.config.fields import Config
    from dptrain.config.resolve import Resolved
    from dptrain.models.llama import LlamaConfig

LLAMA = "dptrain.models.llama:build_llama"


def device_spec(gpu_type: str, *, ranks_per_host: int, gpu_memory: float | None = None) -> GpuSpec:
    """The table's GPU (`gpu_memory` GB instead of the table's size, when given), or (`cpu`) this machine's CPU
    measured for `ranks_per_host` ranks."""
    if gpu_type.lower() != "cpu":
        return with_memory(gpu_spec(gpu_type), gpu_memory)

    return cpu_spec(ranks_per_host=ranks_per_host)


def layout_from_config(cfg: Config, resolved: Resolved, *, seq: int, cpu: bool = False) -> Layout:
    """The `Layout` a resolved config runs (what plan/memory.py and plan/timing.py read)."""
    p, dims = cfg.parallel, resolved.dims
    optimizer = cfg.optim.name if cfg.optim.name != "sgd" or not cfg.optim.momentum else "sgd-momentum"
    # zero1 partitions over the data-parallel ranks; FSDP2 shards over dp_shard, and under cp over dp_shard x cp
    shard = resolved.dp_world_size if p.strategy == "zero1" else dims.dp_shard * dims.cp
    return Layout(strategy=p.strategy, dp_shard=shard, tp=dims.tp, pp=dims.pp,
                  micro_batch=resolved.micro_batch_size, seq=seq, precision=cfg.precision.dtype,
                  optimizer=optimizer, checkpointing=p.activation_checkpointing, cpu_offload=p.cpu_offload,
                  bucket_cap_mb=p.bucket_cap_mb, gradient_as_bucket_view=p.gradient_as_bucket_view,
                  pp_microbatches=p.pp_microbatches or dims.pp, pp_schedule=p.pp_schedule, pp_layers=p.pp_layers,
                  grad_dtype=p.grad_compression if p.grad_compression in ("fp16", "bf16") else None,
                  grad_compression=p.grad_compression, powersgd_rank=p.powersgd_rank,
                  param_dtype=p.fsdp_param_dtype, reduce_dtype=p.fsdp_reduce_dtype,
                  sequence_parallel=p.sequence_parallel, pp_stages_per_rank=p.pp_stages_per_rank,
                  overhead=0.0 if cpu else FRAMEWORK_OVERHEAD,
                  lora_rank=cfg.model.lora.rank if cfg.model.lora.enabled else 0,
                  lora_targets=cfg.model.lora.target_modules, cp=dims.cp, loss_parallel=p.loss_parallel,
                  cp_mask=not cpu,  # the CPU runs the K/V all-gather blockwise, without a mask (cp_attention.py)
                  cp_attention=cp_attention_of(cfg, tp=dims.tp, cp=dims.cp))  # ulysses or allgather, as the run


def resolve_for_plan(cfg: Config, *, gpus: int, gpu_type: str) -> Resolved:
    """`cfg` resolved as `dptrain run` would on `gpus` ranks of `gpu_type`; ConfigError for a strategy
    the planner does not cover, or whatever dptrain itself refuses."""

    if cfg.parallel.strategy not in STRATEGIES:
        raise ConfigError(
            f"dptrain plan covers parallel.strategy {', '.join(STRATEGIES)}, not {cfg.parallel.strategy!r}"
        )
    return resolve(cfg, world_size=gpus, cuda_available=gpu_type.lower() != "cpu")


@dataclass(frozen=True)
class Prediction:
    model: LlamaConfig
    resolved: Resolved
    layout: Layout
    spec: GpuSpec
    memory: dict[str, float]
    time: dict[str, float]


def predict(
    cfg: Config, *, gpus: int, nodes: int, gpu_type: str, interconnect: str, comm: Link | None,
    efficiency: float | None, gpu_memory: float | None = None
) -> Prediction:
    """Memory and time per step of `cfg` on `gpus` ranks over `nodes` (ConfigError if dptrain refuses it)."""
    # lazy: torch: the built-in LLaMA's config class (models/llama.py imports torch)
    from dptrain.models.llama import LlamaConfig

    if cfg.model.factory != LLAMA:
        raise ConfigError(
            f"dptrain plan has exact formulas for the built-in LLaMA ({LLAMA}) only, not "
            f"model.factory={cfg.model.factory!r}; give --params N for its model states"
        )
    resolved = resolve_for_plan(cfg, gpus=gpus, gpu_type=gpu_type)
    spec = device_spec(gpu_type, ranks_per_host=gpus // nodes, gpu_memory=gpu_memory)
    model = LlamaConfig(**cfg.model.kwargs)
    lay = layout_from_config(
        cfg, resolved, seq=int(cfg.data.kwargs.get("seq_len", model.max_seq_len)), cpu=spec.key == "cpu"
    )
    t = step_time(model, lay, spec, gpus=gpus, nodes=nodes, interconnect=interconnect,
                  accum=resolved.grad_accum_steps, efficiency=efficiency, comm=comm if gpus > 1 else None)
    return Prediction(model, resolved, lay, spec, layout_memory(model, lay), t)


def scaling_points(gpus: int, nodes: int) -> list[tuple[int, int]]:
    """(ranks, nodes) from 1 to `gpus`: powers of two within a node, then whole nodes."""
    per_node = gpus // nodes
    points, n = [], 1
    while n < per_node:
        points.append((n, 1))
        n *= 2
    k = 1
    while k < nodes:
        points.append((k * per_node, k))
        k *= 2
    return points + [(gpus, nodes)]


def scaling(
    cfg: Config, *, gpus: int, nodes: int, gpu_type: str, interconnect: str, comm: Link | None,
    efficiency: float | None, gpu_memory: float | None = None
) -> list[dict[str, Any]]:
    """One row per point of `scaling_points`: the prediction, or why dptrain refuses that world size.
    Efficiency is tokens/s per rank over tokens/s at 1 rank (the first point)."""

    rows: list[dict[str, Any]] = []
    base = None
    for n, k in scaling_points(gpus, nodes):
        row: dict[str, Any] = {"ranks": n, "nodes": k}
        try:
            pr = predict(
                cfg, gpus=n, nodes=k, gpu_type=gpu_type, interconnect=interconnect, comm=comm, efficiency=efficiency,
                gpu_memory=gpu_memory,
            )
        except ConfigError as e:
            rows.append({**row, "refused": str(e)})
            continue
        per_rank = pr.time["tokens_per_s"] / n
        base = base or per_rank
        rows.append(
            {
                **row,
                "global_batch": pr.resolved.global_batch_size,
                "micro_accum": f"{pr.resolved.micro_batch_size} x {pr.resolved.grad_accum_steps}",
                **pr.time,
                "memory_gb": pr.memory["total"] / 1e9,
                "efficiency": per_rank / base,
            }
        )
    return rows
