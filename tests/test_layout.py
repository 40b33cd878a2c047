"""The layout before launch: ParallelDims (-1 inference, refusals naming every factor), the
strategy -> layout + mode mapping, batch arithmetic over the data-parallel size, and the choice of
FSDP units and activation-checkpointing blocks (no process group needed)."""

from __future__ import annotations

import warnings

import pytest
import torch

from dptrain.config import ConfigError, ParallelConfig, resolve
from dptrain.config.deepspeed import from_deepspeed
from dptrain.config.layout import resolve_layout
from dptrain.config.load import build_config, load_config
from dptrain.distributed.mesh import ParallelDims
from dptrain.parallel.activation_checkpointing import apply_activation_checkpointing, outermost_blocks
from dptrain.parallel.fsdp import shard_units
from support.nested import Flat, Nested

pytestmark = [pytest.mark.timeout(60), pytest.mark.fast]


# ------------------------------------------------------------------ ParallelDims
@pytest.mark.parametrize(
    "given,world,want",
    [
        ({}, 1, (1, 1, 1, 1)),
        ({"dp_shard": -1}, 8, (1, 8, 1, 1)),
        ({"dp_replicate": 2, "dp_shard": -1}, 8, (2, 4, 1, 1)),
        ({"dp_replicate": -1, "dp_shard": 4}, 8, (2, 4, 1, 1)),
        ({"dp_shard": 2, "tp": 2, "pp": -1}, 8, (1, 2, 2, 2)),
        ({"dp_replicate": 2, "dp_shard": 2, "tp": 2, "pp": 2}, 16, (2, 2, 2, 2)),
    ],
)
def test_dims_infer_at_most_one_factor(given, world, want):
    dims = ParallelDims.resolve(**given, world_size=world)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == want
    assert dims.dp_size == want[0] * want[1]
    assert dims.world_size == world


def _assert_names_everything(message: str, values: dict[str, int], world: int) -> None:
    for name, v in values.items():
        assert f"{name}={v}" in message, (name, message)
    assert f"world size {world}" in message, message


@pytest.mark.parametrize(
    "given,world",
    [
        ({"dp_replicate": 2, "dp_shard": 3}, 4),  # product 6 != 4
        ({"dp_replicate": 2, "tp": 2, "pp": 2}, 4),  # product 8 != 4
        ({"dp_shard": -1, "tp": 3}, 4),  # -1 cannot be inferred: 4 % 3
        ({"dp_shard": -1, "pp": -1}, 4),  # two unknowns
    ],
)
def test_dims_refusals_name_every_factor_and_the_world_size(given, world):
    with pytest.raises(ConfigError) as info:
        ParallelDims.resolve(**given, world_size=world)
    full = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, **given}
    _assert_names_everything(str(info.value), full, world)


@pytest.mark.parametrize("name,value", [("dp_shard", 0), ("tp", -2), ("pp", 1.5), ("dp_replicate", True)])
def test_dims_refuse_values_that_are_not_degrees(name, value):
    with pytest.raises(ConfigError, match=f"parallel.{name}={value!r} is not valid"):
        ParallelDims.resolve(**{name: value}, world_size=4)


# ------------------------------------------------------------------ strategy -> layout + mode
@pytest.mark.parametrize(
    "strategy,want_dims,wrapper,shard_opt,reshard",
    [
        ("ddp", (4, 1), "ddp", False, True),
        ("zero1", (4, 1), "ddp", True, True),
        ("zero2", (1, 4), "fsdp", False, False),
        ("fsdp", (1, 4), "fsdp", False, True),
    ],
)
def test_strategy_maps_to_a_layout_and_a_mode(strategy, want_dims, wrapper, shard_opt, reshard):
    dims, mode = resolve_layout(ParallelConfig(strategy=strategy), world_size=4)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == (*want_dims, 1, 1)
    assert (mode.wrapper, mode.shard_optimizer, mode.reshard_after_forward) == (wrapper, shard_opt, reshard)


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_one_process_strategies_keep_a_world_of_one(strategy):
    dims, mode = resolve_layout(ParallelConfig(strategy=strategy), world_size=1)
    assert dims.dp_size == 1 and mode.single_process
    with pytest.raises(ConfigError, match="runs in one process but the world size is 2"):
        resolve_layout(ParallelConfig(strategy=strategy), world_size=2)


