"""Tensor parallelism: the parity ladder against one plain process, the refusals before launch,
and checkpoints that move between tensor-parallel and data-parallel layouts.

Each rung trains the tiny LLaMA of the parity ladder with plain SGD on forked gloo ranks
(`tests/support/mp.py`) and compares the final weights with the single-process reference of
`tests/support/parity.py`, at the DP rungs' tolerance (rtol 1e-5, atol 1e-6), and the logged
gradient norm with the reference's at every step. A tp rank group shares its dp rank's batch, so
the global batch is split over dp only.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from support import overrides as join
from support import parity as tp
from support.checkpoints import assert_restored_exactly, fit_capturing
from support.cli import refused
from support.parity import GLOBAL, tp_case

warnings.filterwarnings("ignore", message=".*sequential all_(reduce|gather).*")

# ------------------------------------------------------------------ the parity ladder
@pytest.mark.timeout(120)
@pytest.mark.parametrize("accum", [1, 2])
def test_tp2_matches_reference(accum, tmp_path):
    tp_case("tp2", accum, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("rung", ["dp2xtp2", "fsdp2xtp2", "zero2xtp2"])
def test_dp_times_tp_matches_reference(rung, accum, tmp_path):
    """4 ranks: 2 data-parallel replicas (ddp: FSDP2's replicate; fsdp/zero2: 2 shards) of a model split over 2.
    Under ddp the drift check compares each tp shard with its replica every step."""
    drift = ("diagnostics.drift_every_steps=1",) if rung == "dp2xtp2" else ()
    tp_case(rung, accum, tmp_path, *drift)
    if drift:
        tp.assert_no_drift(tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("label", "extra"), [
    ("no sequence parallel", ("parallel.sequence_parallel=false",)),
    ("loss parallel", ("parallel.loss_parallel=true",)),
    ("activation checkpointing full", ("parallel.activation_checkpointing=full",)),
    ("activation checkpointing selective", ("parallel.activation_checkpointing=selective",)),
])
def test_tp2_options_match_reference(label, extra, tmp_path):
    tp_case("tp2", 2, tmp_path, *extra)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("rung", "extra"), [
    ("fsdp2xtp2", ("parallel.sequence_parallel=false",)),  # norms on the dp mesh only, matrices on (dp, tp)
    ("dp2xtp2", ("parallel.loss_parallel=true", "parallel.activation_checkpointing=full")),
])
def test_dp_times_tp_options_match_reference(rung, extra, tmp_path):
    tp_case(rung, 2, tmp_path, *extra)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("label", "strategy", "dp", "world", "extra"), [
    ("hsdp 2x2 x tp2", "fsdp", 4, 8, ("parallel.dp_replicate=2", "parallel.dp_shard=2")),
    ("fsdp2 x tp2 cpu offload", "fsdp", 2, 4, ("parallel.cpu_offload=true",)),
])
def test_more_layouts_with_tp_match_reference(label, strategy, dp, world, extra, tmp_path):
    """3-D DTensors (HSDP over tp, 8 ranks) and FSDP2's CPU offload over tp."""
    items = [*tp.overrides(strategy=strategy, world_size=dp, accum=1, model="llama", global_batch=GLOBAL),
             "parallel.tp=2", *extra]
    got, _ = tp.train(items, world, tmp_path, timeout=280)
    tp.assert_weights_close(got, tp.reference("llama", global_batch=GLOBAL)[0])


@pytest.mark.timeout(120)
def test_fp16_under_tp_stays_close_to_fp32(tmp_path):
    """fp16 autocast with the sharded grad scaler (DTensor gradients): close to fp32, as the DP fp16 rungs."""
    items = [*tp.overrides(strategy="ddp", world_size=1, accum=2, model="llama", global_batch=GLOBAL, dtype="fp16"),
             "parallel.tp=2"]
    got, records = tp.train(items, 2, tmp_path, timeout=100)
    assert all(r["skipped_steps"] == 0 for r in records if "loss" in r)
    tp.assert_weights_close(got, tp.reference("llama", global_batch=GLOBAL)[0], rtol=1e-3, atol=1e-4)


@pytest.mark.timeout(120)
def test_users_own_plan_matches_reference(tmp_path):
    """parallel.tp_plan: the toy MLP split by the user's function (tests/support/tp_plans.py)."""
    got, _ = tp.train([*tp.overrides(strategy="ddp", world_size=1, accum=2, global_batch=GLOBAL),
                       "parallel.tp=2", "parallel.tp_plan=support.tp_plans:mlp_plan"], 2, tmp_path, timeout=100)
    want, _ = tp.reference("mlp", global_batch=GLOBAL)
    tp.assert_weights_close(got, want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rung", ["tp2", pytest.param("fsdp2xtp2", marks=pytest.mark.slow)])
def test_grad_clip_under_tp_matches_reference(rung, tmp_path):
    """The clipped norm is the global one over tp shards, dp shards and replicated norm weights."""
    clip = 0.05
    _, norms = tp.reference("llama", global_batch=GLOBAL, grad_clip=clip)
    assert min(norms) > 5 * clip, "the clip must be active at every step for this test to mean anything"
    tp_case(rung, 2, tmp_path, model="llama", grad_clip=clip)
    unclipped, _ = tp.reference("llama", global_batch=GLOBAL)
    clipped, _ = tp.reference("llama", global_batch=GLOBAL, grad_clip=clip)
    assert tp.max_abs_diff(unclipped, clipped) > 1000 * tp.ATOL


# ------------------------------------------------------------------ refusals before launch
BUILTIN = ["model.kwargs.dim=32", "model.kwargs.n_layers=1", "model.kwargs.max_seq_len=32", "data.kwargs.seq_len=32",
           "train.max_steps=1", "log.progress=false", "--nproc-per-node", "2"]
TOY = ["model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
       "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}"]


@pytest.mark.fast
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["model.kwargs.n_heads=3", "model.kwargs.dim=48"],
            ["model.kwargs.n_heads=3 is not divisible by parallel.tp=2"],
        ),
        (["model.kwargs.n_kv_heads=1"], ["model.kwargs.n_kv_heads=1 is not divisible by parallel.tp=2"]),
        (["model.kwargs.ffn_hidden=33"], ["model.kwargs.ffn_hidden=33 is not divisible by parallel.tp=2"]),
        (["model.kwargs.vocab_size=257"], ["model.kwargs.vocab_size=257 is not divisible by parallel.tp=2"]),
        (
            ["data.kwargs.seq_len=31"],
            ["input sequence length 31 is not divisible by parallel.tp=2", "parallel.sequence_parallel=false"],
        ),
        (
            ["model.kwargs.tie_embeddings=true"],
            ["parallel.tp=2 with model.kwargs.tie_embeddings=true is refused", "unties"],
        ),
        (["parallel.strategy=zero1"], ["parallel.strategy='zero1' with parallel.tp=2 is refused", "zero2"]),
        (TOY, ["ToyMLP has no tensor-parallel plan", "parallel.tp_plan=pkg.mod:fn"]),
        (["parallel.tp_plan=nosuch.mod:fn"], ["parallel.tp_plan='nosuch.mod:fn' cannot be used", "nosuch"]),
        (
            ["parallel.tp_plan=support.tp_plans:not_callable"],
            ["parallel.tp_plan='support.tp_plans:not_callable'", "not callable"],
        ),
        (["parallel.tp_plan=no_import_path"], ["parallel.tp_plan='no_import_path' is not an import path"]),
        (["parallel.tp=3", "--nproc-per-node", "3"], ["model.kwargs.n_heads=4 is not divisible by parallel.tp=3"]),
    ],
)
def test_tp_refusals_before_launch(capsys, tmp_path, overrides, named):
    over = overrides if any(o.startswith("parallel.tp=") for o in overrides) else ["parallel.tp=2", *overrides]
    base = BUILTIN[:-2] if "--nproc-per-node" in over else BUILTIN  # an option is given once
    refused(capsys, ["run", *join(base, over), "--out", str(tmp_path / "r")], *named)
    assert not (tmp_path / "r").exists()


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_sequence_length_is_not_checked_without_sequence_parallelism(tmp_path):
    from dptrain.config.load import load_config
    from dptrain.launch.checks import check_model, check_tensor_parallel

    cfg = load_config(None, ["model.kwargs.dim=32", "parallel.sequence_parallel=false"])
    model = check_model(cfg.model)
    check_tensor_parallel(model, parallel=cfg.parallel, tp=2, sample=torch.zeros(32, dtype=torch.long))  # 31 inputs


