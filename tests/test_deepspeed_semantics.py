"""DeepSpeed JSON read as DeepSpeed reads it: batch derivation, defaults for missing keys, aliases,
lenient flags with a warning, refusals with a reason, and the mapping record `config show` prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dptrain.config import ConfigError, resolve
from dptrain.config.deepspeed import from_deepspeed, translate_deepspeed
from dptrain.config.load import build_config, load_config
from dptrain.config.pipeline import settle_pipeline
from support import ROOT


def _batch(ds: dict[str, Any], world: int) -> tuple[int, int, int]:
    r = resolve(build_config(from_deepspeed(ds)[0]), world_size=world, cuda_available=False)
    return r.global_batch_size, r.micro_batch_size, r.grad_accum_steps


@pytest.mark.fast
@pytest.mark.parametrize(
    ("ds", "world", "expected"),
    [
        ({"train_micro_batch_size_per_gpu": 4}, 2, (8, 4, 1)),  # micro only: accum 1, global = micro * dp
        ({"train_batch_size": 64}, 4, (64, 16, 1)),  # global only: accum 1, micro = global / dp
        ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 2, (64, 8, 4)),
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 2, (64, 4, 8)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        ({"train_batch_size": 1024, "gradient_accumulation_steps": 8}, 2, (1024, 64, 8)),  # issue 7
        ({"train_batch_size": 1024, "gradient_accumulation_steps": 8}, 16, (1024, 8, 8)),
        ({"train_batch_size": 1024, "gradient_accumulation_steps": 8}, 64, (1024, 2, 8)),
    ],
)
def test_batch_derived_by_deepspeeds_rules(ds, world, expected) -> None:
    assert _batch(ds, world) == expected


@pytest.mark.fast
def test_batch_not_divisible_is_refused_with_alternatives() -> None:
    with pytest.raises(ConfigError, match=r"1024 is not divisible by grad_accum_steps \* dp world size = 8 \* 256"):
        _batch({"train_batch_size": 1024, "gradient_accumulation_steps": 8}, 256)


@pytest.mark.fast
def test_native_batch_fields_derive_too() -> None:
    """Leave any one out and it is derived; the built-in 32/8 applies only when none is given (docs: batch sizes)."""
    r = resolve(load_config(None, ["train.micro_batch_size=1", "train.grad_accum_steps=1"]), world_size=2,
                cuda_available=False)
    assert (r.global_batch_size, r.micro_batch_size, r.grad_accum_steps) == (2, 1, 1)
    r = resolve(load_config(None, []), world_size=2, cuda_available=False)
    assert (r.global_batch_size, r.micro_batch_size, r.grad_accum_steps) == (32, 8, 2)


@pytest.mark.fast
def test_missing_keys_take_deepspeeds_defaults_and_are_listed() -> None:
    m = translate_deepspeed({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "fp16": {"enabled": True}})
    cfg = build_config(m.config)
    o = cfg.optim
    assert (o.name, o.weight_decay, o.betas, o.eps, o.schedule, o.warmup_steps) == (
        "adamw", 0.0, (0.9, 0.999), 1e-8, "constant", 0)
    assert cfg.precision.growth_interval == 1000 and cfg.precision.init_scale == 2.0**16
    assert cfg.optim.grad_clip == 1.0  # DeepSpeed's gradient_clipping default since 0.19.3
    assert any("no batch size given" in n for n in m.notes)
    listed = {k for k, _, _ in m.defaults}
    assert {"optimizer.params.weight_decay", "optimizer.params.betas", "scheduler",
            "fp16.loss_scale_window", "fp16.initial_scale_power"} <= listed
    assert "optimizer.params.weight_decay (DeepSpeed default) -> optim.weight_decay = 0.0" in m.report()


@pytest.mark.fast
def test_adam_w_mode_false_is_coupled_adam() -> None:
    d, _ = from_deepspeed({"optimizer": {"type": "Adam", "params": {"lr": 0.1, "adam_w_mode": False}}})
    assert build_config(d).optim.name == "adam"
    d, _ = from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "adam_w_mode": False}}})
    assert build_config(d).optim.name == "adamw"  # "AdamW" is always decoupled


@pytest.mark.fast
def test_bfloat16_alias_and_zero_optimization_bool() -> None:
    d, unknown = from_deepspeed({"bfloat16": {"enabled": True}, "zero_optimization": True})
    cfg = build_config(d)
    assert cfg.precision.dtype == "bf16" and cfg.parallel.strategy == "zero1" and unknown == []
    d, _ = from_deepspeed({"zero_optimization": False})
    assert build_config(d).parallel.strategy == "ddp"
    with pytest.raises(ConfigError, match="both bf16 and bfloat16"):
        from_deepspeed({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})


@pytest.mark.fast
def test_disabled_precision_block_with_settings_is_reported() -> None:
    _, unknown = from_deepspeed({"fp16": {"enabled": False, "loss_scale_window": 100}})
    assert any(u.startswith("fp16.{loss_scale_window} (fp16 is not enabled)") for u in unknown)
    _, unknown = from_deepspeed({"fp16": {"enabled": "auto", "loss_scale_window": 100}})
    assert unknown == []  # "auto": the Hugging Face Trainer decides, nothing is dropped silently


@pytest.mark.fast
@pytest.mark.parametrize(("flag", "on"), [("true", True), ("false", False), (1, True), (0, False)])
def test_lenient_enabled_flags_are_read_with_a_note(flag, on) -> None:
    m = translate_deepspeed({"fp16": {"enabled": flag}})
    assert build_config(m.config).precision.dtype == ("fp16" if on else "fp32")
    assert any(f"fp16.enabled={flag!r} read as {on}" in n for n in m.notes)


@pytest.mark.fast
@pytest.mark.parametrize(
    ("ds", "pattern"),
    [
        ({"optimizer": "adam"}, r"optimizer='adam' is not valid; it must be a mapping"),
        ({"scheduler": ["WarmupLR"]}, r"scheduler=\['WarmupLR'\] is not valid; it must be a mapping"),
        (
            {"optimizer": {"type": "Adam", "params": {"lr": "fast"}}},
            r"optimizer.params.lr='fast' is not valid; it must be a number > 0",
        ),
        ({"optimizer": {"type": "Adam", "params": []}}, r"optimizer.params=\[\] is not valid"),
        ({"optimizer": {"type": "Adam", "params": {"betas": 0.9}}}, r"optimizer.params.betas=0.9 .*two numbers"),
        ({"optimizer": {"type": "RMSprop"}}, r"optimizer.type='RMSprop' is not valid; use one of: SGD, Adam, AdamW"),
        ({"train_batch_size": "64"}, r"train_batch_size='64' is not valid; it must be an integer > 0"),
        ({"train_micro_batch_size_per_gpu": 0}, r"train_micro_batch_size_per_gpu=0 is not valid"),
        ({"fp16": {"enabled": "yes"}}, r"fp16.enabled='yes' is not valid; use true or false"),
        ({"fp16": True}, r"fp16=True is not valid; it must be a mapping"),
        ({"zero_optimization": 2}, r"zero_optimization=2 is not valid; use a mapping"),
        ({"zero_optimization": {"stage": "2"}}, r"zero_optimization.stage='2' is not valid; use 0, 1, 2 or 3"),
        (
            {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
            r"stage=1 is not supported.*use stage 2",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": None}}},
            r"warmup_num_steps=None is not valid: warmup_num_steps must be a positive integer",
        ),
        ({"gradient_accumulation_steps": 4}, r"Either train_batch_size or train_micro_batch_size_per_gpu needs"),
        ({"elasticity": {"enabled": True}}, r"elasticity is not supported: DeepSpeed removed elastic.*launch.nnodes"),
        ({"gradient_allreduce_op": "sum"}, r"gradient_allreduce_op='sum' is not supported: dptrain averages"),
        ({"gradient_allreduce_op": "max"}, r"gradient_allreduce_op='max' is not valid; use mean or sum"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1.5}}},
            r"warmup_num_steps=1.5 is not valid",
        ),
        ({"gradient_clipping": "1.0"}, r"gradient_clipping='1.0' is not valid; it must be a number"),
        ({"dptrain": {"train": 5}}, r"dptrain=\{'train': 5\} is not valid; it must map section names to mappings"),
    ],
)
def test_type_errors_name_key_value_and_choices(ds, pattern) -> None:
    with pytest.raises(ConfigError, match=pattern):
        from_deepspeed(ds)


@pytest.mark.fast
def test_pipeline_and_tensor_parallel_sections_map_to_the_layout() -> None:
    """DeepSpeed's pipeline engine streams gradient_accumulation_steps micro-batches through one schedule:
    dptrain pipelines the same rows (one micro-step split into pipeline micro-batches of DeepSpeed's micro-batch
    rows, so their count is the derived GAS), tensor_parallel.autotp_size -> tp."""
    d, unknown = from_deepspeed(
        {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 8,
            "pipeline": {"stages": 2, "partition": "parameters"},
            "tensor_parallel": {"autotp_size": 2},
        }
    )
    assert d["parallel"] == {"pp": 2, "pp_schedule": "1f1b", "pp_microbatch_size": 4, "tp": 2}
    assert (d["train"]["micro_batch_size"], d["train"]["grad_accum_steps"]) == (32, 1)
    assert [u.split("=")[0] for u in unknown] == ["pipeline.partition"]
    d, unknown = from_deepspeed({"pipeline": {"activation_checkpoint_interval": 1}})  # no stages: not pipelined
    assert "parallel" not in d and unknown[0].startswith("pipeline (no 'stages'")


@pytest.mark.timeout(120)
def test_cli_config_show_and_clean_errors(tmp_path: Path) -> None:
    def show(*items: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dptrain", "config", "show", *items, "--nproc-per-node", "2"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )

    r = show("train.micro_batch_size=1", "train.grad_accum_steps=1")
    assert r.returncode == 0, r.stderr
    assert "global_batch_size: 2" in r.stdout
    p = tmp_path / "ds.json"
    p.write_text(
        json.dumps(
            {
                "train_batch_size": 16,
                "comms_logger": {"enabled": False},
                "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}},
            }
        )
    )
    r = show(str(p))
    assert r.returncode == 0, r.stderr
    assert "#   train_batch_size -> train.global_batch_size = 16" in r.stdout
    assert "#   scheduler.params.warmup_type (DeepSpeed default) -> optim.warmup_type = 'log'" in r.stdout
    assert "#   scheduler.params.warmup_max_lr (DeepSpeed default) -> optim.lr = 0.001" in r.stdout
    assert r.stderr.startswith("dptrain: warning: ds.json: DeepSpeed keys dptrain does not use (ignored): comms_logger")
    p.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"lr": "fast"}}}))
    r = show(str(p))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "optimizer.params.lr='fast'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.fast
@pytest.mark.parametrize(("stages", "world", "dp"), [(2, 4, 2), (4, 4, 1)])
def test_deepspeeds_own_pipeline_tests_run_with_gpipe(stages: int, world: int, dp: int) -> None:
    """DeepSpeed's TestPipeCifar10 (train_batch_size 4, pp2/dp2 and pp4/dp1: GAS 1 < stages) runs in DeepSpeed; torch's
    1F1B needs as many micro-batches as stages, so dptrain takes GPipe (the same gradient) for it."""
    cfg = build_config(from_deepspeed({"train_batch_size": 4, "pipeline": {"stages": stages}})[0])
    r = resolve(cfg, world_size=world, cuda_available=False)
    p = settle_pipeline(cfg.parallel, micro_batch_size=r.micro_batch_size, pp=r.dims.pp)
    assert (r.global_batch_size, r.micro_batch_size, r.grad_accum_steps, r.dp_world_size) == (4, 4 // dp, 1, dp)
    assert (p.pp_schedule, p.pp_microbatches) == ("gpipe", 1)


@pytest.mark.fast
def test_pipeline_gas_is_derived_at_the_data_parallel_size() -> None:
    """train_batch_size + micro without GAS: DeepSpeed derives GAS = 64 / (4 x dp); dptrain's pipeline takes that many
    pipeline micro-batches of 4 rows, at every dp size (the raw GAS key is not read)."""
    cfg = build_config(from_deepspeed({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                                       "pipeline": {"stages": 2}})[0])
    for world, gas in ((4, 8), (8, 4), (16, 2)):
        r = resolve(cfg, world_size=world, cuda_available=False)
        p = settle_pipeline(cfg.parallel, micro_batch_size=r.micro_batch_size, pp=r.dims.pp)
        assert (p.pp_microbatches, r.micro_batch_size // p.pp_microbatches, p.pp_schedule) == (gas, 4, "1f1b")
