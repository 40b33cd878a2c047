"""`optim.name: lamb`: LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes") with the arithmetic of DeepSpeed's FusedLamb (`deepspeed/ops/csrc/lamb/fused_lamb_cuda_kernel.cu`),
what a DeepSpeed file's `"type": "Lamb"` builds.

Per parameter tensor p with gradient g, at step t:

    m = beta1 m + (1 - beta1) g
    v = beta2 v + (1 - beta2) g^2
    denom = sqrt(v) + eps                  (eps_inside_sqrt: sqrt(v + eps))
    update = m / denom + weight_decay p
    coeff = clamp(||p|| / ||update||, min_coeff, max_coeff), or 1 where either norm is 0
    p -= step_size coeff update,  step_size = lr sqrt(1 - beta2^t) / (1 - beta1^t)  (bias_correction false: lr)

The trust ratio is per parameter tensor and needs the norms of the whole tensor. Under zero1 every rank's
optimizer holds whole parameters (ZeroRedundancyOptimizer), so the norms are local. Under zero2/fsdp the
parameters and state are DTensor shards: the two norms are reduced over the mesh (`full_norm`: the DTensor's
norm, made whole with `full_tensor`), so every shard scales by the same coefficient the whole tensor would.

FusedLamb is a CUDA kernel with no CPU build; DeepSpeed ships the same update in pure torch for Ascend NPUs
(`deepspeed/ops/op_builder/npu/fused_lamb.py`, `NPUFusedLamb.lamb`), and this class follows that arithmetic op
for op, so a plain tensor's step is bitwise DeepSpeed's (tests/test_lamb.py). FusedLamb's `max_grad_norm` and
AMSGrad are not taken (DeepSpeed's engine refuses the first; FusedLamb refuses the second).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate


def full_norm(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of the whole tensor: a DTensor shard's norm is reduced over its mesh."""
    n = t.norm(2)
    return n.full_tensor() if isinstance(n, DTensor) else n


def like(value: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`value` (a plain 0-dim tensor) as `ref`'s kind: replicated over ref's mesh when ref is a DTensor."""
    if isinstance(ref, DTensor):
        return DTensor.from_local(value, ref.device_mesh, [Replicate()] * ref.device_mesh.ndim, run_check=False)
    return value


def trust_ratio(p: torch.Tensor, update: torch.Tensor, *, max_coeff: float, min_coeff: float) -> torch.Tensor:
    """clamp(||p|| / ||update||, min_coeff, max_coeff); 1 where either norm is 0 (FusedLamb's rule)."""
    p_norm, u_norm = full_norm(p.float()), full_norm(update)
    if p_norm == 0 or u_norm == 0:
        return torch.tensor(1.0, device=p_norm.device)
    return (p_norm / u_norm).clamp(min_coeff, max_coeff)


class Lamb(torch.optim.Optimizer):
    """LAMB over `params` with DeepSpeed FusedLamb's arithmetic; `coeffs` holds each tensor's last trust ratio
    (FusedLamb's `get_lamb_coeffs`)."""

    def __init__(
        self, params: Iterable[Any], *, lr: float = 1e-3, bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
    ) -> None:
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(f"min_coeff={min_coeff}, max_coeff={max_coeff}: need 0 < min_coeff <= max_coeff")
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": tuple(betas), "eps": eps,
                    "weight_decay": weight_decay, "max_coeff": max_coeff, "min_coeff": min_coeff}
        super().__init__(params, defaults)
        self.eps_inside_sqrt = eps_inside_sqrt
        self.coeffs: list[float] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.coeffs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                coeff = lamb_step(p, p.grad, st["exp_avg"], st["exp_avg_sq"], step=int(st["step"].item()),
                                  group=group, eps_inside_sqrt=self.eps_inside_sqrt)
                self.coeffs.append(float(coeff))
        return loss


def lamb_step(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int,
              group: dict[str, Any], eps_inside_sqrt: bool) -> torch.Tensor:
    """One FusedLamb update of `p` in place (NPUFusedLamb.lamb's op order); returns the trust ratio."""
    beta1, beta2 = group["betas"]
    if group["bias_correction"]:
        step_size = group["lr"] * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
    else:
        step_size = group["lr"]
    g = grad.float()
    exp_avg.mul_(beta1).add_(g, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = exp_avg_sq.add(group["eps"]).sqrt_() if eps_inside_sqrt else exp_avg_sq.sqrt().add_(group["eps"])
    update = exp_avg / denom
    if group["weight_decay"] != 0:
        update.add_(p.float(), alpha=group["weight_decay"])
    coeff = trust_ratio(p, update, max_coeff=group["max_coeff"], min_coeff=group["min_coeff"])
    p.copy_((p.float() - step_size * like(coeff, p) * update).to(p.dtype))
    return coeff
