"""DP x PP x TP on one DeviceMesh: pipeline stages split over the tp ranks (the built-in LLaMA plan
per stage), data parallelism per stage. The parity ladder's 3-D rungs (plain SGD against the
single-process reference of tests/test_parity.py, at the DP rungs' tolerance rtol 1e-5 / atol 1e-6),
the refusals that remain, bit-identical materialisation and resume across layouts."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from dptrain.config import ConfigError
from support import parity as tp
from support.checkpoints import fit, fit_capturing
from support.cli import refused
from support.mp import in_group

warnings.filterwarnings("ignore", message=".*sequential all_(reduce|gather).*")


def items_3d(*, strategy: str, dp: int, accum: int, schedule: str = "1f1b", grad_clip: float | None = None,
             stages_per_rank: int = 1) -> list[str]:
    """pp2 x tp2 x dp `dp`: the pipeline rungs' items (2 pipeline micro-batches) plus parallel.tp=2."""
    items = tp.pp_items(strategy=strategy, world_size=2 * dp, accum=accum, schedule=schedule,
                         stages_per_rank=stages_per_rank)
    if grad_clip is not None:
        items.append(f"optim.grad_clip={grad_clip}")
    return [*items, "parallel.tp=2"]


def rung(items: list[str], world: int, out_dir: Path, *, grad_clip: float | None = None, timeout: float = 200) -> float:
    return tp.pp_rung(items, world, out_dir, timeout=timeout, grad_clip=grad_clip)


# ------------------------------------------------------------------ parity
@pytest.mark.timeout(200)
@pytest.mark.parametrize("accum", [1, 2])
def test_pp2_tp2_matches_reference(accum, tmp_path):
    diff = rung(items_3d(strategy="ddp", dp=1, accum=accum), 4, tmp_path)
    print(f"\nPARITY pp2xtp2 1f1b accum={accum} worst|dw|={diff:.3g}")


@pytest.mark.timeout(200)
def test_pp2_tp2_clips_by_the_global_norm_over_tp_and_pp(tmp_path):
    diff = rung(items_3d(strategy="ddp", dp=1, accum=1, grad_clip=0.05), 4, tmp_path, grad_clip=0.05)
    print(f"\nPARITY pp2xtp2 clip=0.05 worst|dw|={diff:.3g}")


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("label", "schedule", "stages_per_rank", "extra"), [
    ("gpipe", "gpipe", 1, ()),
    ("interleaved_1f1b", "interleaved_1f1b", 2, ()),
    ("no sequence parallel", "1f1b", 1, ("parallel.sequence_parallel=false",)),
    ("activation checkpointing full", "1f1b", 1, ("parallel.activation_checkpointing=full",)),
    ("activation checkpointing selective", "1f1b", 1, ("parallel.activation_checkpointing=selective",)),
])
def test_pp2_tp2_schedules_and_options_match_reference(label, schedule, stages_per_rank, extra, tmp_path):
    items = items_3d(strategy="ddp", dp=1, accum=2, schedule=schedule, stages_per_rank=stages_per_rank)
    diff = rung([*items, *extra], 4, tmp_path)
    print(f"\nPARITY pp2xtp2 {label} accum=2 worst|dw|={diff:.3g}")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"])
def test_dp2_pp2_tp2_matches_reference(strategy, accum, tmp_path):
    """8 ranks: each (pp, tp) shard of the model data-parallel over 2 ranks; under ddp the drift
    check compares every stage's tp shard with its replica, every step."""
    items = items_3d(strategy=strategy, dp=2, accum=accum)
    if strategy == "ddp":
        items.append("diagnostics.drift_every_steps=1")
    diff = rung(items, 8, tmp_path, timeout=380)
    print(f"\nPARITY dp2xpp2xtp2 {strategy} accum={accum} worst|dw|={diff:.3g}")
    if strategy == "ddp":
        tp.assert_no_drift(tmp_path)


# ------------------------------------------------------------------ refusals
@pytest.mark.fast
@pytest.mark.parametrize(("items", "named"), [
    (("parallel.loss_parallel=true",), ["loss_parallel=true is refused with pp > 1", "loss_fn"]),
    (("parallel.tp_plan=dptrain.models.toy:build_mlp",), ["tp_plan='dptrain.models.toy:build_mlp'", "pp > 1"]),
    (("parallel.strategy=zero1",), ["zero1"]),
])
def test_3d_refusals(items, named):
    with pytest.raises(ConfigError) as err:
        tp.resolve_items("parallel.pp=2", "parallel.tp=2", *items, world_size=4)
    for n in named:
        assert n in str(err.value), (n, str(err.value))


@pytest.mark.fast
def test_pp2_tp2_layout_resolves():
    res = tp.resolve_items("parallel.pp=2", "parallel.tp=2", "train.global_batch_size=8", "train.micro_batch_size=4",
                       world_size=8)
    assert (res.dims.pp, res.dims.tp, res.dp_world_size) == (2, 2, 2)