# ------------------------------------------------------------------ checkpoints across layouts
LLAMA = [f"model.kwargs.{k}={v}" for k, v in tp.LLAMA_KWARGS.items()] + [
    "data.factory=support.parity:tiny_tokens",
    *(f"data.kwargs.{k}={v}" for k, v in tp.TOKENS_KWARGS.items()),
    "model.factory=dptrain.models.llama:build_llama",
    "optim.name=sgd",
    "optim.momentum=0.9",
    "optim.weight_decay=0.1",
]
LAYOUTS = {  # name -> (world size, overrides)
    "tp2": (2, ["parallel.strategy=ddp", "parallel.tp=2"]),
    "dp2xtp2": (4, ["parallel.strategy=ddp", "parallel.tp=2"]),
    "fsdp2xtp2": (4, ["parallel.strategy=fsdp", "parallel.tp=2"]),
    "dp2": (2, ["parallel.strategy=ddp"]),
    "fsdp2": (2, ["parallel.strategy=fsdp"]),
    "single": (1, ["parallel.strategy=single"]),
}


def _fit_capturing(rank, out, overrides, what):
    return fit_capturing(rank, out, [*LLAMA, *overrides], what)


def _capture_run(layout: str, run: Path, steps: int, what: str) -> None:
    from support.mp import run_ranks

    world, over = LAYOUTS[layout]
    run_ranks(
        _fit_capturing, world, run, [f"train.max_steps={steps}", "checkpoint.every_steps=3", *over], what, timeout=150
    )


