"""Pipeline parallelism (parallel.pp > 1): the parity ladder's pipeline rungs, the split, refusals,
resume across layouts. Real gloo ranks forked by tests/support/mp.py; a tiny LLaMA, plain SGD."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dptrain.config import ConfigError
from dptrain.config.load import load_config
from dptrain.config.pipeline import stage_layer_counts
from support import parity as tp
from support.cli import refused
from support.parity import PP_LLAMA, RESUME, dcp_optimizer_state, fit_items, pp_items, pp_rung
from support.parity import records as _records
from support.parity import resolve_items as _resolve


# ------------------------------------------------------------------ parity
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("schedule,stages_per_rank", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_pp2_matches_reference(schedule, stages_per_rank, accum, tmp_path):
    items = pp_items(strategy="ddp", world_size=2, accum=accum, schedule=schedule, stages_per_rank=stages_per_rank)
    diff = pp_rung(items, 2, tmp_path)
    print(f"\nPARITY pp2 {schedule} accum={accum} worst|dw|={diff:.3g}")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("strategy,schedule,stages_per_rank",
                         [("ddp", "1f1b", 1), ("fsdp", "1f1b", 1), ("fsdp", "interleaved_1f1b", 2)])
def test_dp2_pp2_matches_reference(strategy, schedule, stages_per_rank, accum, tmp_path):
    """Each stage data-parallel over 2 ranks; the drift check compares every stage with its replica."""
    items = pp_items(strategy=strategy, world_size=4, accum=accum, schedule=schedule, stages_per_rank=stages_per_rank)
    if strategy == "ddp":
        items.append("diagnostics.drift_every_steps=1")
    diff = pp_rung(items, 4, tmp_path, timeout=200)
    print(f"\nPARITY dp2xpp2 {strategy} {schedule} accum={accum} worst|dw|={diff:.3g}")
    if strategy == "ddp":
        tp.assert_no_drift(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_pp2_clips_by_the_global_norm_over_stages(tmp_path):
    """grad_clip small enough to clip every step: the factor comes from the norm over both stages."""
    items = pp_items(strategy="ddp", world_size=2, accum=2, schedule="1f1b")
    items = [i for i in items if not i.startswith("optim.grad_clip=")] + ["optim.grad_clip=0.05"]
    diff = pp_rung(items, 2, tmp_path, grad_clip=0.05)
    print(f"\nPARITY pp2 1f1b accum=2 grad_clip=0.05 worst|dw|={diff:.3g}")


# ------------------------------------------------------------------ logged loss and evaluation
class PaddedRows(torch.utils.data.Dataset):
    """Mapping samples whose labels end in a random run of -100 (different token counts per row)."""

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (n, seq_len), generator=g)
        self.keep = torch.randint(1, seq_len, (n,), generator=g)

    def __len__(self) -> int:
        return self.tokens.size(0)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.tokens[i, :-1], self.tokens[i, 1:].clone()
        labels[int(self.keep[i]):] = -100
        return {"input_ids": ids, "labels": labels}


def padded_with_val(*, n: int = 64, seq_len: int = 17, vocab_size: int = 256, seed: int = 0):
    """(train, val) of padded rows (data factory `test_pipeline:padded_with_val`)."""
    return PaddedRows(n, seq_len, vocab_size, seed), PaddedRows(16, seq_len, vocab_size, seed + 1)


PADDED_DATA = ["data.factory=test_pipeline:padded_with_val", "train.eval_every_steps=2", "train.eval_batches=2"]


@pytest.fixture(scope="module")
def padded_single_run(tmp_path_factory) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The one-process run every schedule below is compared with (the same for all three): trained once."""
    single = tp.overrides(strategy="single", world_size=1, accum=2, model="llama", global_batch=8)
    single += [f"model.kwargs.{k}={v}" for k, v in PP_LLAMA.items()] + PADDED_DATA
    return tp.train(single, 1, tmp_path_factory.mktemp("pp-single") / "single")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule,stages_per_rank", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_pp2_logs_the_loss_and_val_loss_of_one_process(schedule, stages_per_rank, tmp_path, padded_single_run):
    """The loss lives on the last stage; every rank logs the global batch's loss (token mean over
    rows with different numbers of valid labels), and evaluation (the schedule's forward-only path)
    gives the single process's validation loss."""
    items = pp_items(strategy="ddp", world_size=2, accum=2, schedule=schedule, stages_per_rank=stages_per_rank)
    weights, got = tp.train(items + PADDED_DATA, 2, tmp_path / "pp", timeout=120)
    want_weights, want = padded_single_run
    tp.assert_weights_close(weights, want_weights)  # evaluating between steps changes no gradient
    for key in ("loss", "val_loss"):
        g = [r[key] for r in got if key in r]
        w = [r[key] for r in want if key in r]
        assert len(g) == len(w) > 0 and g == pytest.approx(w, rel=1e-5), key


