"""The device mesh and `parallelize` on real gloo ranks (forked, tests/support/mp.py).

- ranks and groups come from the mesh: the data-parallel rank of a rank that differs only in its
  tp coordinate is the same (so is its batch); the replica group is the dp_replicate dimension,
  one per model-parallel coordinate;
- FSDP shards a block that nests its own ModuleList (children first) and trains like one process;
- `materialize` runs after fully_shard under FSDP2 and before DDP's constructor broadcast;
- zero1 through `dptrain.parallelize` shards the optimizer (`.optimizer(...)`).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dptrain.config import ConfigError, ParallelConfig
from dptrain.data import GlobalBatchSampler
from dptrain.distributed.mesh import ParallelDims, ParallelMesh
from support.mp import in_group, run_ranks
from support.nested import Flat, Nested

CPU = torch.device("cpu")


# ------------------------------------------------------------------ ranks and groups
def _mesh_facts(rank: int, layout: dict[str, int]) -> dict:
    import torch.distributed as dist

    def body() -> dict:
        mesh = ParallelMesh.build(ParallelDims.resolve(**layout, world_size=dist.get_world_size()), device_type="cpu")
        sampler = GlobalBatchSampler(dataset_len=64, global_batch_size=8, micro_batch_size=8 // mesh.dp_size,
                                     grad_accum_steps=1, dp_rank=mesh.dp_rank, dp_world_size=mesh.dp_size, seed=0,
                                     shuffle=True)
        replica = mesh.replica_group
        facts = {"dp_rank": mesh.dp_rank, "dp_size": mesh.dp_size, "coord": mesh.coordinate(),
                 "dp_group": sorted(dist.get_process_group_ranks(mesh.dp_group)),
                 "replicas": None if replica is None else sorted(dist.get_process_group_ranks(replica)),
                 "fsdp_mesh_ndim": mesh.fsdp_mesh.ndim, "batch": sampler.micro_batches(0)}
        mesh.release()
        return facts

    return in_group(body)


@pytest.mark.timeout(90)
def test_two_ranks_data_parallel_or_tensor_parallel():
    shard = run_ranks(_mesh_facts, 2, {"dp_shard": 2}, timeout=60)
    assert [f["dp_rank"] for f in shard] == [0, 1] and shard[0]["dp_size"] == 2
    assert [f["replicas"] for f in shard] == [None, None]  # one shard group: nothing to compare
    assert shard[0]["batch"] != shard[1]["batch"]
    tp = run_ranks(_mesh_facts, 2, {"tp": 2}, timeout=60)
    # The mesh carries tp; both ranks are data-parallel rank 0 of 1 and get the same batch.
    assert [f["dp_rank"] for f in tp] == [0, 0] and tp[0]["dp_size"] == 1
    assert [f["coord"]["tp"] for f in tp] == [0, 1]
    assert tp[0]["batch"] == tp[1]["batch"]
    assert [f["dp_group"] for f in tp] == [[0], [1]]


@pytest.mark.timeout(120)
def test_four_ranks_replicas_per_model_parallel_coordinate():
    dp_tp = run_ranks(_mesh_facts, 4, {"dp_replicate": 2, "tp": 2}, timeout=90)
    assert [f["dp_rank"] for f in dp_tp] == [0, 0, 1, 1]
    assert [f["replicas"] for f in dp_tp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert dp_tp[0]["batch"] == dp_tp[1]["batch"] != dp_tp[2]["batch"]
    hsdp = run_ranks(_mesh_facts, 4, {"dp_replicate": 2, "dp_shard": 2}, timeout=90)
    assert [f["dp_rank"] for f in hsdp] == [0, 1, 2, 3]
    assert [f["dp_group"] for f in hsdp] == [[0, 1, 2, 3]] * 4
    assert [f["replicas"] for f in hsdp] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # same shard, other replica
    assert {f["fsdp_mesh_ndim"] for f in hsdp} == {2}


# ------------------------------------------------------------------ bottom-up FSDP units
def _nested_step(rank: int, strategy: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from dptrain.parallel import full_state_dict, parallelize_model

    def body() -> dict:
        torch.manual_seed(0)
        model = Nested()
        cfg = ParallelConfig(strategy=strategy)
        mesh = ParallelMesh.build(ParallelDims.resolve(dp_shard=2, world_size=2), device_type="cpu")
        pmodel = parallelize_model(model, cfg=cfg, mesh=mesh, device=CPU)
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        opt = pmodel.optimizer(torch.optim.SGD, lr=0.5)
        x, y = _nested_data()
        half = slice(rank * 4, rank * 4 + 4)
        pmodel.module((x[half], y[half])).backward()
        opt.step()
        state = full_state_dict(pmodel)
        del pmodel, opt, model
        mesh.release()
        return {"units": len(units), "state": state, "world": dist.get_world_size()}

    return in_group(body)


def _nested_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(8, 4, generator=g), torch.randn(8, generator=g)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_a_block_nesting_a_module_list_is_sharded_and_trains_like_one_process(strategy):
    results = run_ranks(_nested_step, 2, strategy, timeout=60)
    assert results[0]["units"] == 2 * 2 + 2 + 1  # inner members, blocks, root
    torch.manual_seed(0)
    ref = Nested()
    x, y = _nested_data()
    ref((x, y)).backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(results[0]["state"][k], v, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the materialize hook
def _materialize_order(rank: int, strategy: str) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from dptrain.models.toy import build_mlp
    from dptrain.parallel import parallelize_model, unwrap

    seen: dict = {}

    def materialize(module: nn.Module) -> None:
        """Allocate (to_empty) and fill every local tensor with this rank's number: a deterministic init."""
        seen["was_meta"] = all(p.is_meta for p in module.parameters())
        seen["was_sharded"] = isinstance(module, FSDPModule)
        module.to_empty(device=CPU)
        with torch.no_grad():
            for p in module.parameters():
                (p.to_local() if isinstance(p, DTensor) else p).fill_(float(rank + 1))

    def body() -> dict:
        with torch.device("meta"):
            model = build_mlp(in_dim=4, hidden=8, out_dim=2, depth=2)
        import torch.distributed as dist

        dims = ParallelDims.resolve(**({"dp_shard": -1} if strategy == "fsdp" else {"dp_replicate": -1}),
                                    world_size=dist.get_world_size())
        mesh = ParallelMesh.build(dims, device_type="cpu")
        pmodel = parallelize_model(
            model, cfg=ParallelConfig(strategy=strategy), mesh=mesh, device=CPU, materialize=materialize
        )
        local = [(p.to_local() if isinstance(p, DTensor) else p) for p in unwrap(pmodel).parameters()]
        seen["values"] = sorted({float(v) for t in local for v in t.reshape(-1).tolist()})
        seen["on_cpu"] = all(t.device == CPU for t in local)
        pmodel.release()
        del pmodel
        mesh.release()
        return seen

    return in_group(body)