@pytest.fixture(scope="module")
def tp2_saved(tmp_path_factory) -> Path:
    """A tp2 run saved at step 3 (and its `saved_3.pt`): where every test that starts from tp2 starts,
    on a copy of its own."""
    run = tmp_path_factory.mktemp("tp2") / "run"
    _capture_run("tp2", run, 3, "saved")
    return run


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("tp2", "dp2"),
        ("tp2", "single"),
        ("dp2", "tp2"),
        ("tp2", "fsdp2"),
        pytest.param("dp2xtp2", "tp2", marks=pytest.mark.slow),
        pytest.param("fsdp2xtp2", "single", marks=pytest.mark.slow),
    ],
)
def test_resume_across_tp_layouts_restores_model_and_optimizer_exactly(request, tmp_path, before, after):
    """Saved at step 3 in one layout, resumed in another: the whole model and momentum state
    equal bit for bit, and training continues at step 4 with the same global batch."""
    run = tmp_path / "run"
    if before == "tp2":  # the same saved run for every tp2 start: trained once (tp2_saved), copied
        shutil.copytree(request.getfixturevalue("tp2_saved"), run)
    else:
        _capture_run(before, run, 3, "saved")
    _capture_run(after, run, 5, "loaded")
    assert_restored_exactly(run, 3, ("momentum_buffer",))
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted({s for s in steps if s}) == [1, 2, 3, 4, 5]


@pytest.mark.timeout(120)
def test_export_of_a_tp_checkpoint_has_the_plain_names(tp2_saved, tmp_path):
    import argparse

    from safetensors.torch import load_file

    from dptrain.cli.ckpt import cmd_export

    run = tmp_path / "run"
    shutil.copytree(tp2_saved, run)
    assert (run / "checkpoints" / "step_000003" / "dcp").is_dir()  # DTensor parameters: DCP shards
    out = tmp_path / "exported.safetensors"
    assert cmd_export(argparse.Namespace(target=str(run), out=str(out), trust_checkpoint=False)) == 0
    exported, final = load_file(out), load_file(run / "final" / "model.safetensors")
    assert exported.keys() == final.keys() and "layers.0.attn.wq.weight" in exported
    for k in final:
        assert torch.equal(exported[k], final[k]), k


# ------------------------------------------------------------------ diagnostics
@pytest.mark.timeout(150)
def test_a_rank_asleep_is_named_while_its_tp_partner_waits_in_a_tp_collective(tmp_path):
    """Through `dptrain run` and torchrun: tp rank 1 sleeps before its forward at step 3; rank 0
    blocks in the forward's first tensor-parallel collective; the watchdog names rank 1."""
    import re

    from dptrain.diagnostics.watchdog import EXIT_HANG
    from support.diag_helpers import TP_LLAMA
    from support.run_helpers import dptrain

    out, mark = tmp_path / "run", tmp_path / "hang-started"
    r = dptrain(
        "run",
        *TP_LLAMA,
        "train.max_steps=1000",
        "train.loss=support.diag_helpers:sleepy_loss",
        "parallel.tp=2",
        "diagnostics.hang_timeout_s=3",
        "--nproc-per-node",
        "2",
        "--out",
        str(out),
        env={"HANG_RANK": "1", "HANG_STEP": "3", "HANG_MARK": str(mark)},
    )
    assert r.returncode == EXIT_HANG or f"exit {EXIT_HANG}" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    report = (out / "hang_report.txt").read_text()
    assert "suspect rank(s): rank 1 (" in report, report
    stacks = {rank: (out / "stacks" / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    assert "in sleepy_loss" in stacks[1] and "at step 3, phase forward" in stacks[0]
    where = dict(re.findall(r"^\s+(\d+)\s+\S+\s+\d+\s+3\s+\w+.*\n\s+at (.+)$", report, re.M))
    assert re.search(r"torch/(distributed/|_ops.py)", where["0"]), report  # the dispatcher, inside a DTensor collective
    assert "_functional_collectives.py" in stacks[0] and "not inside torch.distributed" in report


# ------------------------------------------------------------------ Hugging Face's own plan
@pytest.mark.timeout(150)
def test_hf_llama_split_by_its_own_plan_matches_reference(tmp_path):
    """LlamaForCausalLM under tp2 through its `config.base_model_tp_plan` (translated into PyTorch's
    Colwise/RowwiseParallel) matches one plain process, as its ddp rung in test_hf_models.py does."""
    pytest.importorskip("transformers")
    from support import hf

    items = [*hf.overrides("llama", "ddp"), "parallel.tp=2", "train.micro_batch_size=8"]
    got, _ = tp.train(items, 2, tmp_path, timeout=140)
    tp.assert_weights_close(got, hf.reference("llama"))


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_hf_shapes_that_cannot_be_split_are_refused():
    transformers = pytest.importorskip("transformers")
    from dptrain.parallel.tensor import tp_problem

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=3,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    why = tp_problem(model, tp=2, tp_plan=None, sequence_parallel=True)
    assert why is not None and "config.num_attention_heads=3 is not divisible by parallel.tp=2" in why
