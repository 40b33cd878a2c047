"""Meta-device init (`build_model_meta` + `materialize`) gives bit-for-bit the weights of eager
construction (`build_model(cfg, seed)`) under every strategy, and falls back with a reason for a
factory that cannot be built on meta.

Multi-process cases run on forked gloo ranks (tests/support/mp.py) in the order the strategies need:
zero2/fsdp shard the meta model first and materialize the shards; single/ddp/zero1 materialize
the plain model, then wrap it (DDP broadcasts at construction). Each rank compares its own local
shards with its chunk of the eager tensor, rank 0 compares the gathered full state dict, and both
models take one forward pass whose losses must agree bit for bit (the forward reads FSDP's own
padded shard storage, not just the parameters' DTensor views).
"""

from __future__ import annotations

import gc
import hashlib

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from dptrain.api import parallelize
from dptrain.config import ModelConfig, ParallelConfig
from dptrain.distributed.env import DistEnv
from dptrain.distributed.process_group import destroy_process_group, init_process_group
from dptrain.parallel import full_state_dict, unwrap
from dptrain.parallel.materialize import check_init_contract, local_chunk, make_materializer, materialize
from dptrain.train.build import build_model, build_model_meta
from support.mp import run_ranks

SEED = 1234
CPU = torch.device("cpu")
LLAMA = "dptrain.models.llama:build_llama"
MODELS = {
    "llama": ModelConfig(factory=LLAMA, kwargs={"dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 16}),
    # odd vocabulary (uneven FSDP shards), grouped KV heads, tied embeddings
    "llama_tied_gqa": ModelConfig(factory=LLAMA, kwargs={"vocab_size": 61, "dim": 32, "n_layers": 2, "n_heads": 4,
                                                         "n_kv_heads": 2, "max_seq_len": 16, "tie_embeddings": True}),
    "mlp": ModelConfig(factory="dptrain.models.toy:build_mlp",
                       kwargs={"in_dim": 8, "hidden": 15, "out_dim": 4, "depth": 3}),
}
SHARD_FIRST = ("zero2", "fsdp")


def sample_batch(key: str):
    g = torch.Generator().manual_seed(5)
    if key == "mlp":
        return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    return torch.randint(0, 61, (3, 9), generator=g)


def parallelize_meta(cfg: ModelConfig, pcfg: ParallelConfig) -> tuple[nn.Module, str | None]:
    """Meta build -> the trainer's path: `parallelize` calls the materialize hook after fully_shard
    (zero2/fsdp) or before DDP wraps the model."""
    model, reason = build_model_meta(cfg, seed=SEED)
    if reason is not None:
        return parallelize(model, strategy=pcfg.strategy, cpu_offload=pcfg.cpu_offload, device=CPU).module, reason
    hook = make_materializer(device=CPU, seed=SEED)  # with cpu_offload too: the shards live on the CPU
    pmodel = parallelize(model, strategy=pcfg.strategy, cpu_offload=pcfg.cpu_offload, device=CPU, materialize=hook)
    return pmodel.module, None


def mismatches(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit-identical (torch.equal plus dtype), or missing on one side."""
    names = sorted(expected.keys() | got.keys())
    return [n for n in names if n not in expected or n not in got or expected[n].dtype != got[n].dtype
            or not torch.equal(expected[n], got[n])]


def sha256(sd: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(sd):
        h.update(name.encode())
        h.update(sd[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def local_mismatches(model: nn.Module, expected: dict[str, torch.Tensor]) -> list[str]:
    """This rank's own pieces vs its chunk of the eager tensors (no collective)."""
    bad = []
    for name, t in [*unwrap(model).named_parameters(), *unwrap(model).named_buffers()]:
        t = t.detach()
        if isinstance(t, DTensor):
            want = distribute_tensor(expected[name], t.device_mesh, t.placements, src_data_rank=None).to_local()
            t = t.to_local()
        else:
            want = expected[name]
        if not torch.equal(t, want):
            bad.append(name)
    return bad


def local_bytes(model: nn.Module) -> int:
    """Parameter storage this rank holds (its shards under FSDP)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in unwrap(model).parameters())


def _one_model(rank: int, key: str, pcfg: ParallelConfig) -> dict:
    cfg = MODELS[key]
    eager_model = build_model(cfg, seed=SEED)
    eager_rng = torch.get_rng_state()
    expected = {**{k: v.clone() for k, v in eager_model.state_dict().items()},
                **{k: v.clone() for k, v in eager_model.named_buffers()}}  # + non-persistent (rope)
    torch.manual_seed(999)  # materialize must not depend on the RNG state it finds
    model, reason = parallelize_meta(cfg, pcfg)
    out = {"reason": reason, "rng_equal": torch.equal(torch.get_rng_state(), eager_rng),
           "local_mismatches": local_mismatches(model, expected), "local_bytes": local_bytes(model),
           "full_bytes": sum(p.nbytes for p in eager_model.parameters())}
    full = full_state_dict(model)  # collective under FSDP; complete on rank 0
    if rank == 0 or pcfg.strategy not in SHARD_FIRST:
        eager_sd = eager_model.state_dict()
        out["full_mismatches"] = mismatches(eager_sd, full)
        out["sha"] = (sha256(eager_sd), sha256(full))
    eager = parallelize(eager_model, strategy=pcfg.strategy, cpu_offload=pcfg.cpu_offload, device=CPU).module
    batch = sample_batch(key)
    out["loss"] = (model(batch).item().hex(), eager(batch).item().hex())
    del model, eager, eager_model
    gc.collect()
    return out


def _rank_fn(rank: int, strategy: str, cpu_offload: bool) -> dict:
    env = DistEnv.from_env()
    init_process_group(env, backend="gloo", device=CPU, timeout_s=60)
    try:
        pcfg = ParallelConfig(strategy=strategy, cpu_offload=cpu_offload)
        return {key: _one_model(rank, key, pcfg) for key in MODELS}
    finally:
        gc.collect()  # wrappers before the process group (see tests/test_sync.py)
        destroy_process_group()


CASES = [("single", 1, False), ("ddp", 2, False), ("zero1", 2, False), ("zero2", 2, False),
         ("fsdp", 2, False), ("fsdp", 2, True)]


@pytest.mark.parametrize(("strategy", "world", "cpu_offload"), CASES,
                         ids=[f"{s}{'-offload' if o else ''}-w{w}" for s, w, o in CASES])
def test_meta_init_bit_identical(strategy: str, world: int, cpu_offload: bool) -> None:
    results = run_ranks(_rank_fn, world, strategy, cpu_offload, timeout=240)
    for rank, per_model in enumerate(results):
        for key, r in per_model.items():
            where = f"{strategy} rank {rank} {key}"
            assert r["reason"] is None, where
            assert r["local_mismatches"] == [], where
            assert r["rng_equal"], f"{where}: the global RNG is not where eager construction leaves it"
            assert r["loss"][0] == r["loss"][1], where
            if "full_mismatches" in r:
                assert r["full_mismatches"] == [], where
                assert r["sha"][0] == r["sha"][1], where
            if strategy in SHARD_FIRST:  # each rank holds about half of every parameter
                assert r["local_bytes"] < 0.6 * r["full_bytes"], where
            else:
                assert r["local_bytes"] == r["full_bytes"], where


def _hsdp_rank_fn(rank: int) -> dict:
    """fully_shard over a 2x2 (replicate x shard) mesh, as parallelize will lay out HSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dptrain.parallel.fsdp import shard_units

    init_process_group(DistEnv.from_env(), backend="gloo", device=CPU, timeout_s=60)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        out = {}
        for key, cfg in MODELS.items():
            eager_model = build_model(cfg, seed=SEED)
            eager_sd = {k: v.clone() for k, v in eager_model.state_dict().items()}
            expected = {**eager_sd, **{k: v.clone() for k, v in eager_model.named_buffers()}}
            model, reason = build_model_meta(cfg, seed=SEED)
            for m in (model, eager_model):
                for unit in shard_units(m):
                    fully_shard(unit, mesh=mesh)
                fully_shard(m, mesh=mesh)
            materialize(model, device=CPU, seed=SEED)
            full = full_state_dict(model)
            out[key] = {"reason": reason, "local": local_mismatches(model, expected),
                        "full": mismatches(eager_sd, full) if rank == 0 else [],
                        "placements": str(next(model.parameters()).placements),
                        "loss": (model(sample_batch(key)).item().hex(), eager_model(sample_batch(key)).item().hex())}
            del model, eager_model
            gc.collect()
        return out
    finally:
        destroy_process_group()


def test_meta_init_hsdp_2x2_mesh() -> None:
    for rank, per_model in enumerate(run_ranks(_hsdp_rank_fn, 4, timeout=240)):
        for key, r in per_model.items():
            where = f"rank {rank} {key}"
            assert r["reason"] is None, where
            assert r["placements"] == "(Replicate(), Shard(dim=0))", where
            assert r["local"] == [] and r["full"] == [], where
            assert r["loss"][0] == r["loss"][1], where


def _chunk_rank_fn(rank: int) -> list[tuple[str, bool]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    init_process_group(DistEnv.from_env(), backend="gloo", device=CPU, timeout_s=60)
    try:
        mesh = init_device_mesh("cpu", (2, 2))  # HSDP-like: replicate x shard, or dp x tp
        layouts = [[Shard(0), Shard(0)], [Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()],
                   [Replicate(), Replicate()]]
        out = []
        for shape in [(5, 3), (1, 4), (7,), (4, 6), (3, 1)]:
            full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
            for placements in layouts:
                if any(isinstance(p, Shard) and p.dim >= len(shape) for p in placements):
                    continue
                got = local_chunk(full, mesh, placements)
                want = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
                out.append((f"{shape} {placements}", got.shape == want.shape and torch.equal(got, want)))
        return out
    finally:
        destroy_process_group()


def test_local_chunk_matches_distribute_tensor_on_a_2d_mesh() -> None:
    """The copy-free chunking equals DTensor's own, including uneven and empty shards."""
    for rank, results in enumerate(run_ranks(_chunk_rank_fn, 4, timeout=120)):
        assert len(results) >= 20
        assert [case for case, ok in results if not ok] == [], f"rank {rank}"


# ------------------------------------------------------------------ single process: guard and fallback
@pytest.mark.fast
def test_wrong_seed_is_caught() -> None:
    """Guard: the comparison above is not vacuous; a materialized model under another seed
    differs from the eager one in every randomly initialised tensor."""
    for key, cfg in MODELS.items():
        expected = build_model(cfg, seed=SEED).state_dict()
        model, reason = build_model_meta(cfg, seed=SEED)
        assert reason is None
        materialize(model, device=CPU, seed=SEED + 1)
        bad = mismatches(expected, model.state_dict())
        random = [n for n in expected if not n.endswith("norm.weight")]  # RMSNorm gains are ones either way
        assert set(bad) == set(random), key


@pytest.mark.fast
def test_activation_checkpoint_wrappers_applied_before_materialize() -> None:
    """`parallelize` applies activation checkpointing before FSDP, so materialize sees the wrappers.
    They forward unknown attributes (reset_parameters too) to the wrapped module; the replay must
    not run a wrapped Linear's reset twice."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for key, cfg in MODELS.items():
        expected = build_model(cfg, seed=SEED).state_dict()
        model, reason = build_model_meta(cfg, seed=SEED)
        assert reason is None
        for i, block in enumerate(model.layers):
            if key == "mlp":
                block.fc = checkpoint_wrapper(block.fc)  # a wrapped module that has reset_parameters
            else:
                model.layers[i] = checkpoint_wrapper(block)
        materialize(model, device=CPU, seed=SEED)
        assert mismatches(expected, model.state_dict()) == [], key


@pytest.mark.fast
def test_meta_build_holds_no_storage_and_leaves_rng() -> None:
    before = torch.get_rng_state()
    model, reason = build_model_meta(MODELS["llama"], seed=SEED)
    assert reason is None
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert torch.equal(torch.get_rng_state(), before)
    assert check_init_contract(model) is None


class TorchLayers(nn.Module):
    """Only PyTorch's own layers (their constructors call reset_parameters): no hook to write."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.conv = nn.Conv1d(6, 6, 3)
        self.bn = nn.BatchNorm1d(6)
        self.ln = nn.LayerNorm(6)
        self.gru = nn.GRU(6, 5)
        self.out = nn.Bilinear(5, 5, 2)


def build_torch_layers() -> TorchLayers:
    return TorchLayers()


@pytest.mark.fast
def test_model_of_torch_layers_needs_no_hooks() -> None:
    cfg = ModelConfig(factory="test_meta_init:build_torch_layers", kwargs={})
    eager = build_model(cfg, seed=SEED)
    rng = torch.get_rng_state()
    model, reason = build_model_meta(cfg, seed=SEED)
    assert reason is None
    materialize(model, device=CPU, seed=SEED)
    assert mismatches(eager.state_dict(), model.state_dict()) == []
    assert torch.equal(torch.get_rng_state(), rng)


class Scaled(nn.Module):
    """A parameter whose value depends on a random number read on the host: cannot run on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4) * float(torch.rand(())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


class Pretrained(nn.Module):
    """Creates its tensor explicitly on the CPU (like loading weights): not on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, device="cpu"))


class NoHook(nn.Module):
    """A raw parameter drawn in the constructor with no reset_parameters to replay it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))


class ReachesIntoChildren(nn.Module):
    """The root's init_submodule initialises its children's tensors when called for itself."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        for name, mod in self.named_modules():
            self.init_submodule(name, mod)

    def init_submodule(self, name: str, mod: nn.Module) -> None:
        if mod is self:
            nn.init.zeros_(self.fc.weight)


class AppliesInit(nn.Module):
    """nanoGPT's pattern: the constructor re-initialises every Linear through `self.apply(fn)`,
    which the replay would not see; the write counts give it away."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)


def build_applies_init() -> AppliesInit:
    return AppliesInit()


def build_mlp_bf16() -> nn.Module:
    """Initialised in float32, then cast: replaying the init in bfloat16 would draw differently."""
    from dptrain.models.toy import build_mlp

    return build_mlp().to(torch.bfloat16)


def build_scaled() -> Scaled:
    return Scaled()


def build_pretrained() -> Pretrained:
    return Pretrained()


def build_no_hook() -> NoHook:
    return NoHook()


def build_reaches_into_children() -> ReachesIntoChildren:
    return ReachesIntoChildren()


@pytest.mark.fast
@pytest.mark.parametrize(("factory", "why"), [
    ("build_scaled", "raised"),
    ("build_pretrained", "'w' was created on cpu"),
    ("build_no_hook", "'w' is not set by reset_parameters()"),
    ("build_reaches_into_children", "writes tensors of other modules"),
    ("build_mlp_bf16", "'layers.0.fc.weight' was converted from torch.float32 to torch.bfloat16"),
    ("build_applies_init", "construction wrote 'weight' 2 time(s) but its init hooks write it 1 time(s)"),
])
def test_unsupported_factory_falls_back_with_reason(factory: str, why: str) -> None:
    cfg = ModelConfig(factory=f"test_meta_init:{factory}", kwargs={})
    before = torch.get_rng_state()
    model, reason = build_model_meta(cfg, seed=SEED)
    assert reason is not None and why in reason and f"test_meta_init:{factory}" in reason, reason
    assert not any(t.is_meta for t in model.parameters())
    rng_after_fallback = torch.get_rng_state()
    eager = build_model(cfg, seed=SEED)
    assert mismatches(eager.state_dict(), model.state_dict()) == []
    assert torch.equal(rng_after_fallback, torch.get_rng_state())
    assert not torch.equal(before, rng_after_fallback)  # the fallback is today's eager, seeded build


@pytest.mark.fast
def test_bad_kwargs_still_a_config_error() -> None:
    from dptrain.config import ConfigError

    with pytest.raises(ConfigError, match="rejected model.kwargs"):
        build_model_meta(ModelConfig(factory=LLAMA, kwargs={"no_such_arg": 1}), seed=SEED)