# ------------------------------------------------------------------ materialisation and export
def _materialised_state(rank: int, strategy: str, layout: dict[str, int]) -> dict[str, torch.Tensor]:
    """This rank's pp2 x tp2 stages built on meta, split over tp, (sharded,) materialised; the
    consolidated model (full_state_dict: TP shards gathered, PP stages collected) on rank 0."""
    import gc

    from dptrain.config import ParallelConfig
    from dptrain.config.fields import ModelConfig
    from dptrain.distributed.mesh import ParallelDims, ParallelMesh
    from dptrain.parallel.materialize import make_materializer
    from dptrain.parallel.pipeline import parallelize_pipeline
    from dptrain.train.build import build_model_meta

    def body() -> dict[str, torch.Tensor]:
        dims = ParallelDims.resolve(**layout, world_size=_world(layout))
        mesh = ParallelMesh.build(dims, device_type="cpu")
        meta, reason = build_model_meta(ModelConfig(kwargs=tp.PP_LLAMA), seed=7)
        assert reason is None
        cfg = ParallelConfig(strategy=strategy, pp=2, tp=2, pp_microbatches=2)
        pmodel = parallelize_pipeline(meta, cfg=cfg, mesh=mesh, device=torch.device("cpu"),
                                    materialize=make_materializer(device="cpu", seed=7))
        assert any(isinstance(p, torch.distributed.tensor.DTensor) for p in pmodel.plain.parameters())
        full = pmodel.full_state_dict()
        pmodel.release()
        mesh.release()
        gc.collect()
        return full

    return in_group(body)


def _world(layout: dict[str, int]) -> int:
    n = 1
    for v in layout.values():
        n *= v
    return n


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("strategy", "layout"), [("ddp", {"pp": 2, "tp": 2}),
                                                  pytest.param("fsdp", {"pp": 2, "dp_shard": 2, "tp": 2},
                                                               marks=pytest.mark.slow)])
def test_pp2_tp2_stages_materialise_bit_identical_to_the_eager_build(strategy, layout):
    from dptrain.models.llama import build_llama
    from support.mp import run_ranks

    torch.manual_seed(7)
    eager = build_llama(**tp.PP_LLAMA).state_dict()
    full = run_ranks(_materialised_state, _world(layout), strategy, layout, timeout=100)[0]
    assert full.keys() == eager.keys()
    for k in eager:
        assert torch.equal(full[k], eager[k]), k


# ------------------------------------------------------------------ resume across layouts
CHAIN = {  # name -> (world size, strategy, data-parallel degree, extra items)
    "dp2xpp2xtp2": (8, "ddp", 2, ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=2",
                                  "parallel.tp=2"]),
    "dp4xtp2": (8, "ddp", 4, ["parallel.tp=2"]),
    "dp2": (2, "ddp", 2, []),
    "single": (1, "single", 1, []),
}


def chain_items(name: str, steps: int) -> list[str]:
    world, strategy, dp, extra = CHAIN[name]
    items = tp.overrides(strategy=strategy, world_size=dp, accum=1, model="llama", global_batch=8)
    items += [f"model.kwargs.{k}={v}" for k, v in tp.PP_LLAMA.items()]
    return [*items, *extra, *tp.RESUME[:1], "checkpoint.every_steps=1", "train.eval_every_steps=0",
            f"train.max_steps={steps}"]