@pytest.mark.timeout(90)
def test_materialize_runs_before_ddp_broadcasts_and_after_fsdp_shards():
    ddp = run_ranks(_materialize_order, 2, "ddp", timeout=60)
    for r in ddp:
        assert r["was_meta"] and not r["was_sharded"] and r["on_cpu"]
        assert r["values"] == [1.0]  # DDP broadcast rank 0's values over rank 1's: materialized before DDP
    fsdp = run_ranks(_materialize_order, 2, "fsdp", timeout=60)
    for rank, r in enumerate(fsdp):
        assert r["was_meta"] and r["was_sharded"] and r["on_cpu"]
        assert r["values"] == [float(rank + 1)]  # each rank filled its own shards: materialized after sharding
    single = run_ranks(_materialize_order, 1, "single", timeout=60)
    assert single[0]["was_meta"] and single[0]["values"] == [1.0]


@pytest.mark.fast
def test_meta_parameters_without_materialize_are_refused():
    from dptrain.parallel.single import apply_single

    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device: pass materialize="):
        apply_single(model, device=CPU)


# ------------------------------------------------------------------ zero1 through the API
def _zero1_step(rank: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import dptrain
    from dptrain.models.toy import build_mlp

    def body() -> dict:
        torch.manual_seed(0)
        pmodel = dptrain.parallelize(build_mlp(in_dim=4, hidden=8, out_dim=2, depth=2), strategy="zero1", device=CPU)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        pmodel.register_comm_hook(None, default_hooks.fp16_compress_hook)  # the DDP communication-hook slot
        opt = pmodel.optimizer(torch.optim.SGD, lr=0.5)
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
        with dptrain.sync_gradients(pmodel, True):
            pmodel.module((x, torch.zeros(4, 2))).backward()
        norm = dptrain.clip_grad_norm_(pmodel, None)
        opt.step()
        out = {
            "zero": isinstance(opt, ZeroRedundancyOptimizer),
            "norm": float(norm),
            "state": dptrain.full_state_dict(pmodel),
        }
        pmodel.release()
        del pmodel, opt
        return out

    return in_group(body)


@pytest.mark.timeout(90)
def test_zero1_through_parallelize_shards_the_optimizer_and_keeps_replicas_equal():
    results = run_ranks(_zero1_step, 2, timeout=60)
    assert all(r["zero"] for r in results)
    assert results[0]["norm"] == results[1]["norm"]
    for k, v in results[0]["state"].items():
        assert torch.equal(v, results[1]["state"][k]), k


def test_prepare_model_is_deprecated_and_parallelize_names_a_bad_strategy_in_its_own_words():
    """One public way to parallelise: `dptrain.parallelize`. The module-only `prepare_model` of 0.1 still works for
    the scripts written with it, with one FutureWarning, and is not in `__all__` (issue 36)."""
    import dptrain

    assert "prepare_model" not in dptrain.__all__ and "parallelize" in dptrain.__all__
    with pytest.raises(ConfigError, match="parallelize: strategy='zero9' is not valid"):
        dptrain.parallelize(nn.Linear(2, 2), strategy="zero9")
    with pytest.warns(FutureWarning, match=r"use dptrain.parallelize\(model, ...\).module"), \
            pytest.raises(ConfigError, match="prepare_model.strategy='zero1'. cannot shard the optimizer"):
        dptrain.prepare_model(nn.Linear(2, 2), strategy="zero1")


def _prepare_model_rank(rank: int) -> dict:  # noqa: ARG001 (run_ranks passes the rank)
    import warnings

    import dptrain

    def body() -> dict:
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = dptrain.prepare_model(nn.Linear(4, 2), strategy="ddp")
        module(torch.randn(3, 4)).sum().backward()
        return {"ddp": isinstance(module, torch.nn.parallel.DistributedDataParallel),
                "warned": [str(w.message) for w in caught if w.category is FutureWarning],
                "grad": dptrain.unwrap(module).weight.grad.clone()}

    return in_group(body)


@pytest.mark.timeout(60)
def test_prepare_model_still_returns_the_ddp_module_of_parallelize():
    results = run_ranks(_prepare_model_rank, 2, timeout=60)
    assert all(r["ddp"] and len(r["warned"]) == 1 for r in results)
    assert torch.equal(results[0]["grad"], results[1]["grad"])  # all-reduced


# ------------------------------------------------------------------ FSDP2 mixed precision policy
def _mp_dtypes(rank: int, param_dtype: str | None) -> dict:
    from dptrain.models.toy import build_mlp
    from dptrain.parallel import parallelize_model, unwrap

    def body() -> dict:
        torch.manual_seed(0)
        model = build_mlp(in_dim=4, hidden=8, out_dim=2, depth=2)
        seen: list[torch.dtype] = []
        model.layers[0].fc.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
        mesh = ParallelMesh.build(ParallelDims.resolve(dp_shard=2, world_size=2), device_type="cpu")
        cfg = ParallelConfig(
            strategy="fsdp", fsdp_param_dtype=param_dtype, fsdp_reduce_dtype="fp32" if param_dtype else None
        )
        pmodel = parallelize_model(model, cfg=cfg, mesh=mesh, device=CPU)
        pmodel.module((torch.randn(4, 4), torch.zeros(4, 2))).backward()
        out = {
            "compute": seen[0],
            "params": {p.dtype for p in unwrap(pmodel).parameters()},
            "grads": {p.grad.dtype for p in unwrap(pmodel).parameters()},
        }
        del pmodel, model
        mesh.release()
        return out

    return in_group(body)


@pytest.mark.timeout(90)
def test_fsdp_mixed_precision_policy_gathers_in_the_param_dtype():
    bf16 = run_ranks(_mp_dtypes, 2, "bf16", timeout=60)
    for r in bf16:  # computes in bf16; the sharded parameters and their gradients stay fp32
        assert r["compute"] == torch.bfloat16 and r["params"] == {torch.float32} and r["grads"] == {torch.float32}
    default = run_ranks(_mp_dtypes, 2, None, timeout=60)
    assert default[0]["compute"] == torch.float32  # no policy: today's behaviour


# ------------------------------------------------------------------ state dicts through the ParallelModel
def _state_round_trip(rank: int, strategy: str) -> dict:
    import dptrain
    from dptrain.models.toy import build_mlp

    def body() -> dict:
        torch.manual_seed(0)
        pmodel = dptrain.parallelize(build_mlp(in_dim=4, hidden=8, out_dim=2, depth=2), strategy=strategy, device=CPU)
        opt = pmodel.optimizer(torch.optim.AdamW, lr=0.1)

        def step(seed: int, pmodel=pmodel, opt=opt) -> None:
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed * 10 + rank))
            pmodel.module((x, torch.zeros(4, 2))).backward()
            opt.step()
            opt.zero_grad()

        step(1)
        msd, osd = pmodel.state_dict(opt)
        msd, osd = {k: v.clone() for k, v in msd.items()}, copy.deepcopy(osd)  # the live state keeps changing
        step(2)
        after_two = dptrain.full_state_dict(pmodel)
        pmodel.load_state_dict(msd, opt, osd)
        step(2)
        again = dptrain.full_state_dict(pmodel)
        pmodel.release()
        del pmodel, opt
        return {"names": sorted(msd), "after_two": after_two, "again": again}

    return in_group(body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_plan_state_dict_round_trip_replays_the_same_step(strategy):
    """Save after step 1, take step 2, load, take step 2 again: the same weights (model and
    optimizer state restored), under the plain module's parameter names."""
    results = run_ranks(_state_round_trip, 2, strategy, timeout=90)
    assert results[0]["names"] == [
        "head.bias",
        "head.weight",
        "layers.0.fc.bias",
        "layers.0.fc.weight",
        "layers.1.fc.bias",
        "layers.1.fc.weight",
    ]
    for r in results:
        for k, v in r["after_two"].items():
            assert torch.equal(r["again"][k], v), k


# ------------------------------------------------------------------ small abilities of the ParallelModel
def _no_unit_warning(rank: int) -> list[str]:
    import warnings

    from dptrain.parallel.fsdp import apply_fsdp

    def body() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = apply_fsdp(Flat(), device=CPU)
        del model
        return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "FSDP:" in str(w.message)]

    return in_group(body)


@pytest.mark.timeout(60)
def test_fsdp_warns_when_a_model_has_no_block_to_shard():
    (messages,) = run_ranks(_no_unit_warning, 1, timeout=45)
    assert len(messages) == 1
    assert "Flat has no nn.ModuleList and no _no_split_modules" in messages[0] and "sharded as one unit" in messages[0]


@pytest.mark.fast
def test_comm_hooks_are_refused_outside_ddp():
    from dptrain.config.layout import STRATEGY_MODES
    from dptrain.parallel import ParallelModel

    model = nn.Linear(2, 2)
    pmodel = ParallelModel(model, plain=model, mode=STRATEGY_MODES["fsdp"], mesh=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="communication hooks apply to DDP"):
        pmodel.register_comm_hook(None, lambda state, bucket: None)
