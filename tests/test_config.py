"""Tests for dptrain.config and dptrain.config.load: batch arithmetic, resolve, lr scaling,
validation, overrides, YAML recipes, DeepSpeed JSON, the YAML round trip and field docs."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
import warnings
from pathlib import Path
from typing import Any

import pytest

from dptrain.config import (
    DTYPES,
    OPTIMIZERS,
    SCHEDULES,
    STRATEGIES,
    Config,
    ConfigError,
    DataConfig,
    LaunchConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
    field_docs,
    local_world_size,
    resolve,
    resolve_batch,
    scaled_lr,
    to_dict,
    validate,
)
from dptrain.config.deepspeed import from_deepspeed
from dptrain.config.load import (
    build_config,
    dump_yaml,
    load_config,
    parse_override,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.fast]


def _train(g: int | None, m: int | None, a: int | None) -> TrainConfig:
    return TrainConfig(global_batch_size=g, micro_batch_size=m, grad_accum_steps=a)


def _cfg(**sections: dict[str, Any]) -> Config:
    """A Config with some fields of some sections replaced, e.g. _cfg(parallel={"strategy": "dp"})."""
    base = Config()
    return dataclasses.replace(
        base, **{name: dataclasses.replace(getattr(base, name), **kw) for name, kw in sections.items()}
    )


def _parse_alternatives(msg: str) -> list[tuple[int, int]]:
    return [(int(m), int(a)) for m, a in re.findall(r"micro_batch_size=(\d+) grad_accum_steps=(\d+)", msg)]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _write_json(tmp_path: Path, obj: Any, name: str = "ds_config.json") -> Path:
    return _write(tmp_path, name, json.dumps(obj))


# ------------------------------------------------------------------------ batch arithmetic


@pytest.mark.parametrize(
    ("g", "m", "a", "w", "expected"),
    [
        (32, 8, 2, 2, (32, 8, 2)),  # all three given and consistent
        (32, 8, None, 2, (32, 8, 2)),  # accum derived
        (32, None, 2, 2, (32, 8, 2)),  # micro derived
        (None, 8, 2, 2, (32, 8, 2)),  # global derived
        (32, None, None, 2, (32, 16, 1)),  # only global: accum 1
        (None, 8, None, 4, (32, 8, 1)),  # only micro: accum 1
        (None, None, 3, 2, (6, 1, 3)),  # only accum: micro 1
        (None, None, None, 2, (32, 8, 2)),  # nothing: the built-in recipe, global 32 = micro 8 x accum x dp
        (None, None, None, 4, (32, 8, 1)),
        (12, 3, None, 1, (12, 3, 4)),
        (7, 7, 1, 1, (7, 7, 1)),
        (64, 2, None, 8, (64, 2, 4)),
    ],
)
def test_resolve_batch_derives_missing(g, m, a, w, expected) -> None:
    got = resolve_batch(_train(g, m, a), dp_world_size=w)
    assert got == expected
    gg, mm, aa = got
    assert gg == mm * aa * w


def test_resolve_batch_inconsistent_names_equation_and_valid_alternatives() -> None:
    with pytest.raises(ConfigError) as ei:
        resolve_batch(_train(16, 4, 8), dp_world_size=2)
    msg = str(ei.value)
    assert "16 != 4 * 8 * 2" in msg
    assert "global_batch_size != micro_batch_size * grad_accum_steps * dp_world_size" in msg
    alts = _parse_alternatives(msg)
    assert alts, msg
    for m, a in alts:
        # every suggestion must itself resolve
        assert resolve_batch(_train(16, m, a), dp_world_size=2) == (16, m, a)
        assert m * a * 2 == 16


def test_resolve_batch_inconsistent_global_not_multiple_of_world() -> None:
    with pytest.raises(ConfigError) as ei:
        resolve_batch(_train(15, 4, 2), dp_world_size=2)
    msg = str(ei.value)
    assert "15 != 4 * 2 * 2" in msg
    suggested = [int(x) for x in re.findall(r"\d+", msg.split("train.global_batch_size=")[-1])]
    assert suggested == [14, 16]
    for g in suggested:
        assert g % 2 == 0
        resolve_batch(_train(g, None, None), dp_world_size=2)


@pytest.mark.parametrize(
    ("g", "m", "a", "w", "needle"),
    [
        (30, 4, None, 2, "micro_batch_size * dp world size = 4 * 2"),
        (30, None, 4, 2, "grad_accum_steps * dp world size = 4 * 2"),
        (10, None, None, 4, "grad_accum_steps * dp world size = 1 * 4"),
        (24, 5, None, 2, "micro_batch_size * dp world size = 5 * 2"),
    ],
)
def test_resolve_batch_not_divisible(g, m, a, w, needle) -> None:
    with pytest.raises(ConfigError) as ei:
        resolve_batch(_train(g, m, a), dp_world_size=w)
    msg = str(ei.value)
    assert "not divisible" in msg and needle in msg
    assert f"train.global_batch_size={g}" in msg
    if g % w == 0:
        alts = _parse_alternatives(msg)
        assert alts
        for mm, aa in alts:
            assert resolve_batch(_train(g, mm, aa), dp_world_size=w) == (g, mm, aa)
    else:
        assert f"multiple of the dp world size {w}" in msg
        tail = msg.split("e.g. train.global_batch_size=")[-1]
        for sg in map(int, re.findall(r"\d+", tail)):
            assert sg > 0 and sg % w == 0


def test_resolve_batch_alternatives_never_exceed_four() -> None:
    with pytest.raises(ConfigError) as ei:
        resolve_batch(_train(96, 5, None), dp_world_size=2)
    alts = _parse_alternatives(str(ei.value))
    assert 1 <= len(alts) <= 4
    assert all(m * a * 2 == 96 for m, a in alts)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("global_batch_size", 0),
        ("global_batch_size", -8),
        ("micro_batch_size", 0),
        ("micro_batch_size", -1),
        ("grad_accum_steps", 0),
        ("grad_accum_steps", -2),
    ],
)
def test_resolve_batch_non_positive_named(field, value) -> None:
    train = dataclasses.replace(_train(32, 8, 2), **{field: value})
    with pytest.raises(ConfigError, match=rf"train\.{field}={value}.*positive integer"):
        resolve_batch(train, dp_world_size=2)


# ----------------------------------------------------------------------------- resolve


def test_resolve_defaults_world2_cpu() -> None:
    r = resolve(Config(), world_size=2, cuda_available=False)
    assert (r.world_size, r.dp_world_size) == (2, 2)
    assert (r.global_batch_size, r.micro_batch_size, r.grad_accum_steps) == (32, 8, 2)
    assert r.device == "cpu" and r.backend == "gloo"
    assert r.lr == Config().optim.lr
    assert "lr=" in r.lr_rule


def test_resolve_world_size_defaults_to_two_on_cpu() -> None:
    r = resolve(Config(), cuda_available=False)
    assert r.world_size == 2 and r.grad_accum_steps == 2
    r = resolve(_cfg(launch={"nproc_per_node": 4}), cuda_available=False)
    assert r.world_size == 4 and r.grad_accum_steps == 1
    r = resolve(_cfg(launch={"nproc_per_node": 2, "nnodes": 2, "rdzv_endpoint": "node0:29500"}), cuda_available=False)
    assert r.world_size == 4


def test_resolve_dp_without_cuda_suggests_ddp() -> None:
    with pytest.raises(ConfigError) as ei:
        resolve(_cfg(parallel={"strategy": "dp"}), world_size=1, cuda_available=False)
    msg = str(ei.value)
    assert "'dp'" in msg and "ddp" in msg


def test_resolve_single_with_world2_errors() -> None:
    with pytest.raises(ConfigError, match=r"'single'.*world size is 2"):
        resolve(_cfg(parallel={"strategy": "single"}), world_size=2, cuda_available=False)
    r = resolve(_cfg(parallel={"strategy": "single"}), world_size=1, cuda_available=False)
    assert (r.global_batch_size, r.micro_batch_size, r.grad_accum_steps) == (32, 8, 4)


def test_resolve_nccl_on_cpu_errors() -> None:
    with pytest.raises(ConfigError, match="nccl"):
        resolve(_cfg(parallel={"backend": "nccl"}), world_size=2, cuda_available=False)


def test_resolve_cuda_device_without_cuda_errors() -> None:
    with pytest.raises(ConfigError, match="parallel.device='cuda'"):
        resolve(_cfg(parallel={"device": "cuda"}), world_size=2, cuda_available=False)


def test_resolve_with_cuda_picks_nccl() -> None:
    r = resolve(Config(), world_size=2, cuda_available=True)
    assert r.device == "cuda" and r.backend == "nccl"
    r = resolve(_cfg(parallel={"strategy": "dp"}), world_size=1, cuda_available=True)
    assert r.device == "cuda"


def test_resolve_batch_error_surfaces_through_resolve() -> None:
    cfg = _cfg(train={"global_batch_size": 16, "micro_batch_size": 4, "grad_accum_steps": 8})
    with pytest.raises(ConfigError, match=re.escape("16 != 4 * 8 * 2")):
        resolve(cfg, world_size=2, cuda_available=False)


def test_resolve_scales_lr() -> None:
    cfg = _cfg(optim={"lr": 1e-3, "lr_scaling": "linear", "base_batch_size": 16})
    r = resolve(cfg, world_size=2, cuda_available=False)
    assert r.lr == pytest.approx(2e-3)


def test_local_world_size() -> None:
    assert local_world_size(LaunchConfig(), cuda_count=0) == 2
    assert local_world_size(LaunchConfig(), cuda_count=8) == 8
    assert local_world_size(LaunchConfig(nproc_per_node=3), cuda_count=8) == 3
    with pytest.raises(ConfigError, match="nproc_per_node"):
        local_world_size(LaunchConfig(nproc_per_node=0))
    with pytest.raises(ConfigError, match="nproc_per_node"):
        local_world_size(LaunchConfig(nproc_per_node="many"))


# --------------------------------------------------------------------------- lr scaling


def test_scaled_lr_none() -> None:
    lr, rule = scaled_lr(OptimConfig(lr=0.1, lr_scaling="none", base_batch_size=8), global_batch_size=64)
    assert lr == 0.1
    assert "lr=0.1" in rule and "none" in rule and "64" in rule


def test_scaled_lr_linear() -> None:
    lr, rule = scaled_lr(OptimConfig(lr=0.1, lr_scaling="linear", base_batch_size=32), global_batch_size=128)
    assert lr == pytest.approx(0.4)
    assert "lr * G / base" in rule
    for number in ("0.4", "0.1", "4", "128", "32"):
        assert number in rule


def test_scaled_lr_linear_down() -> None:
    lr, _ = scaled_lr(OptimConfig(lr=0.1, lr_scaling="linear", base_batch_size=256), global_batch_size=64)
    assert lr == pytest.approx(0.025)


def test_scaled_lr_sqrt() -> None:
    lr, rule = scaled_lr(OptimConfig(lr=0.1, lr_scaling="sqrt", base_batch_size=32), global_batch_size=128)
    assert lr == pytest.approx(0.2)
    assert "sqrt(G / base)" in rule
    for number in ("0.2", "0.1", "128", "32"):
        assert number in rule
    lr, _ = scaled_lr(OptimConfig(lr=0.1, lr_scaling="sqrt", base_batch_size=10), global_batch_size=20)
    assert lr == pytest.approx(0.1 * math.sqrt(2))


@pytest.mark.parametrize("rule", ["linear", "sqrt"])
def test_scaled_lr_base_defaults_to_global(rule) -> None:
    lr, text = scaled_lr(OptimConfig(lr=0.05, lr_scaling=rule), global_batch_size=512)
    assert lr == 0.05
    assert "512" in text


def test_scaled_lr_bad_rule() -> None:
    with pytest.raises(ConfigError, match="none, linear, sqrt"):
        scaled_lr(OptimConfig(lr_scaling="cubic"), global_batch_size=8)


# ----------------------------------------------------------------------------- validate


def test_validate_defaults_ok() -> None:
    validate(Config())


@pytest.mark.parametrize(
    ("section", "field", "value", "valid"),
    [
        ("parallel", "strategy", "deepspeed", STRATEGIES),
        ("precision", "dtype", "fp8", DTYPES),
        ("optim", "name", "lars", OPTIMIZERS),
        ("optim", "schedule", "step", SCHEDULES),
        ("optim", "lr_scaling", "cube", ("none", "linear", "sqrt")),
        ("parallel", "device", "tpu", ("auto", "cpu", "cuda")),
        ("parallel", "backend", "mpi", ("auto", "gloo", "nccl")),
    ],
)
def test_validate_bad_choice_lists_valid(section, field, value, valid) -> None:
    with pytest.raises(ConfigError) as ei:
        validate(_cfg(**{section: {field: value}}))
    msg = str(ei.value)
    assert f"{section}.{field}={value!r}" in msg
    assert ", ".join(valid) in msg


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("model", "factory", "dptrain.models.llama.build_llama"),
        ("data", "factory", "nocolon"),
        ("train", "loss", "my_loss"),
        ("data", "collate", "mod.collate"),
    ],
)
def test_validate_bad_import_path(section, field, value) -> None:
    with pytest.raises(ConfigError, match=rf"{section}\.{field}=.*package\.module:function"):
        validate(_cfg(**{section: {field: value}}))


def test_validate_cpu_offload_needs_fsdp() -> None:
    with pytest.raises(ConfigError, match="cpu_offload.*fsdp or zero2.*'zero1'"):
        validate(_cfg(parallel={"cpu_offload": True, "strategy": "zero1"}))
    validate(_cfg(parallel={"cpu_offload": True, "strategy": "fsdp"}))
    validate(_cfg(parallel={"cpu_offload": True, "strategy": "zero2"}))


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("train", "max_steps", 0),
        ("train", "max_steps", -5),
        ("train", "log_every_steps", 0),
        ("train", "eval_batches", -1),
        ("train", "eval_every_steps", -1),
        ("optim", "warmup_steps", -1),
        ("optim", "lr", 0.0),
        ("optim", "lr", -1e-3),
        ("optim", "grad_clip", -1.0),
        ("optim", "grad_clip", 0.0),
        ("optim", "min_lr_ratio", -0.1),
        ("optim", "min_lr_ratio", 1.5),
        ("optim", "base_batch_size", 0),
        ("data", "num_workers", -1),
        ("launch", "nnodes", 0),
        ("launch", "max_restarts", -1),
        ("parallel", "bucket_cap_mb", 0.0),
        ("parallel", "bucket_cap_mb", -25.0),
    ],
)
def test_validate_out_of_range_numbers(section, field, value) -> None:
    with pytest.raises(ConfigError, match=rf"{section}\.{field}="):
        validate(_cfg(**{section: {field: value}}))


def test_validate_zero_is_fine_where_allowed() -> None:
    validate(
        _cfg(
            train={"eval_every_steps": 0},
            optim={"warmup_steps": 0, "grad_clip": None, "min_lr_ratio": 0.0},
            data={"num_workers": 0},
        )
    )


# ---------------------------------------------------------------------------- overrides


def test_load_config_defaults() -> None:
    assert load_config() == Config()
    assert load_config(None, []) == Config()


def test_overrides_dotted_scalars() -> None:
    cfg = load_config(
        None,
        [
            "train.max_steps=5",
            "optim.lr=0.5",
            "parallel.strategy=fsdp",
            "data.shuffle=false",
            "train.grad_accum_steps=4",
            "launch.nproc_per_node=3",
            "log.name=myrun",
            "optim.betas=[0.8, 0.99]",
        ],
    )
    assert cfg.train.max_steps == 5 and type(cfg.train.max_steps) is int
    assert cfg.optim.lr == 0.5 and type(cfg.optim.lr) is float
    assert cfg.parallel.strategy == "fsdp"
    assert cfg.data.shuffle is False
    assert cfg.train.grad_accum_steps == 4
    assert cfg.launch.nproc_per_node == 3
    assert cfg.log.name == "myrun"
    assert cfg.optim.betas == (0.8, 0.99)


def test_yaml_1_2_exponent_without_dot_is_a_float() -> None:
    # YAML 1.1 (PyYAML's default) needs a dot in a float and would leave "3e-4" a string.
    assert parse_override("optim.lr=3e-4") == ("optim.lr", 3e-4)


@pytest.mark.parametrize(
    ("override", "section", "field", "expected"),
    [
        ("optim.lr=3e-4", "optim", "lr", 3e-4),
        ("optim.lr=3.0e-4", "optim", "lr", 3e-4),
        ("optim.eps=1e-8", "optim", "eps", 1e-8),
        ("optim.grad_clip=1e0", "optim", "grad_clip", 1.0),
        ("optim.lr=2", "optim", "lr", 2.0),
        ("precision.init_scale=1e4", "precision", "init_scale", 1e4),
        ("train.max_steps=1e3", "train", "max_steps", 1000),
        ("train.global_batch_size=2e2", "train", "global_batch_size", 200),
        ("train.max_steps=10.0", "train", "max_steps", 10),
        ("parallel.timeout_s=60", "parallel", "timeout_s", 60.0),
    ],
)
def test_overrides_numbers_coerced(override, section, field, expected) -> None:
    cfg = load_config(None, [override])
    got = getattr(getattr(cfg, section), field)
    assert got == pytest.approx(expected)
    assert type(got) is type(expected)


def test_override_exponent_in_tuple() -> None:
    assert load_config(None, ["optim.betas=[0.9, 1e-3]"]).optim.betas == (0.9, 1e-3)


@pytest.mark.parametrize(
    ("override", "name", "expected"),
    [
        ("train.max_steps=abc", "train.max_steps", "int"),
        ("train.max_steps=2.5", "train.max_steps", "int"),
        ("train.max_steps=true", "train.max_steps", "int"),
        ("optim.lr=fast", "optim.lr", "float"),
        ("optim.lr=true", "optim.lr", "float"),
        ("data.shuffle=maybe", "data.shuffle", "bool"),
        ("log.name=[1, 2]", "log.name", "str"),
        ("train.global_batch_size=lots", "train.global_batch_size", "int"),
        ("optim.grad_clip=high", "optim.grad_clip", "float"),
        ("optim.betas=[0.9]", "optim.betas", "tuple"),
        ("model.kwargs=5", "model.kwargs", "dict"),
    ],
)
def test_override_wrong_type_names_field_and_type(override, name, expected) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    msg = str(ei.value)
    assert name in msg and "wrong type" in msg and expected in msg


def test_override_model_kwargs_merge_into_defaults() -> None:
    default = ModelConfig().kwargs
    cfg = load_config(None, ["model.kwargs.dim=64"])
    assert cfg.model.kwargs == {**default, "dim": 64}
    assert cfg.model.factory == ModelConfig().factory
    cfg = load_config(None, ["model.kwargs.new_key=1", "data.kwargs.seq_len=32"])
    assert cfg.model.kwargs == {**default, "new_key": 1}
    assert cfg.data.kwargs == {**DataConfig().kwargs, "seq_len": 32}
    # The defaults themselves are not mutated.
    assert ModelConfig().kwargs == default and "new_key" not in default


def test_override_new_factory_starts_from_empty_kwargs() -> None:
    cfg = load_config(None, ["model.factory=mypkg.mod:build"])
    assert cfg.model.kwargs == {}
    cfg = load_config(None, ["model.factory=mypkg.mod:build", "model.kwargs.width=3"])
    assert cfg.model.kwargs == {"width": 3}


def test_override_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["train.max_step=5"])
    msg = str(ei.value)
    assert "'train.max_step'" in msg
    assert "max_steps" in msg
    for f in dataclasses.fields(TrainConfig):
        assert f.name in msg


def test_override_unknown_section() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["trainer.max_steps=5"])
    msg = str(ei.value)
    assert "'trainer'" in msg
    for f in dataclasses.fields(Config):
        assert f.name in msg


def test_override_null_and_empty() -> None:
    assert load_config(None, ["optim.grad_clip=null"]).optim.grad_clip is None
    assert load_config(None, ["optim.grad_clip=~"]).optim.grad_clip is None
    assert load_config(None, ["train.grad_accum_steps="]).train.grad_accum_steps is None
    with pytest.raises(ConfigError, match="train.max_steps cannot be null"):
        load_config(None, ["train.max_steps=null"])


def test_override_malformed() -> None:
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["train.max_steps"])
    with pytest.raises(ConfigError, match="dotted"):
        load_config(None, ["max_steps=5"])
    with pytest.raises(ConfigError, match="dotted"):
        load_config(None, ["=5"])


def test_override_into_scalar_refused() -> None:
    with pytest.raises(ConfigError, match="holds a value"):
        load_config(None, ["train.max_steps=5", "train.max_steps.x=1"])


def test_override_value_with_equals_and_colon() -> None:
    cfg = load_config(None, ["model.factory=pkg.mod:fn", "log.out_dir=runs/a=b"])
    assert cfg.model.factory == "pkg.mod:fn"
    assert cfg.log.out_dir == "runs/a=b"


def test_section_value_refused() -> None:
    with pytest.raises(ConfigError, match="'train' must be a section"):
        build_config({"train": 5})
    with pytest.raises(ConfigError, match="dotted"):
        load_config(None, ["train=5"])


def test_later_override_wins() -> None:
    assert load_config(None, ["train.max_steps=5", "train.max_steps=7"]).train.max_steps == 7


# ------------------------------------------------------------------------- YAML recipes


def test_yaml_recipe_with_sections_and_overrides(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "recipe.yaml",
        """
