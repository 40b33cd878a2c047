"""Pipeline-parallel checks and arithmetic that need no torch (run before launch).

Batch arithmetic under pipeline parallelism:

    global batch = micro_batch_size x grad_accum_steps x dp world size        (as without PP)
    each micro-batch -> pp_microbatches pipeline micro-batches of micro_batch_size / pp_microbatches rows

An optimizer step runs `grad_accum_steps` pipeline schedules (one per micro-batch); each schedule
streams its `pp_microbatches` pieces through the `pp x pp_stages_per_rank` stages. The pp ranks of
one data-parallel coordinate see the same micro-batch (the first stage reads the tokens, the last
the labels), so the pipeline degree does not enter the global batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dptrain.config.fields import PP_SCHEDULES, ConfigError, ModelConfig, ParallelConfig

PIPELINE_MODELS = ("dptrain.models.llama:build_llama",)
"""Model factories pipeline parallelism can split (by layer ranges, without tracing)."""


def stage_layer_counts(n_layers: int, n_stages: int, pp_layers: tuple[int, ...] | None = None) -> list[int]:
    """Transformer blocks per stage: `pp_layers` as given, or an even split where the first
    `n_layers % n_stages` stages take one more. ConfigError naming every number otherwise."""
    if pp_layers is not None:
        counts = list(pp_layers)
        if len(counts) != n_stages or any(c < 1 for c in counts) or sum(counts) != n_layers:
            raise ConfigError(
                f"parallel.pp_layers={counts} does not fit: it needs pp x pp_stages_per_rank = {n_stages} entries, "
                f"each >= 1, summing to the model's n_layers={n_layers} (got {len(counts)} entries summing to "
                f"{sum(counts)})"
            )
        return counts
    if n_layers < n_stages:
        raise ConfigError(
            f"the model's n_layers={n_layers} cannot be split into pp x pp_stages_per_rank = {n_stages} pipeline "
            f"stages of at least one block each; lower parallel.pp or parallel.pp_stages_per_rank, or use more layers"
        )
    base, extra = divmod(n_layers, n_stages)
    return [base + (i < extra) for i in range(n_stages)]


def pipeline_microbatches(p: ParallelConfig) -> int:
    """The configured pipeline micro-batches per micro-batch (null: pp)."""
    return p.pp_microbatches if p.pp_microbatches is not None else p.pp


def settle_pipeline(p: ParallelConfig, *, micro_batch_size: int, pp: int) -> ParallelConfig:
    """`p` with `pp_microbatch_size` (rows per pipeline micro-batch, DeepSpeed's pipeline micro-batch) turned into
    `pp_microbatches` for the resolved micro-batch; under 1f1b with fewer pipeline micro-batches than stages the
    schedule becomes gpipe (DeepSpeed runs such pipelines; torch's 1F1B cannot, GPipe computes the same gradient).
    `p` itself otherwise."""
    rows = p.pp_microbatch_size
    if rows is None:
        return p
    if p.pp_microbatches is not None:
        raise ConfigError(
            f"parallel.pp_microbatch_size={rows} and parallel.pp_microbatches={p.pp_microbatches} both set the "
            "pipeline split; keep one"
        )
    if pp == 1:
        return p
    if micro_batch_size % rows:
        raise ConfigError(
            f"train.micro_batch_size={micro_batch_size} (the rank's share of the batch, one pipeline schedule) is not "
            f"divisible by parallel.pp_microbatch_size={rows} (DeepSpeed's train_micro_batch_size_per_gpu); make the "
            f"batch a multiple of {rows} x the data-parallel size"
        )
    m = micro_batch_size // rows
    schedule = "gpipe" if p.pp_schedule == "1f1b" and m < pp else p.pp_schedule
    return dataclasses.replace(p, pp_microbatches=m, pp_microbatch_size=None, pp_schedule=schedule)


def validate_pipeline(*, parallel: ParallelConfig, model: ModelConfig, pp: int, micro_batch_size: int,
                      grad_accum_steps: int, dp_size: int, loss: str | None = None) -> None:
    """Everything pipeline parallelism needs that can be known before launch; ConfigError naming
    every factor. `pp` is the resolved degree (the config's may be -1)."""
    p = parallel
    if p.pp_schedule not in PP_SCHEDULES:
        raise ConfigError(
            f"parallel.pp_schedule={p.pp_schedule!r} is not valid; choose one of: {', '.join(PP_SCHEDULES)}"
        )
    for name in ("pp_microbatches", "pp_stages_per_rank"):
        v = getattr(p, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"parallel.{name}={v!r} is not valid; it must be a positive integer")
    if pp == 1:
        return
    if p.pp_schedule == "interleaved_1f1b" and p.pp_stages_per_rank < 2:
        raise ConfigError(
            f"parallel.pp_schedule=interleaved_1f1b needs parallel.pp_stages_per_rank >= 2 (virtual stages per rank), "
            f"got {p.pp_stages_per_rank}; or use pp_schedule=1f1b or gpipe"
        )
    if p.pp_schedule != "interleaved_1f1b" and p.pp_stages_per_rank != 1:
        raise ConfigError(
            f"parallel.pp_stages_per_rank={p.pp_stages_per_rank} needs parallel.pp_schedule=interleaved_1f1b "
            f"(pp_schedule={p.pp_schedule} runs one stage per rank)"
        )
    if model.factory not in PIPELINE_MODELS:
        raise ConfigError(
            f"parallel.pp={pp} splits the built-in LLaMA ({PIPELINE_MODELS[0]}) by layer ranges; model.factory="
            f"{model.factory!r} is not one dptrain knows how to split into stages (its forward computes the whole "
            "model and its loss); use parallel.pp=1 for this model"
        )
    if loss is not None:
        raise ConfigError(
            f"train.loss={loss!r} cannot be combined with parallel.pp={pp}: under pipeline parallelism the last "
            "stage computes the loss itself (token cross-entropy of the logits, parallel/pipeline.py), so a loss "
            "function that calls the whole model does not apply; leave train.loss unset"
        )
    if p.strategy == "zero1":
        raise ConfigError(
            "parallel.strategy=zero1 cannot be combined with parallel.pp > 1: ZeRO-1's ZeroRedundancyOptimizer state "
            "is consolidated on global rank 0, which holds only the first pipeline stage; use ddp, zero2 or fsdp"
        )
    kwargs: dict[str, Any] = model.kwargs
    if kwargs.get("tie_embeddings"):
        raise ConfigError(
            f"model.kwargs.tie_embeddings=true cannot be combined with parallel.pp={pp}: the embedding lives on the "
            "first stage and the output layer on the last, so they cannot share one weight; untie them or use pp=1"
        )
    n_layers = kwargs.get("n_layers", 4)
    n_stages = pp * p.pp_stages_per_rank
    stage_layer_counts(int(n_layers), n_stages, p.pp_layers)
    m = pipeline_microbatches(p)
    arithmetic = (
        f"global batch = micro_batch_size {micro_batch_size} x grad_accum_steps {grad_accum_steps} x dp "
        f"{dp_size} = {micro_batch_size * grad_accum_steps * dp_size}; each micro-batch is split into "
        f"pp_microbatches={m} pipeline micro-batches"
    )
    if micro_batch_size % m:
        raise ConfigError(
            f"train.micro_batch_size={micro_batch_size} is not divisible by parallel.pp_microbatches={m} "
            f"({arithmetic}); choose a micro-batch size that is a multiple of {m}, or fewer pipeline micro-batches"
        )
    if p.pp_schedule == "1f1b" and m < pp:
        raise ConfigError(
            f"parallel.pp_schedule=1f1b needs parallel.pp_microbatches >= pp: got pp_microbatches={m} and pp={pp} "
            f"({arithmetic}); raise pp_microbatches (and micro_batch_size with it) or use pp_schedule=gpipe"
        )
    if p.pp_schedule == "interleaved_1f1b":
        rounds = max(1, m // pp)
        if m % rounds:
            raise ConfigError(
                f"parallel.pp_schedule=interleaved_1f1b needs pp_microbatches to be a multiple of its rounds "
                f"max(1, pp_microbatches // pp) = max(1, {m} // {pp}) = {rounds} (torch's ScheduleInterleaved1F1B), "
                f"got pp_microbatches={m} ({arithmetic}); use a multiple of pp={pp}"
            )


def describe_pipeline(*, parallel: ParallelConfig, model: ModelConfig, pp: int, micro_batch_size: int) -> str | None:
    """One line for logs and `config show`: stages, layers per stage, schedule, the micro-batch split."""
    if pp == 1:
        return None
    n_stages = pp * parallel.pp_stages_per_rank
    counts = stage_layer_counts(int(model.kwargs.get("n_layers", 4)), n_stages, parallel.pp_layers)
    m = pipeline_microbatches(parallel)
    return (
        f"{n_stages} stages ({parallel.pp_stages_per_rank} per rank), blocks per stage {counts}, schedule "
        f"{parallel.pp_schedule}; each micro-batch of {micro_batch_size} -> {m} pipeline micro-batches of "
        f"{micro_batch_size // m}"
    )
