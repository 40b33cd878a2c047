"""The parity ladder's shared parts: the single-process reference, the runs compared with it, and the
helpers of its pipeline and tensor-parallel rungs (tests/test_parity.py, test_pipeline.py,
test_tensor_parallel.py, test_3d.py, parity_table.py).

Reference: a single process of plain PyTorch (no dptrain training code) that takes, at every
step, the mean loss over the whole global batch (the samples `GlobalBatchSampler` assigns to
that step), backward, plain `torch.optim.SGD`. Candidate: `dptrain.train.trainer.Trainer(cfg).fit()`
on W forked gloo ranks. Plain SGD, not Adam: Adam is nearly scale-invariant and would hide a
missing loss division or a sum-instead-of-mean gradient reduction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import Dataset, default_collate

from dptrain.config import resolve
from dptrain.config.load import load_config
from dptrain.data import GlobalBatchSampler
from dptrain.models.llama import build_llama
from dptrain.models.toy import build_mlp, build_regression_data
from dptrain.train.trainer import Trainer
from support.mp import run_ranks

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
    """Random token sequences (data factory `support.parity:tiny_tokens`)."""
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
        "data_factory": "support.parity:tiny_tokens", "data": tiny_tokens, "data_kwargs": TOKENS_KWARGS,
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


def fit_items(rank: int, items: list[str], out_dir: str, resume: str = "auto") -> dict[str, Any]:
    """One rank's `Trainer(load_config(None, items)).fit()` (for run_ranks); its summary."""
    return Trainer(load_config(None, items), out_dir=out_dir, resume=resume).fit()


def train(
    items: list[str], world_size: int, out_dir: Path, *, timeout: float = 40
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Run the Trainer on `world_size` ranks (in this process for world_size 1, i.e. strategy
    single); return (final weights, metrics records)."""
    if world_size == 1:
        fit_items(0, items, str(out_dir))
    else:
        summaries = run_ranks(fit_items, world_size, items, str(out_dir), timeout=timeout)
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


def assert_no_drift(run_dir: Path) -> None:
    """diagnostics.jsonl holds a drift check for every step (diagnostics.drift_every_steps=1), each ok:
    every replica of every shard held the same weights."""
    checks = [json.loads(line) for line in (run_dir / "diagnostics.jsonl").read_text().splitlines()]
    assert [c["ok"] for c in checks if c["kind"] == "drift"] == [True] * STEPS


def ladder_case(
    strategy: str,
    accum: int,
    world_size: int,
    out_dir: Path,
    model: str = "mlp",
    extra: tuple[str, ...] = (),
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


# ------------------------------------------------------------------ pipeline rungs (parallel.pp > 1)
PP_LLAMA = {"dim": 32, "n_layers": 4, "n_heads": 2, "max_seq_len": 16}


def pp_items(
    *,
    strategy: str,
    world_size: int,
    accum: int,
    schedule: str,
    pp: int = 2,
    microbatches: int = 2,
    stages_per_rank: int = 1,
    global_batch: int = 8,
) -> list[str]:
    items = overrides(
        strategy=strategy, world_size=world_size // pp, accum=accum, model="llama", global_batch=global_batch
    )
    items += [f"model.kwargs.{k}={v}" for k, v in PP_LLAMA.items()]
    items += [
        f"parallel.pp={pp}",
        f"parallel.pp_schedule={schedule}",
        f"parallel.pp_microbatches={microbatches}",
        f"parallel.pp_stages_per_rank={stages_per_rank}",
    ]
    return items


def pp_reference(global_batch: int = 8, grad_clip: float | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    saved = MODELS["llama"]["kwargs"]
    MODELS["llama"]["kwargs"] = PP_LLAMA
    try:
        return reference("llama", global_batch=global_batch, grad_clip=grad_clip)
    finally:
        MODELS["llama"]["kwargs"] = saved


def pp_rung(
    items: list[str],
    world_size: int,
    out_dir: Path,
    *,
    rtol: float = RTOL,
    atol: float = ATOL,
    timeout: float = 120,
    grad_clip: float | None = None,
) -> float:
    got, records = train(items, world_size, out_dir, timeout=timeout)
    want, norms = pp_reference(grad_clip=grad_clip)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert_weights_close(got, want, rtol=rtol, atol=atol)
    logged = [r["grad_norm"] for r in records if "grad_norm" in r]
    assert logged == pytest.approx(norms, rel=1e-4)  # the global norm over both stages
    return max_abs_diff(got, want)


def resolve_items(*items: str, world_size: int = 2):
    return resolve(load_config(None, ["parallel.device=cpu", *items]), world_size=world_size)


RESUME = ["optim.momentum=0.9", "checkpoint.every_steps=2", "train.eval_every_steps=0"]
"""Momentum (optimizer state worth restoring) and a checkpoint every 2 steps."""


def dcp_optimizer_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """`state.<name>.<key>` -> tensor of a DCP checkpoint's optimizer, read without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dptrain.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    reader = SafeFileSystemReader(step_dir / "dcp")
    meta = reader.read_metadata()
    state = {
        "optim": {
            k[len("optim.") :]: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items()
            if k.startswith("optim.state.") and isinstance(m, TensorStorageMetadata)
        }
    }
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return state["optim"]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ tensor-parallel rungs
GLOBAL = 8
# rung -> (strategy, data-parallel degree, world size)
RUNGS = {"tp2": ("ddp", 1, 2), "dp2xtp2": ("ddp", 2, 4), "fsdp2xtp2": ("fsdp", 2, 4), "zero2xtp2": ("zero2", 2, 4)}


def tp_items(rung: str, accum: int, *extra: str, model: str = "llama", grad_clip: float | None = None) -> list[str]:
    strategy, dp, _ = RUNGS[rung]
    return [
        *overrides(
            strategy=strategy, world_size=dp, accum=accum, model=model, global_batch=GLOBAL, grad_clip=grad_clip
        ),
        "parallel.tp=2",
        *extra,
    ]


def tp_case(
    rung: str, accum: int, tmp_path: Path, *extra: str, model: str = "llama", grad_clip: float | None = None
) -> float:
    """Train one rung; assert weights and per-step gradient norms match the reference; return max |dw|."""
    world = RUNGS[rung][2]
    got, records = train(tp_items(rung, accum, *extra, model=model, grad_clip=grad_clip), world, tmp_path, timeout=150)
    want, norms = reference(model, global_batch=GLOBAL, grad_clip=grad_clip)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert_weights_close(got, want)
    assert [r["grad_norm"] for r in records if "grad_norm" in r] == pytest.approx(norms, rel=1e-4)
    return max_abs_diff(got, want)