def test_hsdp_is_fsdp_with_both_data_parallel_dimensions():
    dims, mode = resolve_layout(ParallelConfig(strategy="fsdp", dp_replicate=2, dp_shard=-1), world_size=8)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 4) and mode.wrapper == "fsdp"
    dims, _ = resolve_layout(ParallelConfig(strategy="zero2", dp_replicate=2, dp_shard=2), world_size=4)
    assert dims.dp_size == 4


def test_replication_strategies_refuse_a_shard_dimension():
    with pytest.raises(ConfigError, match=r"parallel.dp_shard=2 needs a sharding strategy.*'ddp'"):
        resolve_layout(ParallelConfig(strategy="ddp", dp_replicate=2, dp_shard=2), world_size=4)


def test_pipeline_times_tensor_parallelism_resolves_on_one_mesh():
    dims, mode = resolve_layout(ParallelConfig(strategy="fsdp", dp_shard=2, tp=2, pp=2), world_size=8)
    assert (dims.pp, dims.dp_shard, dims.tp, mode.wrapper) == (2, 2, 2, "fsdp")
    dims, _ = resolve_layout(ParallelConfig(strategy="ddp", tp=2, pp=2), world_size=8)
    assert (dims.pp, dims.dp_replicate, dims.tp) == (2, 2, 2)


def test_loss_parallel_under_pipeline_times_tensor_parallelism_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as info:
        resolve_layout(ParallelConfig(strategy="ddp", tp=2, pp=2, loss_parallel=True), world_size=4)
    msg = str(info.value)
    assert "loss_parallel=true is refused with pp > 1" in msg and "tp 2" in msg and "pp 2" in msg and "loss_fn" in msg


@pytest.mark.parametrize(("strategy", "dp_dim"), [("ddp", "dp_replicate"), ("zero2", "dp_shard"), ("fsdp", "dp_shard")])
def test_tensor_parallel_layouts(strategy, dp_dim):
    """tp is the innermost dimension; the strategy's own dp dimension takes the rest of the world."""
    dims, _ = resolve_layout(ParallelConfig(strategy=strategy, tp=2), world_size=8)
    assert (dims.tp, getattr(dims, dp_dim), dims.dp_size) == (2, 4, 4)
    dims, _ = resolve_layout(ParallelConfig(strategy=strategy, tp=-1), world_size=2)
    assert (dims.tp, dims.dp_size) == (2, 1)


def test_zero1_with_tensor_parallelism_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"'zero1' with parallel.tp=2 is refused: ZeroRedundancyOptimizer.*zero2"):
        resolve_layout(ParallelConfig(strategy="zero1", tp=2), world_size=4)


def test_pipeline_degree_resolves_with_data_parallelism():
    dims, mode = resolve_layout(ParallelConfig(strategy="fsdp", pp=2), world_size=4)
    assert (dims.pp, dims.dp_shard, dims.dp_size, mode.wrapper) == (2, 2, 2, "fsdp")


def test_resolved_batch_arithmetic_uses_the_data_parallel_size():
    cfg = load_config(None, ["parallel.device=cpu", "parallel.strategy=fsdp", "parallel.dp_replicate=2",
                             "parallel.dp_shard=2", "train.global_batch_size=16", "train.micro_batch_size=2"])
    res = resolve(cfg, world_size=4)
    assert (res.dp_world_size, res.grad_accum_steps) == (4, 2)
    assert (res.dims.dp_replicate, res.dims.dp_shard) == (2, 2)
    with pytest.raises(ConfigError, match="does not match the world size 8"):
        resolve(cfg, world_size=8)


