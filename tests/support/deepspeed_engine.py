"""Training the toy MLP under `deepspeed.initialize` and under dptrain from one DeepSpeed JSON (2 CPU ranks, gloo):
the two sides of tests/test_deepspeed_engine_parity.py and benchmarks/acceptance/deepspeed_conformance.py."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import deepspeed
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.utils.data import default_collate

from dptrain.config.load import load_config
from dptrain.config.resolve import resolve
from dptrain.data.sampler import GlobalBatchSampler
from dptrain.models.toy import build_mlp, build_regression_data
from dptrain.train.trainer import Trainer

STEPS = 6
SEED = 1234
MODEL = {"in_dim": 8, "hidden": 16, "out_dim": 2, "depth": 2}
DATA = {"n": 128, "in_dim": 8, "out_dim": 2, "seed": 0}


def ds_config(stage: int) -> dict:
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


def deepspeed_rank(rank: int, path: str) -> tuple[list[float], dict[str, torch.Tensor]]:
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


def dptrain_rank(rank: int, path: str, out: str) -> None:
    Trainer(load_config(path), out_dir=out).fit()




def dptrain_result(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The per-step losses and final weights a dptrain run wrote."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and "step" in r][:STEPS]
    return losses, load_file(str(out / "final" / "model.safetensors"))


def diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Largest absolute difference per tensor."""
    return {k: float((a[k] - b[k]).abs().max()) for k in b}
