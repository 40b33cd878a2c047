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
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, default_collate

from dptrain.config.load import load_config
from dptrain.data import GlobalBatchSampler
from dptrain.models.llama import build_llama
from dptrain.models.toy import build_mlp, build_regression_data
from dptrain.train.trainer import Trainer
from mp import run_ranks

SEED = 1234
STEPS = 4
LR = 0.05
RTOL, ATOL = 1e-5, 1e-6

MLP_KWARGS = {"in_dim": 8, "hidden": 16, "out_dim": 4, "depth": 2}
MLP_DATA_KWARGS = {"n": 96, "in_dim": 8, "out_dim": 4, "seed": 0}
LLAMA_KWARGS = {"dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 16}
TOKENS_KWARGS = {"n": 64, "seq_len": 17, "vocab_size": 256, "seed": 0}

MULTI = ("ddp", "zero1", "zero2", "fsdp")
GLOBAL_BATCH = {1: 8, 2: 8, 3: 12, 4: 8}  # divisible by world_size * accum for accum in (1, 2)
HSDP = ("parallel.dp_replicate=2", "parallel.dp_shard=2")  # 4 ranks: 2 replicas x 2 shards


# ------------------------------------------------------------------ a custom data factory
class TokenRows(Dataset):
    """Rows of token ids ``[seq_len]``: a batch is the ``[B, seq_len]`` LongTensor LlamaLM expects."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.size(0)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


def tiny_tokens(*, n: int = 64, seq_len: int = 17, vocab_size: int = 256, seed: int = 0) -> TokenRows:
    """Random token sequences (data factory `test_parity:tiny_tokens`)."""
    g = torch.Generator().manual_seed(seed)
    return TokenRows(torch.randint(0, vocab_size, (n, seq_len), generator=g))


MODELS: dict[str, dict[str, Any]] = {
    "mlp": {
        "factory": "dptrain.models.toy:build_mlp", "build": build_mlp, "kwargs": MLP_KWARGS,
        "data_factory": "dptrain.models.toy:build_regression_data", "data": build_regression_data,
        "data_kwargs": MLP_DATA_KWARGS,
    },
    "llama": {
        "factory": "dptrain.models.llama:build_llama", "build": build_llama, "kwargs": LLAMA_KWARGS,
        "data_factory": "test_parity:tiny_tokens", "data": tiny_tokens, "data_kwargs": TOKENS_KWARGS,
    },
}


# ------------------------------------------------------------------ reference and candidate
def reference(
    model: str = "mlp", *, global_batch: int, steps: int = STEPS, lr: float = LR, grad_clip: float | None = None,
    skip: frozenset[int] = frozenset(), momentum: float = 0.0, weight_decay: float = 0.0,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain single-process PyTorch on the global batch: (final state dict, pre-clip grad norm per step).
    Steps in `skip` consume their batch but do not update (an fp16 overflow). Weight decay applies
    to matrices only, not to biases and norm gains (dptrain's documented policy)."""
    spec = MODELS[model]
    ds = spec["data"](**spec["data_kwargs"])
    torch.manual_seed(SEED)
    net = spec["build"](**spec["kwargs"])
    groups = [
        {"params": [p for p in net.parameters() if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in net.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.SGD(groups, lr=lr, momentum=momentum)
    order = GlobalBatchSampler(
        dataset_len=len(ds), global_batch_size=global_batch, micro_batch_size=global_batch,
        grad_accum_steps=1, dp_rank=0, dp_world_size=1, seed=SEED, shuffle=True,
    )
    norms = []
    for step in range(steps):
        batch = default_collate([ds[i] for i in order.global_batch_indices(step)])
        loss = net(batch)  # mean over the whole global batch
        loss.backward()
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        if grad_clip is None:
            norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), grad_clip)))
        if step not in skip:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, norms


def overrides(
    *, strategy: str, world_size: int, accum: int, model: str = "mlp", steps: int = STEPS,
    grad_clip: float | None = None, dtype: str = "fp32", global_batch: int | None = None,
) -> list[str]:
    spec = MODELS[model]
    g = global_batch or GLOBAL_BATCH[world_size]
    assert g % (world_size * accum) == 0
    out = [
        f"model.factory={spec['factory']}",
        *(f"model.kwargs.{k}={v}" for k, v in spec["kwargs"].items()),
        f"data.factory={spec['data_factory']}",
        *(f"data.kwargs.{k}={v}" for k, v in spec["data_kwargs"].items()),
        "data.num_workers=0",
        "optim.name=sgd", f"optim.lr={LR}", "optim.weight_decay=0", "optim.momentum=0",
        "optim.warmup_steps=0", "optim.schedule=constant",
        f"optim.grad_clip={'null' if grad_clip is None else grad_clip}",
        f"train.max_steps={steps}", f"train.seed={SEED}", "train.eval_batches=1", "train.log_every_steps=1",
        f"train.global_batch_size={g}", f"train.micro_batch_size={g // (world_size * accum)}",
        f"train.grad_accum_steps={accum}",
        f"parallel.strategy={strategy}", "parallel.device=cpu", "parallel.timeout_s=60",
        f"precision.dtype={dtype}", "log.progress=false",
    ]
    return out


def _fit_rank(rank: int, items: list[str], out_dir: str) -> dict[str, Any]:
    trainer = Trainer(load_config(None, items), out_dir=out_dir)
    return trainer.fit()


def train(items: list[str], world_size: int, out_dir: Path, *, timeout: float = 40) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Run the Trainer on `world_size` ranks (in this process for world_size 1, i.e. strategy
    single); return (final weights, metrics records)."""
    if world_size == 1:
        _fit_rank(0, items, str(out_dir))
    else:
        summaries = run_ranks(_fit_rank, world_size, items, str(out_dir), timeout=timeout)
        assert all(s["steps"] == summaries[0]["steps"] for s in summaries)
    weights = load_file(str(out_dir / "final" / "model.safetensors"))
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return weights, records


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"state dict keys differ: {sorted(a.keys() ^ b.keys())}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def assert_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, rtol=RTOL, atol=ATOL) -> None:
    assert got.keys() == want.keys(), f"state dict keys differ: {sorted(got.keys() ^ want.keys())}"
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def ladder_case(
    strategy: str, accum: int, world_size: int, out_dir: Path, model: str = "mlp", extra: tuple[str, ...] = (),
    timeout: float = 40,
) -> float:
    """Train one rung and return its max abs weight difference from the reference (asserts parity).
    `extra`: more overrides (a layout, activation checkpointing)."""
    g = GLOBAL_BATCH[world_size]
    items = overrides(strategy=strategy, world_size=world_size, accum=accum, model=model) + list(extra)
    got, records = train(items, world_size, out_dir, timeout=timeout)
    want, norms = reference(model, global_batch=g)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert_weights_close(got, want)
    # The logged (pre-clip) gradient norm is the global-batch gradient's norm at every step.
    logged = [r["grad_norm"] for r in records if "grad_norm" in r]
    assert logged == pytest.approx(norms, rel=1e-4)
    return max_abs_diff(got, want)


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
    checks = [json.loads(line) for line in (tmp_path / "diagnostics.jsonl").read_text().splitlines()]
    drift = [c for c in checks if c["kind"] == "drift"]
    assert len(drift) == STEPS and all(c["ok"] for c in drift)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "strategy,mode,world_size,model",
    [("single", "full", 1, "mlp"), ("ddp", "selective", 2, "mlp"), ("fsdp", "full", 2, "mlp"),
     ("zero2", "selective", 2, "mlp"), ("fsdp", "selective", 2, "llama")],
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
