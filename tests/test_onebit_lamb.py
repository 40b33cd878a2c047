"""optim.name=onebit_lamb (1-bit LAMB, DeepSpeed's OnebitLamb). DeepSpeed 0.19.8 no longer ships OnebitLamb
(deepspeed/runtime/fp16/onebit/ is gone, and its compressed backends were CUDA/MPI only), so there is no DeepSpeed
class to run. The reference is a line-by-line transcription of DeepSpeed's `OnebitLamb.step`
(deepspeed/runtime/fp16/onebit/lamb.py, v0.9-0.16) in one process, where DeepSpeed itself skips the exchange
(`if self.size > 1`), with one change that dptrain makes on purpose: no initialisation-only first step. Then 2 gloo
ranks through the Trainer: identical replicas, 1-bit Adam's exchange bytes after the freeze, a bit-identical
resume after the freeze, the DeepSpeed mapping and the refusals."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dptrain.config import ConfigError, resolve
from dptrain.config.deepspeed import from_deepspeed
from dptrain.config.load import build_config, load_config
from dptrain.parallel import momentum_exchange as oba
from dptrain.train.onebit_lamb import OneBitLamb
from support import overrides
from support.mp import run_ranks

SHAPES = [(7,), (5, 13), (2, 3, 4)]
HP = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "max_coeff": 10.0, "min_coeff": 0.01,
      "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) * (1 + 0.3 * step) for s in SHAPES]


def deepspeed_onebit_lamb(params: list[torch.Tensor], steps: int, freeze_step: int) -> list[list[float]]:
    """DeepSpeed's OnebitLamb.step on one process (no exchange), transcribed; returns each step's coefficients."""
    lr, (beta1, beta2), eps, wd = HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"]
    state = [{"lamb_coeff_freeze": 0.0, "last_factor": 1.0, "exp_avg": torch.zeros_like(p),
              "exp_avg_sq": torch.zeros_like(p), "exp_avg_sq_fresh": torch.zeros_like(p)} for p in params]
    freeze_key, out = False, []
    for step in range(1, steps + 1):
        coeffs = []
        grads = _grads(step)
        if freeze_key:
            exp_avg_last_step = [s["exp_avg"].detach().clone() for s in state]
            if "scaling_coeff" not in state[0]:
                scales = [(torch.norm(s["exp_avg"]) / np.sqrt(torch.numel(s["exp_avg"]))).item() for s in state]
                united = sum(scales) / len(scales)
                for s, sc in zip(state, scales, strict=True):
                    s["scaling_coeff"] = united / sc
        for p, s, grad in zip(params, state, grads, strict=True):
            exp_avg, exp_avg_sq = s["exp_avg"], s["exp_avg_sq"]
            if not freeze_key:
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if step == freeze_step:
                    s["exp_avg_sq_fresh"].data = exp_avg_sq.detach().clone()
                weight_norm = p.data.pow(2).sum().sqrt()
                update = exp_avg / (exp_avg_sq.sqrt() + eps)
                if wd > 0.0:
                    update += wd * p.data
                update_norm = update.pow(2).sum().sqrt()
                lamb_coeff = 1.0
                if weight_norm != 0 and update_norm != 0:
                    lamb_coeff = (weight_norm / update_norm).item()
                    if lamb_coeff > HP["max_coeff"]:
                        lamb_coeff = HP["max_coeff"]
                    if lamb_coeff < HP["min_coeff"]:
                        lamb_coeff = HP["min_coeff"]
                if lamb_coeff != 1.0:
                    s["lamb_coeff_freeze"] = HP["coeff_beta"] * s["lamb_coeff_freeze"] + (
                        1 - HP["coeff_beta"]) * lamb_coeff
                coeffs.append(lamb_coeff)
                with torch.no_grad():
                    p.add_(-lr * lamb_coeff * update)
            else:
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg.mul_(s["scaling_coeff"])
        if freeze_key:  # one process: DeepSpeed's `if self.size > 1` skips the compressed all-reduce
            for j, (p, s) in enumerate(zip(params, state, strict=True)):
                exp_avg, exp_avg_sq, exp_avg_sq_fresh = s["exp_avg"], s["exp_avg_sq"], s["exp_avg_sq_fresh"]
                exp_avg.div_(s["scaling_coeff"])
                grad_reconstruct = (exp_avg - exp_avg_last_step[j] * beta1) / (1 - beta1)
                exp_avg_sq_fresh.mul_(beta2).addcmul_(grad_reconstruct, grad_reconstruct, value=1 - beta2)
                denom = exp_avg_sq.sqrt() + eps
                update_prelim = exp_avg / denom
                update = update_prelim + wd * p.data if wd > 0.0 else update_prelim
                update_norm = update.pow(2).sum().sqrt()
                denom_real = exp_avg_sq_fresh.sqrt() + eps
                factor = (denom / denom_real).max().item()
                if wd > 0.0:
                    update_ratio = min(1.0, (update_prelim.pow(2).sum().sqrt() / update_norm).item())
                    factor = factor * update_ratio + (1.0 - update_ratio)
                if factor > HP["factor_max"]:
                    factor = HP["factor_max"]
                if factor < HP["factor_min"]:
                    factor = HP["factor_min"]
                if factor > s["last_factor"] * (1.0 + HP["factor_threshold"]):
                    factor = s["last_factor"] * (1.0 + HP["factor_threshold"])
                if factor < s["last_factor"] * (1.0 - HP["factor_threshold"]):
                    factor = s["last_factor"] * (1.0 - HP["factor_threshold"])
                s["last_factor"] = factor
                lamb_coeff = s["lamb_coeff_freeze"] * factor
                coeffs.append(lamb_coeff)
                with torch.no_grad():
                    p.add_(-lr * lamb_coeff * update)
        if not freeze_key and step >= freeze_step:
            freeze_key = True
        out.append(coeffs)
    return out


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_one_process_is_deepspeeds_onebit_lamb_bitwise():
    ours, theirs = _params(), [p.detach().clone() for p in _params()]
    opt = OneBitLamb(ours, freeze_step=3, **HP)
    want = deepspeed_onebit_lamb(theirs, steps=9, freeze_step=3)
    for step in range(1, 10):
        for p, g in zip(ours, _grads(step), strict=True):
            p.grad = g
        opt.step()
        assert opt.coeffs == want[step - 1], step
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.detach(), b)
    st = opt.state[ours[0]]
    assert st["last_factor"] != 1.0 and st["scaling_coeff"] != 1.0  # the compression stage's machinery ran
    assert not torch.equal(st["exp_avg_sq_fresh"], st["exp_avg_sq"])  # the fresh variance moved, the frozen did not


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_deepspeed_onebitlamb_maps_and_refusals():
    ds = {"train_batch_size": 8, "optimizer": {"type": "OneBitLamb", "params": {
        "lr": 2e-3, "freeze_step": 7, "coeff_beta": 0.8, "factor_max": 3.0, "factor_min": 0.6,
        "factor_threshold": 0.2, "max_coeff": 0.5, "cuda_aware": False, "comm_backend_name": "nccl"}}}
    o = build_config(from_deepspeed(ds)[0]).optim
    assert (o.name, o.lr, o.freeze_step, o.coeff_beta, o.factor_max, o.factor_min, o.factor_threshold,
            o.max_coeff) == ("onebit_lamb", 2e-3, 7, 0.8, 3.0, 0.6, 0.2, 0.5)
    with pytest.raises(ConfigError, match="amsgrad"):
        from_deepspeed({"train_batch_size": 8, "optimizer": {"type": "OneBitLamb", "params": {"amsgrad": True}}})
    for extra, message in ((["parallel.strategy=zero1"], "needs parallel.strategy=ddp"),
                           (["parallel.grad_compression=onebit"], "compresses the momentum itself"),
                           (["optim.factor_threshold=1.5"], "optim.factor_threshold=1.5 is not valid")):
        with pytest.raises(ConfigError, match=message):
            resolve(load_config(None, ["optim.name=onebit_lamb", *extra]), world_size=2, cuda_available=False)


# ------------------------------------------------------------------ 2 gloo ranks through the Trainer
TOY = [
    "model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
    "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every_steps=1", "train.eval_every_steps=0",
    "optim.lr=0.01", "optim.warmup_steps=0", "optim.schedule=constant", "optim.grad_clip=1.0",
    "log.progress=false", "checkpoint.keep_last=null", "diagnostics.preflight=false",
    "optim.name=onebit_lamb", "optim.freeze_step=2", "optim.weight_decay=0.01",
]


def fit(rank: int, out: Path, extra: list[str]) -> str | None:
    from dptrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides(TOY, extra)), out_dir=out)
    trainer.fit()
    hook = None if trainer.comm_hook is None else trainer.comm_hook.name
    del trainer
    gc.collect()
    return hook


def _records(run_dir: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r]


@pytest.mark.timeout(240)
def test_two_ranks_exchange_momenta_in_bits_and_resume_bit_identically(tmp_path):
    ref = run_ranks(fit, 2, tmp_path / "ref", ["train.max_steps=6"], timeout=90)
    assert ref == ["onebit_adam", "onebit_adam"]  # 1-bit Adam's hook and momentum exchange
    recs = _records(tmp_path / "ref")
    from dptrain.models.toy import build_mlp

    numels = [p.numel() for p in build_mlp().parameters()]
    lay = oba.ChunkLayout(numels, 2)
    assert [r["comm_bytes"] for r in recs] == [4 * sum(numels)] * 2 + [lay.sent_bytes()] * 4
    run_ranks(fit, 2, tmp_path / "cut", ["train.max_steps=4"], timeout=90)
    run_ranks(fit, 2, tmp_path / "cut", ["train.max_steps=6"], timeout=90)
    assert [r["loss"] for r in _records(tmp_path / "cut")] == [r["loss"] for r in recs]
    a, b = load_file(str(tmp_path / "ref" / "final" / "model.safetensors")), load_file(
        str(tmp_path / "cut" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
