"""The parity ladder: every strategy x accumulation x world size matches one plain process.

Reference: a single process of plain PyTorch (no dptrain training code) that takes, at every
step, the mean loss over the whole global batch (the samples `GlobalBatchSampler` assigns to
that step), backward, plain `torch.optim.SGD`. Candidate: `dptrain.train.trainer.Trainer(cfg).fit()`
on W forked gloo ranks. The final weights (`final/model.safetensors`) must agree to float32
round-off. Plain SGD, not Adam: Adam is nearly scale-invariant and would hide a missing loss
division or a sum-instead-of-mean gradient reduction.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from dptrain.config.load import load_config
from dptrain.train.trainer import Trainer
from support.mp import run_ranks
from support.parity import (
    ATOL,
    GLOBAL_BATCH,
    HSDP,
    LR,
    MULTI,
    STEPS,
    assert_no_drift,
    assert_weights_close,
    ladder_case,
    max_abs_diff,
    overrides,
    reference,
    train,
)


# ------------------------------------------------------------------ the ladder
@pytest.mark.timeout(60)
@pytest.mark.parametrize("accum", [1, 2])
def test_single_matches_reference(accum, tmp_path):
    ladder_case("single", accum, 1, tmp_path)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("strategy", MULTI)
def test_strategy_matches_reference(strategy, accum, world_size, tmp_path):
    ladder_case(strategy, accum, world_size, tmp_path)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_llama_matches_reference(strategy, tmp_path):
    ladder_case(strategy, 2, 2, tmp_path, model="llama")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("accum", [1, 2])
def test_hsdp_matches_reference(accum, tmp_path):
    """fsdp on a 2 x 2 (dp_replicate, dp_shard) mesh: shards reduce-scattered within a pair, all-reduced
    across the two replicas; the drift check compares each shard with its other replica every step."""
    ladder_case("fsdp", accum, 4, tmp_path, extra=(*HSDP, "diagnostics.drift_every_steps=1"), timeout=120)
    assert_no_drift(tmp_path)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "strategy,mode,world_size,model",
    [("single", "full", 1, "mlp"), ("ddp", "selective", 2, "mlp"), ("fsdp", "full", 2, "mlp"),
     ("zero2", "selective", 2, "mlp"), ("fsdp", "selective", 2, "llama"),
     ("single", "selective_torchtitan", 1, "llama"), ("fsdp", "selective_torchtitan", 2, "llama")],
)
def test_activation_checkpointing_matches_reference(strategy, mode, world_size, model, tmp_path):
    """Recomputing activations in backward replays the same ops: the same weights as without it."""
    ladder_case(strategy, 2, world_size, tmp_path, model=model, extra=(f"parallel.activation_checkpointing={mode}",))


@pytest.mark.timeout(60)
def test_tolerance_detects_a_missing_loss_division():
    """The ladder's tolerance is far tighter than the error of the bugs it is meant to catch:
    gradients summed over 2 micro-batches instead of averaged = a doubled learning rate."""
    want, _ = reference(global_batch=8)
    doubled, _ = reference(global_batch=8, lr=2 * LR)
    assert max_abs_diff(doubled, want) > 1000 * ATOL


OPTIONS = {
    "sync_each_micro_step": (["parallel.sync_each_micro_step=true"], {}),
    "momentum_weight_decay": (["optim.momentum=0.9", "optim.weight_decay=0.1"], {"momentum": 0.9, "weight_decay": 0.1}),
    "tiny_ddp_buckets": (["parallel.bucket_cap_mb=0.0001"], {}),
    "cpu_offload": (["parallel.cpu_offload=true"], {}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "strategy,option",
    [("ddp", "sync_each_micro_step"), ("fsdp", "sync_each_micro_step"), ("zero1", "momentum_weight_decay"),
     ("fsdp", "momentum_weight_decay"), ("ddp", "tiny_ddp_buckets"), ("fsdp", "cpu_offload"), ("zero2", "cpu_offload")],
)
def test_option_matches_reference(strategy, option, tmp_path):
    """Options that change how (not what) is reduced or stepped keep parity; momentum and weight
    decay also exercise the optimizer state (sharded under zero1 and fsdp) across steps."""
    extra, ref_kwargs = OPTIONS[option]
    items = overrides(strategy=strategy, world_size=2, accum=2) + extra  # later overrides win
    got, _ = train(items, 2, tmp_path)
    want, _ = reference(global_batch=GLOBAL_BATCH[2], **ref_kwargs)
    assert_weights_close(got, want)
    if ref_kwargs:
        plain, _ = reference(global_batch=GLOBAL_BATCH[2])
        assert max_abs_diff(plain, want) > 1000 * ATOL, "the option must change the result to be tested"


# ------------------------------------------------------------------ clipping under sharding
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_grad_clip_matches_reference(strategy, tmp_path):
    clip = 0.01
    items = overrides(strategy=strategy, world_size=2, accum=2, grad_clip=clip)
    got, records = train(items, 2, tmp_path)
    want, norms = reference(global_batch=GLOBAL_BATCH[2], grad_clip=clip)
    assert min(norms) > 10 * clip, "the clip must be active at every step for this test to mean anything"
    assert_weights_close(got, want)
    assert [r["grad_norm"] for r in records if "grad_norm" in r] == pytest.approx(norms, rel=1e-4)
    unclipped, _ = reference(global_batch=GLOBAL_BATCH[2])
    assert max_abs_diff(unclipped, want) > 1000 * ATOL


# ------------------------------------------------------------------ mixed precision
@pytest.mark.timeout(90)
def test_bf16_fsdp_agrees_with_ddp(tmp_path):
    runs = {}
    for strategy in ("ddp", "fsdp"):
        items = overrides(strategy=strategy, world_size=2, accum=2, dtype="bf16")
        runs[strategy], _ = train(items, 2, tmp_path / strategy)
    fp32, _ = reference(global_batch=GLOBAL_BATCH[2])
    init = reference(global_batch=GLOBAL_BATCH[2], steps=0)[0]
    for k in fp32:
        assert torch.isfinite(runs["fsdp"][k]).all() and runs["fsdp"][k].dtype == torch.float32
    # Not bit-equal (different reduction order of bf16-rounded partial products), but close,
    # and both close to the fp32 reference on the scale of the update itself.
    update = max_abs_diff(fp32, init)
    assert max_abs_diff(runs["fsdp"], runs["ddp"]) < 0.05 * update
    assert_weights_close(runs["fsdp"], runs["ddp"], rtol=2e-2, atol=2e-3)
    assert max_abs_diff(runs["ddp"], fp32) < 0.2 * update
    assert max_abs_diff(runs["ddp"], fp32) > 10 * ATOL, "bf16 autocast seems not to be applied"


@pytest.mark.timeout(90)
def test_bf16_params_fsdp_matches_reference(tmp_path):
    """Pure-bf16 parameters (FSDP2 gathers bf16, reduce-scatters fp32 gradients, steps fp32 shards) on the
    LLaMA rung: fp32 weights out, within the bf16 autocast rung's tolerance of the fp32 reference, close to
    the autocast path and not identical to it (the gather dtype is applied)."""
    runs = {}
    for name, dtypes in {"autocast": ("fp32", "fp32"), "params": ("bf16", "fp32")}.items():
        items = overrides(strategy="fsdp", world_size=2, accum=2, model="llama", dtype="bf16") + [
            f"parallel.fsdp_param_dtype={dtypes[0]}", f"parallel.fsdp_reduce_dtype={dtypes[1]}"]
        runs[name], _ = train(items, 2, tmp_path / name)
    fp32, _ = reference("llama", global_batch=GLOBAL_BATCH[2])
    update = max_abs_diff(fp32, reference("llama", global_batch=GLOBAL_BATCH[2], steps=0)[0])
    for k in fp32:
        assert torch.isfinite(runs["params"][k]).all() and runs["params"][k].dtype == torch.float32
    assert max_abs_diff(runs["params"], fp32) < 0.2 * update
    assert max_abs_diff(runs["autocast"], fp32) < 0.2 * update
    assert max_abs_diff(runs["params"], fp32) > 10 * ATOL, "bf16 seems not to be applied"
    assert_weights_close(runs["params"], runs["autocast"], rtol=2e-2, atol=2e-3)
    assert max_abs_diff(runs["params"], runs["autocast"]) > 0, "parallel.fsdp_param_dtype=bf16 seems not to be applied"


@pytest.mark.timeout(90)
def test_selective_checkpointing_under_bf16_params_matches_no_checkpointing(tmp_path):
    """torchtitan's recipe: FSDP2 gathering bf16 parameters (its pre-forward hook casts each block's inputs, inside
    the recompute in backward) under both selective policies: the weights of the run without checkpointing."""
    runs = {}
    for mode in ("none", "selective", "selective_torchtitan"):
        items = overrides(strategy="fsdp", world_size=2, accum=2, model="llama", dtype="bf16") + [
            "parallel.fsdp_param_dtype=bf16", "parallel.fsdp_reduce_dtype=fp32",
            f"parallel.activation_checkpointing={mode}"]
        runs[mode], _ = train(items, 2, tmp_path / mode)
    for mode in ("selective", "selective_torchtitan"):
        assert_weights_close(runs[mode], runs["none"])


@pytest.mark.timeout(60)
def test_fp16_zero2_runs_and_stays_finite(tmp_path):
    items = overrides(strategy="zero2", world_size=2, accum=2, dtype="fp16")
    got, records = train(items, 2, tmp_path)
    init = reference(global_batch=GLOBAL_BATCH[2], steps=0)[0]
    assert all(torch.isfinite(v).all() for v in got.values())
    steps = [r for r in records if "loss" in r]
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert "loss_scale" in steps[-1] and "skipped_steps" in steps[-1]
    if steps[-1]["skipped_steps"] < STEPS:
        assert max_abs_diff(got, init) > 0, "a step that was not skipped must change the weights"


@pytest.mark.timeout(60)
def test_fp16_zero2_skips_overflowing_steps_on_every_rank(tmp_path):
    """A loss scale too large for fp16 overflows the first steps: the sharded scaler must skip them
    on every rank (else the shards would diverge) and halve the scale, then train normally."""
    items = overrides(strategy="zero2", world_size=2, accum=2, dtype="fp16") + [f"precision.init_scale={2**18}"]
    got, records = train(items, 2, tmp_path)
    steps = [r for r in records if "loss" in r]
    skipped_counts = [0] + [r["skipped_steps"] for r in steps]
    skip = frozenset(i for i in range(STEPS) if skipped_counts[i + 1] > skipped_counts[i])
    assert 0 < len(skip) < STEPS, f"the test needs some skipped and some applied steps, got {skipped_counts}"
    assert steps[-1]["loss_scale"] == 2**18 / 2 ** len(skip)
    want, _ = reference(global_batch=GLOBAL_BATCH[2], skip=skip)
    unskipped, _ = reference(global_batch=GLOBAL_BATCH[2])
    # fp16 autocast is not bit-equal to fp32, but far closer than a wrongly applied step.
    assert_weights_close(got, want, rtol=1e-3, atol=1e-4)
    assert max_abs_diff(unskipped, want) > 10 * 1e-4


def _ddp_wrappers_after_fit(rank: int, items: list[str], out_dir: str) -> int:
    trainer = Trainer(load_config(None, items), out_dir=out_dir)
    trainer.fit()
    gc.collect()
    return sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())


@pytest.mark.timeout(60)
def test_no_ddp_reducer_outlives_fit(tmp_path):
    """The deadlock itself is a rare race; its precondition is deterministic: after fit() returns,
    no DDP wrapper (whose C++ Reducer holds the destroyed gloo group) may still be alive."""
    counts = run_ranks(_ddp_wrappers_after_fit, 2, overrides(strategy="ddp", world_size=2, accum=1, steps=1),
                       str(tmp_path), timeout=40)
    assert counts == [0, 0], f"DDP wrappers alive after fit() on each rank: {counts}"