# ------------------------------------------------------------------ the split
@pytest.mark.fast
def test_stage_layer_counts():
    assert stage_layer_counts(4, 2) == [2, 2]
    assert stage_layer_counts(5, 2) == [3, 2]
    assert stage_layer_counts(8, 4, (1, 3, 3, 1)) == [1, 3, 3, 1]
    with pytest.raises(
        ConfigError, match=r"needs pp x pp_stages_per_rank = 2 entries.*n_layers=4.*3 entries summing to 4"
    ):
        stage_layer_counts(4, 2, (1, 2, 1))
    with pytest.raises(ConfigError, match="n_layers=2 cannot be split into pp x pp_stages_per_rank = 4"):
        stage_layer_counts(2, 4)


@pytest.mark.fast
def test_stages_keep_plain_names_and_eager_weights():
    """Stages cut from the meta model and materialised one by one hold exactly the eager build's
    tensors under the plain names; together they cover the model once."""
    from dptrain.config.fields import ModelConfig
    from dptrain.models.llama import build_llama
    from dptrain.parallel.materialize import make_materializer
    from dptrain.parallel.pipeline import split_llama, stage_ids
    from dptrain.train.build import build_model_meta

    torch.manual_seed(7)
    eager = build_llama(**PP_LLAMA).state_dict()
    rng_after_eager = torch.get_rng_state()
    seen: dict[str, torch.Tensor] = {}
    for pp_rank in range(2):
        meta, reason = build_model_meta(ModelConfig(kwargs=PP_LLAMA), seed=7)
        assert reason is None
        parts = split_llama(meta, stages=stage_ids(pp_rank, pp=2, stages_per_rank=2), layer_counts=[1, 1, 1, 1])
        hook = make_materializer(device="cpu", seed=7).for_part(meta)
        for part in parts:
            hook(part)
            for k, v in part.state_dict().items():
                assert k not in seen
                seen[k] = v
        assert torch.equal(torch.get_rng_state(), rng_after_eager)
        assert any(p.is_meta for p in meta.parameters())  # the other rank's layers were never allocated
    assert seen.keys() == eager.keys()
    for k in eager:
        assert torch.equal(seen[k], eager[k]), k


# ------------------------------------------------------------------ refusals (before launch, exit 2)
@pytest.mark.fast
@pytest.mark.parametrize(
    ("items", "world", "named"),
    [
        (("parallel.pp=2", "model.kwargs.n_layers=1"), 2, ["n_layers=1", "pp x pp_stages_per_rank = 2"]),
        (("parallel.pp=2", "parallel.pp_layers=[1,2]"), 2, ["parallel.pp_layers=[1, 2]", "n_layers=4"]),
        (
            ("parallel.pp=2", "train.global_batch_size=6", "train.micro_batch_size=3", "parallel.pp_microbatches=2"),
            2,
            [
                "train.micro_batch_size=3 is not divisible by parallel.pp_microbatches=2",
                "micro_batch_size 3 x grad_accum_steps 2 x dp 1",
            ],
        ),
        (
            ("parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=1"),
            2,
            ["needs parallel.pp_microbatches >= pp", "pp=2"],
        ),
        (("parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"), 2, ["pp_stages_per_rank >= 2"]),
        (
            ("parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.pp_stages_per_rank=2"),
            2,
            ["needs parallel.pp_schedule=interleaved_1f1b"],
        ),
        (
            (
                "parallel.pp=2",
                "parallel.pp_schedule=interleaved_1f1b",
                "parallel.pp_stages_per_rank=2",
                "train.global_batch_size=10",
                "train.micro_batch_size=5",
                "parallel.pp_microbatches=5",
            ),
            4,
            ["max(1, pp_microbatches // pp) = max(1, 5 // 2) = 2", "got pp_microbatches=5"],
        ),
        (("parallel.pp=2", "parallel.pp_schedule=zigzag"), 2, ["parallel.pp_schedule='zigzag' is not valid"]),
        (
            ("parallel.pp=2", "model.factory=dptrain.models.toy:build_mlp"),
            2,
            ["dptrain.models.toy:build_mlp", "built-in LLaMA"],
        ),
        (("parallel.pp=2", "parallel.strategy=zero1"), 4, ["zero1", "rank 0"]),
        (("parallel.pp=2", "model.kwargs.tie_embeddings=true"), 2, ["tie_embeddings", "first"]),
        (("parallel.pp=2", "parallel.pp_microbatches=0"), 2, ["parallel.pp_microbatches=0 is not valid"]),
        (
            ("parallel.pp=2", "train.loss=dptrain.train.loss:forward_loss"),
            2,
            ["train.loss='dptrain.train.loss:forward_loss'", "last stage"],
        ),
    ],
)
def test_pipeline_refusals(items, world, named):
    with pytest.raises(ConfigError) as err:
        _resolve(*items, world_size=world)
    for n in named:
        assert n in str(err.value), (n, str(err.value))