def _checkpoint_state(step_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model, optimizer tensors by `state.<name>.<key>`) of a committed checkpoint, DCP or full."""
    from dptrain.checkpoint.storage import load_full_model_state, load_torch

    if (step_dir / "dcp").is_dir():
        return load_full_model_state(step_dir, fmt="dcp"), tp.dcp_optimizer_state(step_dir)
    osd = load_torch(step_dir / "optim.pt")
    optim = {f"state.{n}.{k}": v for n, st in osd["state"].items() for k, v in st.items()
             if isinstance(v, torch.Tensor) and v.dim() > 0}
    return load_full_model_state(step_dir, fmt="full"), optim


def _fit_loaded(rank: int, out: Path, items: list[str]) -> dict:
    return fit_capturing(rank, out, items, "loaded")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_dp2_pp2_tp2_as_dp4_tp2_then_dp2_then_single(tmp_path):
    """One run, one step per layout: DP2xPP2xTP2 (8 ranks, DCP) -> DP4xTP2 (8 ranks) -> DP2 -> single,
    saving every step (SGD with momentum). Each layout loads the previous one's checkpoint with
    model and optimizer state equal bit for bit, goes on at the next step (the data position kept),
    and the losses and final weights are the uninterrupted 3-D run's."""
    from safetensors.torch import load_file

    from support.mp import run_ranks


    ref = tmp_path / "uninterrupted"
    want, want_records = tp.train(chain_items("dp2xpp2xtp2", tp.STEPS), 8, ref, timeout=200)
    want_losses = {r["step"]: r["loss"] for r in want_records if "loss" in r}
    run = tmp_path / "run"
    from dptrain.cli.main import main

    run_ranks(fit, 8, run, chain_items("dp2xpp2xtp2", 1), timeout=200)
    step1 = run / "checkpoints" / "step_000001"
    assert main(["ckpt", "export", str(step1), "--out", str(tmp_path / "export.safetensors")]) == 0
    exported, (model1, _) = load_file(str(tmp_path / "export.safetensors")), _checkpoint_state(step1)
    assert exported.keys() == want.keys() and all(torch.equal(exported[k], model1[k]) for k in model1)
    for step, name in enumerate(("dp4xtp2", "dp2", "single"), start=2):
        saved_model, saved_optim = _checkpoint_state(run / "checkpoints" / f"step_{step - 1:06d}")
        world = CHAIN[name][0]
        items = chain_items(name, step)
        # Always in a forked rank, also for one: fit_capturing patches CheckpointManager, and a patch made in
        # pytest's own process would leak into every later test (their ranks are forked from it).
        run_ranks(_fit_loaded, world, run, items, timeout=200)
        loaded = torch.load(run / f"loaded_{step - 1}.pt", weights_only=True)
        assert loaded["model"].keys() == saved_model.keys()
        for k in saved_model:
            assert torch.equal(loaded["model"][k], saved_model[k]), (name, k)
        got_optim = {f"state.{n}.{k}": v for n, st in loaded["optim"]["state"].items() for k, v in st.items()
                     if isinstance(v, torch.Tensor) and v.dim() > 0}
        assert got_optim.keys() == saved_optim.keys() and saved_optim, name
        for k in saved_optim:
            assert torch.equal(got_optim[k], saved_optim[k]), (name, k)
        print(f"\nRESUME step {step - 1} -> {name}: model ({len(saved_model)} tensors) and optimizer "
              f"({len(saved_optim)} tensors) exact")
    records = tp.records(run)
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(s for s in (r.get("step") for r in records if "loss" in r)) == [1, 2, 3, 4]  # each step once
    assert [losses[s] for s in range(1, 5)] == pytest.approx([want_losses[s] for s in range(1, 5)], rel=1e-5)
    got = load_file(str(run / "final" / "model.safetensors"))
    tp.assert_weights_close(got, want)
    print(f"RESUME chain final worst|dw| vs uninterrupted 3-D run = {tp.max_abs_diff(got, want):.3g}; losses "
          + ", ".join(f"{s}:{losses[s]:.6f}/{want_losses[s]:.6f}" for s in range(1, 5)))


# ------------------------------------------------------------------ the DeepSpeed config, in miniature
MINI_DS = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 6e-4}},
    "fp16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    "pipeline": {"stages": 2},
    "tensor_parallel": {"autotp_size": 2},
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_miniature_llama_7b_deepspeed_config_trains_dp2_pp2_tp2_through_the_cli(tmp_path):
    """The LLaMA-7B DeepSpeed config's keys (ZeRO-3 + CPU optimizer offload, fp16, GAS 2, 2 stages,
    autotp 2) with a tiny LLaMA, through `dptrain run` on 8 gloo processes: DP2 x PP2 x TP2, FSDP2
    with CPU offload, GAS -> 2 pipeline micro-batches of one micro-step. Exit 0, loss finite and falling."""
    import math

    import yaml

    from support.run_helpers import dptrain

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(MINI_DS))
    out = tmp_path / "run"
    r = dptrain(
        "run",
        str(ds),
        "model.kwargs.dim=32",
        "model.kwargs.n_layers=4",
        "model.kwargs.n_heads=2",
        "model.kwargs.max_seq_len=32",
        "data.kwargs.seq_len=32",
        "train.max_steps=6",
        "train.log_every_steps=1",
        "train.eval_every_steps=0",
        "parallel.device=cpu",
        "log.progress=false",
        "--nproc-per-node",
        "8",
        "--out",
        str(out),
        timeout=280,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    cfg = yaml.safe_load((out / "config.yaml").read_text())["parallel"]
    assert (cfg["strategy"], cfg["cpu_offload"], cfg["pp"], cfg["tp"], cfg["pp_microbatches"]) == (
        "fsdp",
        True,
        2,
        2,
        2,
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [(rec["step"], rec["loss"]) for rec in records if "loss" in rec]
    print("\nMINIATURE dp2xpp2xtp2 fp16 zero3+offload:", ", ".join(f"{s}:{v:.4f}" for s, v in losses))
    assert [s for s, _ in losses] == list(range(1, 7))
    assert all(math.isfinite(v) for _, v in losses)
    assert losses[-1][1] < losses[0][1]


@pytest.mark.fast
def test_loss_parallel_under_pp_times_tp_exits_2_before_launch(capsys, tmp_path):
    refused(
        capsys,
        [
            "run",
            "--nproc-per-node",
            "4",
            "parallel.pp=2",
            "parallel.tp=2",
            "parallel.loss_parallel=true",
            "log.progress=false",
            "--out",
            str(tmp_path / "r"),
        ],
        "loss_parallel=true is refused with pp > 1",
    )
    assert not (tmp_path / "r").exists()