model:
  kwargs: {dim: 32, n_layers: 2}
train:
  max_steps: 50
  global_batch_size: 64
  micro_batch_size: 4
optim:
  lr: 3e-4           # YAML 1.1 reads this as a string; it must still load as a float
  betas: [0.9, 0.999]
  lr_scaling: linear
  base_batch_size: 32
parallel:
  strategy: zero2
precision:
  dtype: bf16
log:
  name: tiny
""",
    )
    cfg = load_config(p, ["train.max_steps=10"])
    assert cfg.train.max_steps == 10
    assert cfg.train.global_batch_size == 64 and cfg.train.micro_batch_size == 4
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.9, 0.999)
    assert cfg.parallel.strategy == "zero2"
    assert cfg.precision.dtype == "bf16"
    assert cfg.model.kwargs == {**ModelConfig().kwargs, "dim": 32, "n_layers": 2}
    assert cfg.log.name == "tiny"
    r = resolve(cfg, world_size=4, cuda_available=False)
    assert (r.global_batch_size, r.micro_batch_size, r.grad_accum_steps) == (64, 4, 4)
    assert r.lr == pytest.approx(6e-4)


def test_yaml_path_as_str(tmp_path: Path) -> None:
    p = _write(tmp_path, "r.yml", "train: {max_steps: 3}\n")
    assert load_config(str(p)).train.max_steps == 3


def test_yaml_empty_file(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "empty.yaml", "")) == Config()
    assert load_config(_write(tmp_path, "comments.yaml", "# nothing here\n")) == Config()


def test_yaml_empty_section(tmp_path: Path) -> None:
    p = _write(tmp_path, "r.yaml", "train:\n  # max_steps: 5\noptim:\n  lr: 0.1\n")
    cfg = load_config(p)
    assert cfg.train == TrainConfig() and cfg.optim.lr == 0.1


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_yaml_non_mapping_top_level(tmp_path: Path, text) -> None:
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(_write(tmp_path, "bad.yaml", text))


def test_yaml_section_not_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'train' must be a section"):
        load_config(_write(tmp_path, "bad.yaml", "train: 5\n"))


def test_yaml_unknown_key_in_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'optim\.learning_rate'.*\blr\b"):
        load_config(_write(tmp_path, "bad.yaml", "optim:\n  learning_rate: 0.1\n"))


def test_yaml_unparsable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(_write(tmp_path, "bad.yaml", "train: {max_steps: 5\n"))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)  # a directory is not a config file


def test_native_json(tmp_path: Path) -> None:
    p = _write_json(tmp_path, {"train": {"max_steps": 9}, "optim": {"lr": 0.2}}, "native.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(p)
    assert cfg.train.max_steps == 9 and cfg.optim.lr == 0.2


def test_bad_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(_write(tmp_path, "bad.json", "{not json"))


# ------------------------------------------------------------------------ DeepSpeed JSON


def test_deepspeed_batch_keys() -> None:
    d, unknown = from_deepspeed(
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}
    )
    assert d["train"] == {"global_batch_size": 64, "micro_batch_size": 4, "grad_accum_steps": 8}
    assert unknown == []
    cfg = build_config(d)
    r = resolve(cfg, world_size=2, cuda_available=False)
    assert (r.global_batch_size, r.micro_batch_size, r.grad_accum_steps) == (64, 4, 8)


def test_deepspeed_optimizer_adamw() -> None:
    d, unknown = from_deepspeed(
        {
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 3e-4, "betas": [0.8, 0.999], "eps": 1e-6, "weight_decay": 0.1},
            }
        }
    )
    assert unknown == []
    o = build_config(d).optim
    assert o.name == "adamw"
    assert (o.lr, o.betas, o.eps, o.weight_decay) == (3e-4, (0.8, 0.999), 1e-6, 0.1)


@pytest.mark.parametrize(
    ("ds_type", "name"), [("Adam", "adamw"), ("SGD", "sgd"), ("adamw", "adamw"), ("OneBitAdam", "onebit_adam"),
                          ("Lamb", "lamb"), ("OneBitLamb", "onebit_lamb")]
)
def test_deepspeed_optimizer_types(ds_type, name) -> None:
    d, _ = from_deepspeed({"optimizer": {"type": ds_type, "params": {"lr": 0.1}}})
    assert build_config(d).optim.name == name


def test_deepspeed_optimizer_unsupported() -> None:
    with pytest.raises(ConfigError, match="ZeroOneAdam"):
        from_deepspeed({"optimizer": {"type": "ZeroOneAdam"}})


def test_deepspeed_optimizer_unknown_params_reported() -> None:
    _, unknown = from_deepspeed(
        {"optimizer": {"type": "Adam", "params": {"lr": 0.1, "amsgrad": True}, "legacy": 1}}
    )
    assert "optimizer.params.amsgrad" in unknown and "optimizer.legacy" in unknown


@pytest.mark.parametrize(
    ("ds_type", "schedule"),
    [("WarmupLR", "constant"), ("WarmupDecayLR", "linear"), ("WarmupCosineLR", "cosine")],
)
def test_deepspeed_schedulers(ds_type, schedule) -> None:
    params: dict[str, Any] = {"warmup_num_steps": 7}
    if ds_type != "WarmupLR":
        params["total_num_steps"] = 321
    d, unknown = from_deepspeed({"scheduler": {"type": ds_type, "params": params}})
    assert unknown == []
    cfg = build_config(d)
    assert cfg.optim.schedule == schedule
    assert cfg.optim.warmup_steps == 7
    if ds_type != "WarmupLR":
        assert cfg.train.max_steps == 321


def test_deepspeed_scheduler_params() -> None:
    d, unknown = from_deepspeed(
        {
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_type": "linear"},
            }
        }
    )
    assert unknown == [] and build_config(d).optim.lr == 0.01
    d, unknown = from_deepspeed(
        {"scheduler": {"type": "WarmupCosineLR",
                       "params": {"cos_min_ratio": 0.05, "warmup_min_ratio": 0, "total_num_steps": 50}}}
    )
    assert unknown == [] and build_config(d).optim.min_lr_ratio == 0.05
    # warmup_min_lr without a known peak (WarmupLR's peak is the optimizer's lr) cannot become a ratio
    d, unknown = from_deepspeed(
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_type": "log"}}}
    )
    assert [u.split(" ")[0] for u in unknown] == ["scheduler.params.warmup_min_lr"]
    assert build_config(d).optim.warmup_type == "log"


def test_deepspeed_scheduler_unsupported() -> None:
    with pytest.raises(ConfigError, match=r"cycle_min_lr=None is not valid; OneCycle needs it"):
        from_deepspeed({"scheduler": {"type": "OneCycle"}})  # DeepSpeed: a required argument
    with pytest.raises(ConfigError, match=r"scheduler.type='CyclicLR' is not valid; use WarmupLR"):
        from_deepspeed({"scheduler": {"type": "CyclicLR"}})
    with pytest.raises(ConfigError, match=r"WarmupDecayLR needs params.total_num_steps"):
        from_deepspeed({"scheduler": {"type": "WarmupDecayLR"}})


def test_deepspeed_fp16() -> None:
    d, unknown = from_deepspeed(
        {"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "loss_scale": 0}}
    )
    assert unknown == []
    p = build_config(d).precision
    assert p.dtype == "fp16" and p.init_scale == 2.0**12 and p.growth_interval == 500


def test_deepspeed_fp16_static_scale_and_extras_reported() -> None:
    d, unknown = from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 3, "foo": 1}})
    p = build_config(d).precision
    assert (p.loss_scaler, p.static_loss_scale) == ("deepspeed", 128.0)  # DeepSpeed's scaler, a static scale
    assert unknown == ["fp16.hysteresis=3 (a static loss_scale is set)", "fp16.foo"]  # unused under a static scale
    d, unknown = from_deepspeed({"fp16": {"enabled": True, "hysteresis": 3}})
    assert (build_config(d).precision.hysteresis, unknown) == (3, [])


def test_deepspeed_bf16() -> None:
    d, unknown = from_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": False}})
    assert unknown == [] and build_config(d).precision.dtype == "bf16"


def test_deepspeed_fp16_and_bf16_refused() -> None:
    with pytest.raises(ConfigError, match="both fp16 and bf16"):
        from_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_deepspeed_gradient_clipping() -> None:
    d, _ = from_deepspeed({"gradient_clipping": 0.5, "seed": 7, "steps_per_print": 3})
    cfg = build_config(d)
    assert cfg.optim.grad_clip == 0.5 and cfg.train.seed == 7 and cfg.train.log_every_steps == 3
    d, _ = from_deepspeed({"gradient_clipping": 0})
    assert build_config(d).optim.grad_clip is None


@pytest.mark.parametrize(("stage", "strategy"), [(0, "ddp"), (1, "zero1"), (2, "zero2"), (3, "fsdp")])
def test_deepspeed_zero_stage(stage, strategy) -> None:
    d, unknown = from_deepspeed({"zero_optimization": {"stage": stage}})
    assert unknown == []
    cfg = build_config(d)
    assert cfg.parallel.strategy == strategy and cfg.parallel.cpu_offload is False
    validate(cfg)


def test_deepspeed_zero_bad_stage() -> None:
    with pytest.raises(ConfigError, match="stage=4"):
        from_deepspeed({"zero_optimization": {"stage": 4}})


def test_deepspeed_offload_stage3() -> None:
    d, unknown = from_deepspeed(
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    )
    cfg = build_config(d)
    assert cfg.parallel.strategy == "fsdp" and cfg.parallel.cpu_offload is True
    validate(cfg)
    assert unknown == ["zero_optimization.offload_optimizer.pin_memory"]  # reported, not dropped


def test_deepspeed_offload_none_device_is_no_offload() -> None:
    d, _ = from_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}})
    assert build_config(d).parallel.cpu_offload is False


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_deepspeed_offload_stage2_maps_to_zero2_cpu_offload(key) -> None:
    d, _ = from_deepspeed({"zero_optimization": {"stage": 2, key: {"device": "cpu"}}})
    cfg = build_config(d)
    assert cfg.parallel.strategy == "zero2" and cfg.parallel.cpu_offload is True
    validate(cfg)


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_deepspeed_offload_stage1_refused(key) -> None:
    with pytest.raises(ConfigError, match=rf"{key}.*stage=1.*use stage 2"):
        from_deepspeed({"zero_optimization": {"stage": 1, key: {"device": "cpu"}}})


def test_deepspeed_reduce_bucket_size_stage0() -> None:
    d, unknown = from_deepspeed({"zero_optimization": {"stage": 0, "reduce_bucket_size": 2**20}})
    assert unknown == [] and build_config(d).parallel.bucket_cap_mb == pytest.approx(4.0)


def test_deepspeed_auto_values_skipped() -> None:
    ds = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                       "total_num_steps": "auto"},
        },
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": "auto"},
    }
    d, unknown = from_deepspeed(ds)
    assert unknown == []
    cfg = build_config(d)
    default = Config()
    assert cfg.train == default.train
    # "auto" keeps dptrain's values; keys the file leaves out take DeepSpeed's defaults (log warmup)
    assert cfg.optim == dataclasses.replace(
        default.optim, schedule="linear", schedule_convention="deepspeed", warmup_type="log"
    )
    assert cfg.precision == default.precision
    assert cfg.parallel == default.parallel


def test_deepspeed_native_section_rides_along() -> None:
    d, unknown = from_deepspeed({"train_batch_size": 8, "dptrain": {"model": {"kwargs": {"dim": 16}}}})
    assert unknown == []
    cfg = build_config(d)
    assert cfg.model.kwargs["dim"] == 16 and cfg.train.global_batch_size == 8


def test_deepspeed_file_full(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 2.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.98], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "overlap_comm": True},
        "wall_clock_breakdown": False,
    }
    cfg = load_config(_write_json(tmp_path, ds), ["train.max_steps=20"])
    msgs = capsys.readouterr().err.splitlines()
    assert all(m.startswith("dptrain: warning: ") for m in msgs), msgs
    assert any("wall_clock_breakdown" in m and "zero_optimization.overlap_comm" in m for m in msgs), msgs
    assert any("ds_config.json" in m for m in msgs)
    assert cfg.train.global_batch_size == 32 and cfg.train.micro_batch_size == 4
    assert cfg.train.grad_accum_steps == 4
    assert cfg.train.max_steps == 20  # the override wins over total_num_steps
    assert cfg.optim.name == "adamw" and cfg.optim.lr == 1e-4 and cfg.optim.betas == (0.9, 0.98)
    assert cfg.optim.weight_decay == 0.0 and cfg.optim.grad_clip == 2.0
    assert cfg.optim.schedule == "cosine" and cfg.optim.warmup_steps == 10
    assert cfg.precision.dtype == "bf16"
    assert cfg.parallel.strategy == "fsdp" and cfg.parallel.cpu_offload is True
    r = resolve(cfg, world_size=2, cuda_available=False)
    assert (r.global_batch_size, r.micro_batch_size, r.grad_accum_steps) == (32, 4, 4)


def test_deepspeed_file_without_unknown_keys_does_not_warn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _write_json(tmp_path, {"train_batch_size": 16, "zero_optimization": {"stage": 1}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(p)
    assert capsys.readouterr().err == ""
    assert cfg.train.global_batch_size == 16 and cfg.parallel.strategy == "zero1"


def test_deepspeed_file_every_unknown_key_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = {
        "train_batch_size": 16,
        "wall_clock_breakdown": False,
        "flops_profiler": {"enabled": False},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "Adam", "params": {"lr": 0.1, "torch_adam": True}},
    }
    load_config(_write_json(tmp_path, ds))
    msg = capsys.readouterr().err
    assert "dptrain: warning: ds_config.json: DeepSpeed keys dptrain does not use" in msg
    for key in (
        "wall_clock_breakdown",
        "flops_profiler",
        "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients",
    ):
        assert key in msg
    assert "torch_adam" not in msg  # used: torch.optim.AdamW's default weight decay (0.01) applies


def test_deepspeed_inconsistent_batch_errors_at_resolve(tmp_path: Path) -> None:
    p = _write_json(
        tmp_path,
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8},
    )
    cfg = load_config(p)  # loads: the world size is only known at resolve
    with pytest.raises(ConfigError) as ei:
        resolve(cfg, world_size=2, cuda_available=False)
    msg = str(ei.value)
    assert "16 != 4 * 8 * 2" in msg
    for m, a in _parse_alternatives(msg):
        assert m * a * 2 == 16


def test_deepspeed_offload_stage2_file_loads_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _write_json(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    cfg = load_config(p)
    assert cfg.parallel.strategy == "zero2" and cfg.parallel.cpu_offload
    assert "dptrain: warning: ds_config.json: ZeRO-2 with CPU offload maps to zero2" in capsys.readouterr().err


# ------------------------------------------------------------------------ YAML round trip


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["optim.lr=3e-4", "optim.grad_clip=null", "optim.betas=[0.8, 0.9]", "precision.dtype=fp16"],
        ["model.factory=pkg.mod:fn", "model.kwargs.a=1", "model.kwargs.nested={x: [1, 2]}"],
        ["train.global_batch_size=null", "train.grad_accum_steps=3", "launch.nproc_per_node=4",
         "log.out_dir=/tmp/x", "data.collate=pkg.mod:collate", "parallel.strategy=fsdp",
         "parallel.cpu_offload=true", "optim.eps=1e-12", "precision.init_scale=1e10"],
    ],
)
def test_dump_yaml_round_trip(tmp_path: Path, overrides) -> None:
    cfg = load_config(None, overrides)
    text = dump_yaml(cfg, extra={"global_batch_size": 32, "lr": 0.003})
    p = _write(tmp_path, "dump.yaml", text)
    back = load_config(p)
    assert back == cfg
    assert to_dict(back) == to_dict(cfg)


def test_dump_yaml_round_trip_programmatic(tmp_path: Path) -> None:
    cfg = Config(
        model=ModelConfig(kwargs={"dim": 8}),
        train=TrainConfig(max_steps=3, global_batch_size=None, micro_batch_size=2),
        optim=OptimConfig(lr=1.5e-5, betas=(0.5, 0.25), base_batch_size=64, lr_scaling="sqrt"),
        parallel=ParallelConfig(strategy="zero1", timeout_s=30.0),
        precision=PrecisionConfig(dtype="bf16"),
        launch=LaunchConfig(nproc_per_node=1, rdzv_endpoint="host:29500"),
    )
    back = load_config(_write(tmp_path, "dump.yaml", dump_yaml(cfg)))
    assert back == cfg


def test_dump_yaml_extra_is_comment_only() -> None:
    text = dump_yaml(Config(), extra={"world_size": 2})
    assert "#   world_size: 2" in text
    assert "resolved" not in text.split("#")[0]


# ------------------------------------------------------------------------------- field docs


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(Config)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(Config)]


def test_every_section_is_a_dataclass() -> None:
    names = [n for n, _ in _sections()]
    assert names == [
        "model", "data", "train", "optim", "parallel", "precision", "launch", "log", "checkpoint", "diagnostics"
    ]
    for _, cls in _sections():
        assert dataclasses.is_dataclass(cls)


@pytest.mark.parametrize(("section", "cls"), _sections())
def test_every_config_field_is_documented(section, cls) -> None:
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        assert f.name in docs, f"{section}.{f.name} has no docstring"
        assert docs[f.name].strip(), f"{section}.{f.name} has an empty docstring"
    assert set(docs) == {f.name for f in dataclasses.fields(cls)}


def test_field_docs_train_config() -> None:
    docs = field_docs(TrainConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert "optimizer steps" in docs["max_steps"]