@pytest.mark.fast
def test_pipeline_refusal_exits_2_before_launch(capsys):
    refused(
        capsys,
        ["run", "--nproc-per-node", "2", "parallel.pp=2", "model.kwargs.n_layers=1", "log.progress=false"],
        "n_layers=1",
        "pp x pp_stages_per_rank = 2",
    )


@pytest.mark.fast
def test_pipeline_layout_resolves():
    res = _resolve(
        "parallel.pp=2",
        "parallel.pp_schedule=interleaved_1f1b",
        "parallel.pp_stages_per_rank=2",
        "train.global_batch_size=16",
        "train.micro_batch_size=4",
        world_size=4,
    )
    assert (res.dims.pp, res.dims.dp_replicate, res.dp_world_size, res.grad_accum_steps) == (2, 2, 2, 2)
    assert res.pipeline == (
        "4 stages (2 per rank), blocks per stage [1, 1, 1, 1], schedule interleaved_1f1b; "
        "each micro-batch of 4 -> 2 pipeline micro-batches of 2"
    )
    assert _resolve("parallel.pp=1").pipeline is None


# ------------------------------------------------------------------ resume across layouts
def _loaded_state_rank(rank: int, items: list[str], out_dir: str, resume: str) -> tuple[dict, dict]:
    """(model state, optimizer tensors by `state.<name>.<key>`) of a Trainer right after resuming."""
    import gc

    from dptrain.checkpoint.state import param_names
    from dptrain.distributed.process_group import process_group
    from dptrain.train.trainer import Trainer

    t = Trainer(load_config(None, items), out_dir=out_dir, resume=resume)
    with process_group(t.env, backend=t.res.backend, device=t.device, timeout_s=60):
        t.setup()
        model = {k: v.detach().clone() for k, v in t.module.state_dict().items()}
        names = param_names(t.model, t.optimizer)
        optim = {
            f"state.{names[i]}.{k}": v.clone()
            for i, st in t.optimizer.state_dict()["state"].items()
            for k, v in st.items()
            if isinstance(v, torch.Tensor)
        }
        t.close()
        t.model = t.parallel.release()
        t.mesh.release()
        del t
        gc.collect()
    return model, optim


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_pipeline_checkpoint_at_dp2_and_single(tmp_path, capsys):
    """pp2 (DCP shards, one stage per rank) -> dp2 (ddp, full format) and -> single: the loaded model
    and optimizer (momentum) state equal the checkpoint's bit for bit; training on from it reaches the
    uninterrupted run's weights and losses; `dptrain ckpt export` gives the plain model's names."""
    from safetensors.torch import load_file

    from dptrain.checkpoint.storage import load_full_model_state
    from dptrain.cli.main import main
    from support.mp import run_ranks

    items = pp_items(strategy="ddp", world_size=2, accum=2, schedule="1f1b") + RESUME
    full_run, records = tp.train(items, 2, tmp_path / "pp2", timeout=120)
    step2 = tmp_path / "pp2" / "checkpoints" / "step_000002"
    model2 = load_full_model_state(step2, fmt="dcp")
    optim2 = dcp_optimizer_state(step2)
    assert model2.keys() == full_run.keys() and optim2
    assert main(["ckpt", "export", str(step2), "--out", str(tmp_path / "export.safetensors")]) == 0
    exported = load_file(str(tmp_path / "export.safetensors"))
    assert exported.keys() == full_run.keys()  # layers.3.attn.wq.weight, ... the plain names
    assert all(torch.equal(exported[k], model2[k]) for k in model2)
    want_losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    for name, strategy, world in (("dp2", "ddp", 2), ("single", "single", 1)):
        base = tp.overrides(
            strategy=strategy, world_size=world, accum=2 if world == 1 else 1, model="llama", global_batch=8
        )
        base += [f"model.kwargs.{k}={v}" for k, v in PP_LLAMA.items()] + RESUME
        # what the trainer holds right after loading, on every rank
        args = (base, str(tmp_path / f"{name}-loaded"), str(step2))
        states = (
            [_loaded_state_rank(0, *args)] if world == 1 else run_ranks(_loaded_state_rank, world, *args, timeout=120)
        )
        for got, optim_here in states:
            assert got.keys() == model2.keys() and all(torch.equal(got[k], model2[k]) for k in model2), name
            assert optim_here.keys() == optim2.keys()
            assert all(torch.equal(optim_here[k], optim2[k]) for k in optim2), name
        # train on to step 4 in the new layout: the uninterrupted pipeline run's weights and losses
        on_dir = tmp_path / f"{name}-on"
        got = _resume(base, world, on_dir, step2)
        tp.assert_weights_close(got, full_run)
        losses = {r["step"]: r["loss"] for r in _records(on_dir) if "loss" in r}
        assert sorted(losses) == [3, 4]
        assert [losses[s] for s in (3, 4)] == pytest.approx([want_losses[s] for s in (3, 4)], rel=1e-5)
        print(
            f"\nRESUME pp2 -> {name}: loaded model/optimizer exact; final worst|dw|="
            f"{tp.max_abs_diff(got, full_run):.3g}"
        )


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_resume_pipeline_checkpoint_at_pp2_restores_each_stages_optimizer(tmp_path):
    """pp2 -> pp2 in a fresh group: the ranks hold different parameters, so each optimizer's hyperparameters must
    come back under its own parameters' names (DCP's flattened layout, format version 3). With the nested layout
    both ranks wrote `param_groups.0.*`, DCP kept rank 0's, and rank 1's optimizer lost its hyperparameters
    (KeyError 'momentum' at its first step). The resumed run ends with the uninterrupted run's weights."""
    items = pp_items(strategy="ddp", world_size=2, accum=2, schedule="1f1b") + RESUME
    full_run, _ = tp.train(items, 2, tmp_path / "pp2", timeout=120)
    got = _resume(items, 2, tmp_path / "again", tmp_path / "pp2" / "checkpoints" / "step_000002")
    assert got.keys() == full_run.keys()
    assert all(torch.equal(got[k], full_run[k]) for k in full_run)


