"""optim.name=lamb: DeepSpeed FusedLamb's update. FusedLamb itself is a CUDA kernel with no CPU build, so there is no
CPU DeepSpeed oracle for the kernel; DeepSpeed ships the same update in pure torch for Ascend NPUs
(`NPUFusedLamb.lamb`, deepspeed/ops/op_builder/npu/fused_lamb.py), and that is the reference here, bitwise. Then an
independent transcription of the CUDA kernel's equations (fused_lamb_cuda_kernel.cu, parts 1 and 3) in float64,
the trust ratio's clamp and its 1 for zero norms, Adam when the ratio is pinned to 1, the DeepSpeed mapping, and
2 gloo ranks under ddp, zero1 and fsdp against one process (one test: four short runs)."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dptrain.config import ConfigError, resolve
from dptrain.config.deepspeed import from_deepspeed
from dptrain.config.load import build_config, load_config
from dptrain.train.lamb import Lamb
from support import overrides
from support.mp import run_ranks

npu_lamb = pytest.importorskip("deepspeed.ops.op_builder.npu.fused_lamb", reason="DeepSpeed (the oracle)")

SHAPES = [(7,), (5, 13), (2, 3, 4), (1,)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(step: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [scale * torch.randn(s, generator=g) for s in SHAPES]


@pytest.mark.fast
@pytest.mark.timeout(30)
@pytest.mark.parametrize(("bias_correction", "eps_inside_sqrt", "wd", "max_coeff"),
                         [(True, False, 0.0, 10.0), (True, True, 0.01, 0.3), (False, False, 0.1, 10.0)])
def test_step_is_deepspeeds_own_torch_lamb_bitwise(bias_correction, eps_inside_sqrt, wd, max_coeff):
    ours, theirs = _params(), [p.detach().clone() for p in _params()]
    opt = Lamb(ours, lr=0.01, bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt, weight_decay=wd,
               max_coeff=max_coeff, min_coeff=0.01)
    m = [torch.zeros_like(p) for p in theirs]
    v = [torch.zeros_like(p) for p in theirs]
    for step in range(1, 6):
        for p, g in zip(ours, _grads(step), strict=True):
            p.grad = g
        opt.step()
        want = []
        for p, mi, vi, g in zip(theirs, m, v, _grads(step), strict=True):
            c = npu_lamb.NPUFusedLamb.lamb(p, torch.tensor([]), mi, vi, g, 0.01, 0.9, 0.999, max_coeff, 0.01, 1e-8,
                                           1.0, step, 0 if eps_inside_sqrt else 1, int(bias_correction), wd)
            want.append(float(c))
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.detach(), b), (step, (a - b).abs().max())
        assert opt.coeffs == want
    assert any(abs(c - max_coeff) < 1e-6 for c in want) or max_coeff == 10.0  # the clamp is in play where tight


def _kernel(p, m, v, g, *, lr, b1, b2, eps, mode, decay, step, bias_correction, max_coeff, min_coeff):
    """fused_lamb_cuda_kernel.cu in float64, element by element as the kernel writes it (part 1: moments and the
    two squared norms; part 3: the clamped coefficient and the update)."""
    step_size = lr * math.sqrt(1 - b2**step) / (1 - b1**step) if bias_correction else lr
    reg_w = reg_u = 0.0
    for j in range(len(p)):
        m[j] = b1 * m[j] + (1 - b1) * g[j]
        v[j] = b2 * v[j] + (1 - b2) * g[j] * g[j]
        denom = math.sqrt(v[j] + eps) if mode == 0 else math.sqrt(v[j]) + eps
        u = m[j] / denom + decay * p[j]
        reg_u += u * u
        reg_w += p[j] * p[j]
    w_norm, u_norm = math.sqrt(reg_w), math.sqrt(reg_u)
    coeff = 1.0
    if w_norm != 0 and u_norm != 0:
        coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
    for j in range(len(p)):
        denom = math.sqrt(v[j] + eps) if mode == 0 else math.sqrt(v[j]) + eps
        p[j] = p[j] - step_size * coeff * (m[j] / denom + decay * p[j])
    return coeff


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_step_follows_the_cuda_kernels_equations():
    """An independent float64 transcription of the kernel: float32 LAMB agrees to float32 rounding."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40))
    opt = Lamb([p], lr=0.05, weight_decay=0.02, max_coeff=2.0, min_coeff=0.1, eps=1e-6)
    ref, m, v = p.detach().tolist(), [0.0] * 40, [0.0] * 40
    for step in range(1, 8):
        g = torch.randn(40)
        p.grad = g
        opt.step()
        c = _kernel(ref, m, v, g.tolist(), lr=0.05, b1=0.9, b2=0.999, eps=1e-6, mode=1, decay=0.02, step=step,
                    bias_correction=True, max_coeff=2.0, min_coeff=0.1)
        assert opt.coeffs[0] == pytest.approx(c, rel=1e-5)
        assert torch.allclose(p.detach().double(), torch.tensor(ref, dtype=torch.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_trust_ratio_is_clamped_and_one_for_zero_norms():
    big = torch.nn.Parameter(torch.full((10,), 1e6))
    small = torch.nn.Parameter(torch.full((10,), 1e-9))
    zero = torch.nn.Parameter(torch.zeros(10))
    opt = Lamb([big, small, zero], lr=0.1, max_coeff=3.0, min_coeff=0.05)
    for p in (big, small, zero):
        p.grad = torch.ones(10)
    opt.step()
    assert opt.coeffs == [3.0, pytest.approx(0.05), 1.0]
    # the zero tensor moved by lr x 1 x update: update = m / (sqrt(v) + eps) after one step, bias-corrected size
    step = 0.1 * math.sqrt(1 - 0.999) / (1 - 0.9)
    assert torch.allclose(zero.detach(), torch.full((10,), -step * 0.1 / (math.sqrt(0.001) + 1e-8)))


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_a_ratio_pinned_to_one_is_adam():
    """min_coeff = max_coeff = 1, eps 0: lr sqrt(1 - b2^t) / (1 - b1^t) m / sqrt(v) is torch's Adam update."""
    a, b = _params(), _params()
    lamb = Lamb(a, lr=0.01, eps=0.0, max_coeff=1.0, min_coeff=1.0)
    adam = torch.optim.Adam(b, lr=0.01, eps=0.0)
    for step in range(1, 5):
        for x, y, g in zip(a, b, _grads(step), strict=True):
            x.grad, y.grad = g.clone(), g.clone()
        lamb.step()
        adam.step()
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, rtol=1e-6, atol=1e-7)
    assert not all(torch.equal(x, y) for x, y in zip(_params(), a, strict=True))


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_deepspeed_lamb_maps_and_refuses_what_deepspeed_refuses():
    ds = {"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": {
        "lr": 2e-3, "weight_decay": 0.01, "max_coeff": 0.5, "min_coeff": 0.02, "bias_correction": False,
        "eps_inside_sqrt": True, "betas": [0.8, 0.99]}}}
    cfg = build_config(from_deepspeed(ds)[0])
    o = cfg.optim
    assert (o.name, o.lr, o.weight_decay, o.max_coeff, o.min_coeff, o.bias_correction, o.eps_inside_sqrt,
            tuple(o.betas)) == ("lamb", 2e-3, 0.01, 0.5, 0.02, False, True, (0.8, 0.99))
    bad = [({"amsgrad": True}, "amsgrad"), ({"adam_w_mode": True}, "FusedLamb takes"),
           ({"bias_correction": 1}, "true or false")]
    for params, message in bad:
        with pytest.raises(ConfigError, match=message):
            from_deepspeed({"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": params}})
    with pytest.raises(ConfigError, match="requires dynamic loss scaling"):
        from_deepspeed({"train_batch_size": 8, "optimizer": {"type": "Lamb"}, "fp16": {"enabled": True,
                                                                                      "loss_scale": 128}})
    with pytest.raises(ConfigError, match="optim.min_coeff=2.0 is above optim.max_coeff=1.0"):
        resolve(load_config(None, ["optim.name=lamb", "optim.min_coeff=2", "optim.max_coeff=1"]), world_size=1,
                cuda_available=False)


