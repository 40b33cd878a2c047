"""DeepSpeed's batch keys and its pipeline section."""

from __future__ import annotations

from typing import Any

from dptrain.config.deepspeed.mapping import DeepSpeedMapping, number
from dptrain.config.fields import ConfigError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def batch(ds: dict[str, Any], m: DeepSpeedMapping) -> dict[str, int]:
    """Batch keys as given (returned, "auto" left out); the rest is derived at resolve time by DeepSpeed's
    rules (resolve_batch). gradient_accumulation_steps alone is refused as DeepSpeed refuses it."""
    if not any(k in ds for k in BATCH_KEYS):
        m.notes.append(
            "no batch size given (DeepSpeed refuses this: train_batch_size or train_micro_batch_size_per_gpu "
            "needs to be provided); dptrain uses global 32, micro 8 unless train.* overrides say otherwise"
        )
    given: dict[str, int] = {}
    for ds_key, target in zip(BATCH_KEYS, ("train.global_batch_size", "train.micro_batch_size",
                                          "train.grad_accum_steps"), strict=True):
        v = ds.pop(ds_key, "auto")
        if v != "auto":
            given[ds_key] = number(ds_key, v, integer=True, positive=True)
            m.put(ds_key, target, v)
    if "gradient_accumulation_steps" in given and len(given) == 1:
        raise ConfigError(
            "DeepSpeed config gives only gradient_accumulation_steps: Either train_batch_size or "
            "train_micro_batch_size_per_gpu needs to be provided (DeepSpeed's own check); add one of them"
        )
    return given


def pipeline(pipe: dict[str, Any] | None, given: dict[str, int], m: DeepSpeedMapping) -> None:
    """DeepSpeed's pipeline engine streams gradient_accumulation_steps (GAS) pipeline micro-batches of
    train_micro_batch_size_per_gpu rows through the stages in ONE schedule per optimizer step, GAS derived
    by DeepSpeed's batch rules at the data-parallel size. The same in dptrain: one micro-step
    (`train.grad_accum_steps` = 1) of the rank's whole share of the batch, split into pipeline micro-batches
    of `parallel.pp_microbatch_size` rows (DeepSpeed's micro-batch), so their count is the derived GAS.
    Schedule: 1F1B, which DeepSpeed's TrainSchedule follows; where GAS < stages (DeepSpeed's own
    TestPipeCifar10: train_batch_size 4, pp 2 or 4) GPipe, which torch runs with fewer micro-batches
    than stages (torch's 1F1B cannot) and which computes the same gradient."""
    if pipe is None:
        return
    stages = pipe.pop("stages", None)
    if stages is None:
        m.ignored.append("pipeline (no 'stages': the model is trained without pipeline parallelism)")
        m.ignored += [f"pipeline.{k}" for k in pipe]
        return
    m.put("pipeline.stages", "parallel.pp", number("pipeline.stages", stages, integer=True, positive=True))
    if stages == 1:
        return
    glob = given.get("train_batch_size")
    micro = given.get("train_micro_batch_size_per_gpu")
    gas = given.get("gradient_accumulation_steps")
    m.put("gradient_accumulation_steps (pipelined: one schedule per step)", "train.grad_accum_steps", 1)
    if micro is not None:
        m.put("train_micro_batch_size_per_gpu", "parallel.pp_microbatch_size", micro)
        if gas is not None or glob is None:  # the rank's share is known; else derived from train_batch_size
            m.put("train_micro_batch_size_per_gpu x gradient_accumulation_steps", "train.micro_batch_size",
                  micro * (gas or 1))
        elif "micro_batch_size" in m.config.get("train", {}):
            del m.config["train"]["micro_batch_size"]  # train_batch_size / dp: the derived GAS micro-batches
        schedule = "1f1b" if gas is None or gas >= stages else "gpipe"
    else:
        n = gas or 1  # train_batch_size only: DeepSpeed's GAS is 1
        m.put("gradient_accumulation_steps", "parallel.pp_microbatches", n)
        schedule = "1f1b" if n >= stages else "gpipe"
    m.default("pipeline (DeepSpeed's TrainSchedule; gpipe when GAS < stages)", "parallel.pp_schedule", schedule)
    if "micro_batch_size" in pipe:  # not a DeepSpeed key (guides write it): DeepSpeed's is the per-GPU micro-batch
        pmb = number("pipeline.micro_batch_size", pipe.pop("micro_batch_size"), integer=True, positive=True)
        g = gas or 1
        where = f"; the two agree at data-parallel size {glob // (g * pmb)}" if glob and glob % (g * pmb) == 0 else ""
        m.notes.append(
            f"pipeline.micro_batch_size={pmb} is not a DeepSpeed key and is not used: as in DeepSpeed, a pipeline "
            f"micro-batch is train_micro_batch_size_per_gpu rows (= train_batch_size / (gradient_accumulation_steps x "
            f"data-parallel size)), GAS of them per schedule{where}; config show's pipeline line gives the size"
        )
    for k in ("partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned", "grad_partitioned"):
        if k in pipe:
            m.ignored.append(
                f"pipeline.{k}={pipe.pop(k)!r} (dptrain splits the built-in LLaMA by layer ranges: "
                "parallel.pp_layers; activation checkpointing: parallel.activation_checkpointing)"
            )
    m.ignored += [f"pipeline.{k}" for k in pipe]