def _resume(items: list[str], world: int, out_dir: Path, resume: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from support.mp import run_ranks

    if world == 1:
        fit_items(0, items, str(out_dir), str(resume))
    else:
        run_ranks(fit_items, world, items, str(out_dir), str(resume), timeout=120)
    return load_file(str(out_dir / "final" / "model.safetensors"))


# ------------------------------------------------------------------ the watchdog
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_watchdog_names_the_rank_the_pipeline_waits_for(tmp_path):
    """pp2: rank 1 (the last stage) sleeps in data loading; rank 0 waits in the schedule's
    send/recv. The watchdog names rank 1 and says where rank 0 waits (phase `pipeline`)."""
    from support.run_helpers import dptrain

    out, mark = tmp_path / "run", tmp_path / "hang-started"
    items = pp_items(strategy="ddp", world_size=2, accum=1, schedule="1f1b")
    items = [i for i in items if not i.startswith(("train.max_steps=", "parallel.timeout_s="))]
    r = dptrain(
        "run",
        *items,
        "train.max_steps=1000",
        "data.collate=support.diag_helpers:sleepy_collate",
        "diagnostics.hang_timeout_s=3",
        "--nproc-per-node",
        "2",
        "--out",
        str(out),
        env={"HANG_RANK": "1", "HANG_STEP": "3", "HANG_MARK": str(mark)},
        timeout=140,
    )
    assert r.returncode != 0, r.stdout[-2000:]
    assert "exit 3" in r.stderr, r.stderr[-2000:]
    report = (out / "hang_report.txt").read_text()
    assert "suspect rank(s): rank 1 (" in report, report
    stacks = {rank: (out / "stacks" / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    assert "in sleepy_collate" in stacks[1]
    assert "phase pipeline" in stacks[0], stacks[0][:2000]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_dp2_pp2_fsdp_checkpoint_at_pp2_with_another_split(tmp_path):
    """dp2 x pp2 (FSDP2 shards within each stage, layers [2, 2]) -> pp2 with layers [1, 3] and
    gpipe: DCP reshards the stages' shards into the new split; the loaded state is exact."""
    from dptrain.checkpoint.storage import load_full_model_state
    from support.mp import run_ranks

    items = pp_items(strategy="fsdp", world_size=4, accum=1, schedule="1f1b") + RESUME
    tp.train(items, 4, tmp_path / "dp2pp2", timeout=200)
    step2 = tmp_path / "dp2pp2" / "checkpoints" / "step_000002"
    model2, optim2 = load_full_model_state(step2, fmt="dcp"), dcp_optimizer_state(step2)
    other = pp_items(strategy="ddp", world_size=2, accum=2, schedule="gpipe") + RESUME + ["parallel.pp_layers=[1,3]"]
    states = run_ranks(_loaded_state_rank, 2, other, str(tmp_path / "pp2-loaded"), str(step2), timeout=120)
    seen_model: dict[str, torch.Tensor] = {}
    seen_optim: dict[str, torch.Tensor] = {}
    for model, optim in states:  # each rank holds its stage's part under the plain names
        seen_model.update(model)
        seen_optim.update(optim)
    assert seen_model.keys() == model2.keys() and all(torch.equal(seen_model[k], model2[k]) for k in model2)
    assert seen_optim.keys() == optim2.keys() and all(torch.equal(seen_optim[k], optim2[k]) for k in optim2)
    assert sorted(k.split(".")[1] for k in states[0][0] if k.startswith("layers.") and k.endswith("wq.weight")) == ["0"]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_pp2_with_activation_checkpointing_matches_reference(mode, tmp_path):
    items = pp_items(strategy="ddp", world_size=2, accum=2, schedule="1f1b")
    diff = pp_rung(items + [f"parallel.activation_checkpointing={mode}"], 2, tmp_path)
    print(f"\nPARITY pp2 1f1b accum=2 activation_checkpointing={mode} worst|dw|={diff:.3g}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_pp2_fp16_skips_overflowing_steps_on_every_stage(tmp_path):
    """fp16 under PP: the last stage scales the loss inside the schedule's loss_fn, every stage
    unscales, and the sharded scaler agrees on overflow over all ranks: a scale too large for fp16
    skips the same first steps on both stages, then training goes on (close to fp32 with those skips)."""
    items = pp_items(strategy="ddp", world_size=2, accum=2, schedule="1f1b")
    items += ["precision.dtype=fp16", f"precision.init_scale={2**24}"]
    got, records = tp.train(items, 2, tmp_path, timeout=120)
    steps = [r for r in records if "loss" in r]
    counts = [0] + [r["skipped_steps"] for r in steps]
    skip = frozenset(i for i in range(tp.STEPS) if counts[i + 1] > counts[i])
    assert 0 < len(skip) < tp.STEPS, f"the test needs some skipped and some applied steps, got {counts}"
    assert steps[-1]["loss_scale"] == 2**24 / 2 ** len(skip)
    saved = tp.MODELS["llama"]["kwargs"]
    tp.MODELS["llama"]["kwargs"] = PP_LLAMA
    try:
        want, _ = tp.reference("llama", global_batch=8, skip=skip)
    finally:
        tp.MODELS["llama"]["kwargs"] = saved
    tp.assert_weights_close(got, want, rtol=1e-3, atol=1e-4)
    print(f"\nPARITY pp2 1f1b accum=2 fp16 (skipped {sorted(skip)}) worst|dw|={tp.max_abs_diff(got, want):.3g}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dp2_pp2_zero2_cpu_offload_matches_reference(tmp_path):
    items = pp_items(strategy="zero2", world_size=4, accum=2, schedule="gpipe") + ["parallel.cpu_offload=true"]
    diff = pp_rung(items, 4, tmp_path, timeout=200)
    print(f"\nPARITY dp2xpp2 zero2+cpu_offload gpipe accum=2 worst|dw|={diff:.3g}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hsdp_pp2_matches_reference(tmp_path):
    """8 ranks: 2 stages, each sharded over 2 ranks and replicated twice (HSDP)."""
    items = pp_items(strategy="fsdp", world_size=8, accum=1, schedule="1f1b")
    items += ["parallel.dp_replicate=2", "parallel.dp_shard=2"]
    diff = pp_rung(items, 8, tmp_path, timeout=280)
    print(f"\nPARITY hsdp(2x2)xpp2 fsdp 1f1b accum=1 worst|dw|={diff:.3g}")
