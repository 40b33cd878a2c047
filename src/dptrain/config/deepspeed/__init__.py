"""DeepSpeed-style JSON: translate a DeepSpeed config dict into dptrain's nested config dict.

A DeepSpeed file means what it means in DeepSpeed (0.19, held against `deepspeed.runtime.config.DeepSpeedConfig`
and its schedulers in tests/test_deepspeed_conformance.py): every key the file leaves out takes DeepSpeed's
default (not dptrain's), and the translation is recorded key by key (`DeepSpeedMapping`) so that
`dptrain config show` can list what each key became, the defaults applied and the keys ignored.
"auto" values (Hugging Face Trainer style) keep dptrain's own value. One module per section: batch.py
(batch keys, pipeline), optimizer.py, scheduler.py, precision.py (fp16/bf16), zero.py (ZeRO, tensor parallel).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dptrain.config.deepspeed.batch import batch, pipeline
from dptrain.config.deepspeed.mapping import DeepSpeedMapping, bad, block, number
from dptrain.config.deepspeed.optimizer import optimizer
from dptrain.config.deepspeed.precision import precision
from dptrain.config.deepspeed.scheduler import scheduler
from dptrain.config.deepspeed.zero import tensor_parallel, zero
from dptrain.config.fields import Config, ConfigError

__all__ = ["DeepSpeedMapping", "from_deepspeed", "mapping_for_file", "translate_deepspeed"]

# Top-level blocks DeepSpeed 0.19 refuses (its _REMOVED_TOP_LEVEL_CONFIG_KEYS): refused here too, with what
# dptrain offers instead
REMOVED = {
    "elasticity": "DeepSpeed removed elastic training (0.19 refuses the block): set train_batch_size / "
    "train_micro_batch_size_per_gpu / gradient_accumulation_steps directly; dptrain's own elastic runs "
    "(launch.nnodes=MIN:MAX) keep the global batch and re-derive the accumulation at each node count",
    "amp": "DeepSpeed removed its NVIDIA Apex AMP integration: use fp16 or bf16",
    "sparse_gradients": "DeepSpeed removed sparse gradient compression: remove the key",
    "curriculum_learning": "DeepSpeed removed top-level curriculum_learning (now data_efficiency.data_sampling); "
    "dptrain has no curriculum sampler",
    "progressive_layer_drop": "DeepSpeed removed Progressive Layer Dropping; dptrain has none",
    "nebula": "DeepSpeed removed Nebula checkpointing; dptrain checkpoints with checkpoint.*",
    "compression_training": "DeepSpeed removed its compression library; dptrain has none",
    "quantize_training": "DeepSpeed removed Mixture-of-Quantization; dptrain has none",
    "eigenvalue": "DeepSpeed removed eigenvalue-based MoQ; dptrain has none",
    "sparse_attention": "DeepSpeed removed Sparse Attention; dptrain has none",
    "graph_harvesting": "DeepSpeed removed graph harvesting; dptrain has none",
}


def translate_deepspeed(ds: dict[str, Any]) -> DeepSpeedMapping:
    """Translate a DeepSpeed config dict into a DeepSpeedMapping (its `.config` is the dptrain dict)."""
    m = DeepSpeedMapping()
    ds = dict(ds)
    for key, why in REMOVED.items():
        if key not in ds:
            continue
        v = ds[key]
        if v is False or v is None or (isinstance(v, dict) and v.get("enabled") is False):
            ds.pop(key)  # a switched-off leftover: DeepSpeed 0.19 refuses even this, dptrain lists it
            m.ignored.append(f"{key} (switched off; DeepSpeed 0.19 refuses the key altogether: {why})")
            continue
        raise ConfigError(f"DeepSpeed {key} is not supported: {why}")
    given = batch(ds, m)
    if "gradient_clipping" not in ds:  # DeepSpeed's default since 0.19.3: 1.0
        m.default("gradient_clipping", "optim.grad_clip", 1.0)
    for ds_key, target in (
        ("gradient_clipping", "optim.grad_clip"),
        ("seed", "train.seed"),
        ("steps_per_print", "train.log_every_steps"),
    ):
        v = ds.pop(ds_key, "auto")
        if v != "auto":
            v = number(ds_key, v, integer=ds_key != "gradient_clipping")
            m.put(ds_key, target, None if ds_key == "gradient_clipping" and v == 0 else v)
    _allreduce_op(ds, m)
    optimizer(block(ds, "optimizer"), m)
    ds.pop("optimizer", None)
    _lamb_needs_dynamic_scale(ds, m)
    scheduler(block(ds, "scheduler"), m)
    ds.pop("scheduler", None)
    precision(ds, m)
    zero(ds.pop("zero_optimization", None), m)
    pipeline(block(ds, "pipeline"), given, m)
    ds.pop("pipeline", None)
    tensor_parallel(block(ds, "tensor_parallel"), m)
    ds.pop("tensor_parallel", None)
    native = ds.pop("dptrain", None) or {}  # native sections may ride along inside a DeepSpeed file
    if not isinstance(native, dict) or not all(isinstance(v, dict | None) for v in native.values()):
        raise bad("dptrain", native, 'it must map section names to mappings, e.g. {"train": {"max_steps": 100}}')
    for section, values in native.items():
        for k, v in (values or {}).items():
            m.put(f"dptrain.{section}.{k}", f"{section}.{k}", v)
    m.ignored += list(ds)
    return m


def _allreduce_op(ds: dict[str, Any], m: DeepSpeedMapping) -> None:
    """gradient_allreduce_op: DeepSpeed 0.19 takes mean (its default) or sum. dptrain averages, as DDP and FSDP do."""
    if "gradient_allreduce_op" not in ds:
        return
    v = ds.pop("gradient_allreduce_op")
    op = v.lower() if isinstance(v, str) else v
    if op == "mean":
        m.mapped.append(("gradient_allreduce_op", "(gradients averaged over data-parallel ranks: DDP/FSDP)", v))
        return
    if op == "sum":
        raise ConfigError(
            "DeepSpeed gradient_allreduce_op='sum' is not supported: dptrain averages gradients over the data-parallel "
            "ranks (DDP/FSDP); a sum is the mean times the dp world size, so for SGD multiply the lr by it, while "
            "Adam-family optimizers are invariant to the factor except through eps: use 'mean'"
        )
    raise bad("gradient_allreduce_op", v, "use mean or sum (DeepSpeed's choices)")


def _lamb_needs_dynamic_scale(ds: dict[str, Any], m: DeepSpeedMapping) -> None:
    """DeepSpeed's engine asserts dynamic loss scaling (fp16.loss_scale 0) for Lamb."""
    fp16 = ds.get("fp16")
    scale = fp16.get("loss_scale", 0) if isinstance(fp16, dict) else 0
    if m.config.get("optim", {}).get("name") == "lamb" and scale not in (0, "auto"):
        raise ConfigError(f"DeepSpeed optimizer.type Lamb with fp16.loss_scale={scale!r}: DeepSpeed's Lamb requires "
                          "dynamic loss scaling; set fp16.loss_scale to 0")


def from_deepspeed(ds: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Translate a DeepSpeed config dict; return (nested dptrain dict, keys not used)."""
    m = translate_deepspeed(ds)
    return m.config, m.ignored


def mapping_for_file(path: str) -> DeepSpeedMapping | None:
    """The mapping record of a DeepSpeed-style JSON file, or None for any other config file."""
    p = Path(path)
    if p.suffix != ".json" or not p.is_file():
        return None
    raw = json.loads(p.read_text())
    if not isinstance(raw, dict) or set(raw) <= {f.name for f in dataclasses.fields(Config)}:
        return None
    return translate_deepspeed(raw)