def test_every_deepspeed_stage_keeps_its_strategy_and_layout():
    for stage, strategy, dims in ((0, "ddp", (2, 1)), (1, "zero1", (2, 1)), (2, "zero2", (1, 2)), (3, "fsdp", (1, 2))):
        cfg, unknown = from_deepspeed({"train_batch_size": 16, "zero_optimization": {"stage": stage}})
        res = resolve(build_config({**cfg, "parallel": {**cfg["parallel"], "device": "cpu"}}), world_size=2)
        assert cfg["parallel"]["strategy"] == strategy and unknown == []
        assert (res.dims.dp_replicate, res.dims.dp_shard) == dims


@pytest.mark.parametrize(
    "items,match",
    [
        (["parallel.activation_checkpointing=some"], "parallel.activation_checkpointing='some' is not valid"),
        (["parallel.fsdp_param_dtype=bf16"], "applies to FSDP2 only"),
        (
            ["parallel.strategy=fsdp", "parallel.fsdp_reduce_dtype=int8"],
            "parallel.fsdp_reduce_dtype='int8' is not valid",
        ),
    ],
)
def test_parallel_options_are_checked_before_launch(items, match):
    with pytest.raises(ConfigError, match=match):
        resolve(load_config(None, ["parallel.device=cpu", *items]), world_size=2)


# ------------------------------------------------------------------ FSDP units, bottom-up
def test_units_are_sharded_children_before_the_blocks_that_hold_them():
    model = Nested()
    units = shard_units(model)
    inners = [i for b in model.blocks for i in b.inner]
    assert units == [*inners, *model.blocks]  # every nested member first, then the outer blocks
    assert len({id(u) for u in units}) == len(units)


def test_no_split_modules_names_the_units():
    model = Flat()
    model._no_split_modules = ["Inner"]
    assert shard_units(model) == [model.a, model.b]
    model._no_split_modules = ["NoSuchClass"]  # names nothing here: ModuleLists decide (none)
    assert shard_units(model) == []


def test_activation_checkpointing_wraps_the_outermost_blocks_only():
    model = Nested()
    assert outermost_blocks(model) == list(model.blocks)
    names = [n for n, _ in model.named_parameters()]
    assert apply_activation_checkpointing(model, mode="full") == list(model.blocks)
    assert [n for n, _ in model.named_parameters()] == names  # composable: no wrapper, same names
    with pytest.raises(ValueError, match="activation_checkpointing='half' is not valid"):
        apply_activation_checkpointing(Nested(), mode="half")


@pytest.mark.parametrize("mode", ["full", "selective", "selective_torchtitan"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8)
    grads, calls = {}, {}
    for m in ("none", mode):
        torch.manual_seed(1)
        model = Nested()
        apply_activation_checkpointing(model, mode=m)
        model((x, y)).backward()
        grads[m] = {n: p.grad for n, p in model.named_parameters()}
        calls[m] = model.blocks[0].inner[0].calls
    assert calls == {"none": 1, mode: 2}, "the checkpointed block must run its forward again in backward"
    for n, g in grads["none"].items():
        assert torch.equal(grads[mode][n], g), n


def test_a_model_without_blocks_warns_naming_its_class():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert apply_activation_checkpointing(Flat(), mode="full") == []
    assert any("Flat has no nn.ModuleList" in str(w.message) for w in caught)


def test_a_model_parallel_degree_of_minus_one_takes_the_world_not_the_strategys_dimension():
    from dptrain.config import ConfigError, ParallelConfig
    from dptrain.config.layout import resolve_layout

    try:
        dims, _ = resolve_layout(ParallelConfig(strategy="ddp", tp=-1), world_size=4)
    except ConfigError as e:  # where tensor parallelism is not built: refused for that reason only
        assert "at most one" not in str(e) and "tp 4" in str(e), e
    else:
        assert (dims.dp_replicate, dims.tp) == (1, 4)
