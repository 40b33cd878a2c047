"""`optim.name: onebit_adam`: 1-bit Adam (Tang et al. 2021; DeepSpeed's `OnebitAdam`).

Two stages, decided by the optimizer steps taken (`state["step"]`, the same on every rank):

- warm-up, steps 1 .. freeze_step: AdamW exactly (torch's single-tensor AdamW arithmetic, bit for
  bit: decoupled weight decay, both bias corrections) on gradients DDP has averaged (the
  `MomentumExchange` hook all-reduces them);
- compression, every later step: DDP sends nothing (the hook keeps each rank's local gradient); the
  variance `exp_avg_sq` is frozen as it was after step freeze_step; each rank folds its local
  gradient into the momentum, `exp_avg = beta1 exp_avg + (1 - beta1) g_local`, and the momenta are
  replaced by their 1-bit compressed average with worker and server error feedback
  (`MomentumExchange.allreduce`, parallel/momentum_exchange.py); then
  `p -= lr / (1 - beta1^t) * exp_avg / (sqrt(exp_avg_sq / (1 - beta2^freeze_step)) + eps)`.

Every rank applies the same update (the exchanged momentum and the frozen variance are equal on
all ranks), so the replicas stay identical. The error buffers are per rank and live in the
exchange (saved in each rank's own checkpoint file); the optimizer state is torch Adam's
(`step`, `exp_avg`, `exp_avg_sq`), equal on every rank.

Where this differs from DeepSpeed's OnebitAdam (`deepspeed/runtime/fp16/onebit/adam.py`; DeepSpeed
0.19.8 no longer ships its 1-bit optimizers): DeepSpeed's first `step()` only initialises its
buffers and discards that step's gradient, and it applies no bias correction (its `bias_correction`
argument is unused); dptrain updates from step 1 with Adam's bias corrections, so the warm-up is
AdamW itself. The compression arithmetic (RMS scales, sign >= 0 as +, errors on worker and server,
one chunk per server) is the paper's and DeepSpeed's, except that padding elements are left out of
the scales.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dptrain.parallel.momentum_exchange import MomentumExchange


class ExchangingOptimizer(torch.optim.Optimizer):
    """An optimizer whose momentum goes through a `MomentumExchange` once `freeze_step` steps are done (1-bit Adam,
    1-bit LAMB): it counts its steps and tells the exchange (the DDP hook's stage), also after a checkpoint load."""

    exchange: MomentumExchange | None

    def steps_done(self) -> int:
        """Optimizer steps taken (0 before the first)."""
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st:
                    return int(st["step"].item())
        return 0

    def _tell_exchange(self) -> None:
        if self.exchange is not None:
            self.exchange.steps_done = self.steps_done()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._tell_exchange()  # the DDP hook's stage follows the loaded step


class OneBitAdam(ExchangingOptimizer):
    """1-bit Adam over `params`; `exchange` does the compressed momentum all-reduce (None: no
    exchange, e.g. one process; gradients must then be averaged by the caller)."""

    def __init__(
        self, params: Iterable[Any], *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100,
        exchange: MomentumExchange | None = None,
    ) -> None:
        if freeze_step < 1:
            raise ValueError(f"freeze_step={freeze_step} must be at least 1: the variance needs one full Adam step")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.freeze_step = freeze_step
        self.exchange = exchange


    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self.steps_done() >= self.freeze_step
        pending: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]] = []
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1 = group["betas"][0]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if p.grad is None and not compressing:
                    continue
                st["step"] += 1
                if wd != 0:
                    p.mul_(1 - lr * wd)
                if p.grad is not None:
                    st["exp_avg"].lerp_(p.grad, 1 - beta1)
                if not compressing:
                    self._variance_and_update(p, st, group)
                else:
                    pending.append((p, st, group))
        if pending:
            if self.exchange is not None:  # every parameter's momentum, in the same order on every rank
                self.exchange.allreduce([st["exp_avg"] for _, st, _ in pending])
            for p, st, group in pending:
                self._update(p, st, group, variance_step=float(self.freeze_step))
        self._tell_exchange()
        return loss

    @staticmethod
    def _variance_and_update(p: torch.Tensor, st: dict[str, Any], group: dict[str, Any]) -> None:
        beta2 = group["betas"][1]
        assert p.grad is not None
        st["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        OneBitAdam._update(p, st, group, variance_step=st["step"].item())

    @staticmethod
    def _update(p: torch.Tensor, st: dict[str, Any], group: dict[str, Any], *, variance_step: float) -> None:
        """torch's single-tensor Adam update with the variance's bias correction at `variance_step`."""
        beta1, beta2 = group["betas"]
        step = st["step"].item()
        step_size = group["lr"] / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**variance_step) ** 0.5
        denom = (st["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(group["eps"])
        p.addcdiv_(st["exp_avg"], denom, value=-step_size)