# ------------------------------------------------------------------ 2 gloo ranks against one process
TOY = [
    "model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
    "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every_steps=1", "train.eval_every_steps=0",
    "optim.lr=0.01", "optim.warmup_steps=0", "optim.schedule=constant", "optim.grad_clip=1.0",
    "log.progress=false", "checkpoint.keep_last=null", "diagnostics.preflight=false", "train.max_steps=4",
    "optim.name=lamb", "optim.weight_decay=0.01",
]


def fit(rank: int, out: Path, extra: list[str]) -> None:
    from dptrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides(TOY, extra)), out_dir=out)
    trainer.fit()
    del trainer
    gc.collect()


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def losses(run_dir: Path) -> list[float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r]


@pytest.mark.timeout(240)
def test_two_ranks_under_ddp_zero1_and_fsdp_train_as_one_process(tmp_path):
    """ddp and zero1 (whose optimizer holds whole tensors) are the same math on the same averaged gradients: bitwise
    equal. Under fsdp each rank holds half of every tensor and the trust ratio's norms are the whole tensor's
    (full_norm); shard-local norms would give other ratios. Against one process: float32 rounding of the
    gradient average, no more."""
    run_ranks(fit, 1, tmp_path / "one", [], timeout=90)
    for run in ("ddp", "zero1", "fsdp"):
        run_ranks(fit, 2, tmp_path / run, [f"parallel.strategy={run}"], timeout=90)
    one, ddp, zero1, fsdp = (weights(tmp_path / run) for run in ("one", "ddp", "zero1", "fsdp"))
    assert all(torch.equal(ddp[k], zero1[k]) for k in ddp)
    for run, got in (("ddp", ddp), ("fsdp", fsdp)):
        assert losses(tmp_path / run) == pytest.approx(losses(tmp_path / "one"), rel=1e-5), run
        assert all(torch.allclose(got[k], one[k], rtol=1e-5, atol=1e-6) for k in one), run
