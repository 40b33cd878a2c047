"""DeepSpeed's engine and dptrain train the same model on the same data from the same DeepSpeed JSON, 2 CPU
processes with gloo, ZeRO stages 0, 1 and 2: per-step loss and final weights compared.

The DeepSpeed side is `deepspeed.initialize` on the toy MLP (seeded as dptrain seeds it), fed this rank's
micro-batches in dptrain's data order (GlobalBatchSampler), `engine.backward` / `engine.step` per micro-batch.
The dptrain side is `Trainer(load_config(ds.json))` on the same file (its `dptrain` section names the model and
data; DeepSpeed ignores it). The file: torch_adam (torch.optim.AdamW on both sides; weight_decay 0: dptrain does
not decay 1-D parameters, DeepSpeed decays every parameter), WarmupLR, gradient clipping by DeepSpeed's default
(1.0), global batch 16 = micro 4 x GAS 2 x dp 2.

Tolerance: stage 0 is exact (DDP and DeepSpeed both average one all-reduce per bucket with the same rounding,
the same AdamW kernel on each parameter). ZeRO 1 and 2 run AdamW on flat fp32 partitions and reduce gradients
in their own buckets, so sums round in another order: loss and weights within 1e-6 relative.
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed (the reference) is not installed: .ci/run installs it")

import torch.distributed as dist  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

from dptrain.config.load import load_config  # noqa: E402
from dptrain.config.resolve import resolve  # noqa: E402
from dptrain.data.sampler import GlobalBatchSampler  # noqa: E402
from dptrain.models.toy import build_mlp, build_regression_data  # noqa: E402
from dptrain.train.trainer import Trainer  # noqa: E402
from support.mp import run_ranks  # noqa: E402

STEPS = 6
SEED = 1234
MODEL = {"in_dim": 8, "hidden": 16, "out_dim": 2, "depth": 2}
DATA = {"n": 128, "in_dim": 8, "out_dim": 2, "seed": 0}


def _ds_config(stage: int) -> dict:
    return {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.01}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
        "dptrain": {
            "model": {"factory": "dptrain.models.toy:build_mlp", "kwargs": MODEL},
            "data": {"factory": "dptrain.models.toy:build_regression_data", "kwargs": DATA, "num_workers": 0},
            "train": {"max_steps": STEPS, "seed": SEED, "log_every_steps": 1, "eval_batches": 1},
            "parallel": {"device": "cpu", "timeout_s": 60},
            "log": {"progress": False},
        },
    }


def _deepspeed_rank(rank: int, path: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = load_config(path)
    res = resolve(cfg, world_size=2, cuda_available=False)
    # gloo collectives only: DeepSpeed's CPU shared-memory all-reduce (a C++ op it compiles on first use) serves
    # its inference path, not training's gradient reduction
    with mock.patch("deepspeed.comm.torch.build_shm_op", lambda: None):
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(SEED)
    model = build_mlp(**MODEL)
    ds_cfg = {k: v for k, v in json.loads(Path(path).read_text()).items() if k != "dptrain"}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    data = build_regression_data(**DATA)
    order = GlobalBatchSampler(dataset_len=len(data), global_batch_size=res.global_batch_size,
                               micro_batch_size=res.micro_batch_size, grad_accum_steps=res.grad_accum_steps,
                               dp_rank=rank, dp_world_size=2, seed=SEED, shuffle=True)
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for idx in order.micro_batches(step):
            loss = engine(default_collate([data[i] for i in idx]))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        total /= res.grad_accum_steps
        dist.all_reduce(total)
        losses.append(float(total) / 2)
    return losses, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _dptrain_rank(rank: int, path: str, out: str) -> None:
    Trainer(load_config(path), out_dir=out).fit()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0])  # ZeRO 1 and 2 (about 20 s each): benchmarks/deepspeed_conformance.py
def test_deepspeed_engine_and_dptrain_train_alike(stage: int, tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_ds_config(stage)))
    theirs = run_ranks(_deepspeed_rank, 2, str(path), timeout=90)
    run_ranks(_dptrain_rank, 2, str(path), str(tmp_path / "run"), timeout=90)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ours = [r["loss"] for r in records if "loss" in r and "step" in r][:STEPS]
    weights = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    ds_losses, ds_weights = theirs[0]
    assert len(ours) == STEPS
    assert ours == pytest.approx(ds_losses, rel=1e-6)  # the logged loss: each side's own mean over micro-batches
    if stage == 0:
        assert all(torch.equal(weights[k], ds_weights[k]) for k in ds_weights), _diffs(weights, ds_weights)
    else:
        for k in ds_weights:
            torch.testing.assert_close(weights[k], ds_weights[k], rtol=1e-6, atol=1e-7)


def _diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float((a[k] - b[k]).abs().max()) for k in b}
