"""One warning when an own loop steps its optimizer in the middle of the loader's accumulation.

A loader from `prepare_dataloader` with `grad_accum_steps` = A > 1 hands out A micro-batches per optimizer
step. A loop that calls `optimizer.step()` after every micro-batch (the ported script's own loop, unchanged)
trains at a global batch A times smaller, with A times as many steps, and nothing fails. dptrain does not skip
the step (a silent no-op `optimizer.step()` is the surprise Accelerate's users report most); it says so, once per
loader, on rank 0: torch's global optimizer step hook (`register_optimizer_step_post_hook`, installed with the
first such loader) checks, after every `step()` of any optimizer, whether a live accumulating loader stands
in the middle of an optimizer step (`EpochLoader.at_step_boundary`). Loaders without accumulation cost nothing.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from dptrain.data import EpochLoader
from dptrain.distributed import collectives

_LOADERS: weakref.WeakSet[EpochLoader] = weakref.WeakSet()  # accumulating loaders not yet warned about
_HOOK: list[Any] = []  # the global hook's handle, once installed


def watch(loader: EpochLoader) -> None:
    """Warn once if an optimizer steps while `loader` (accumulating) is in the middle of an optimizer step."""
    if loader.grad_accum_steps == 1:
        return
    _LOADERS.add(loader)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_after_step))


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not _LOADERS:  # every watched loader warned or gone: the global hook goes too (other optimizers pay nothing)
        _HOOK.pop().remove()
        return
    for loader in list(_LOADERS):
        if loader.at_step_boundary:
            continue
        _LOADERS.discard(loader)  # once per loader
        if collectives.rank() != 0:
            continue
        a, g = loader.grad_accum_steps, loader.global_batch_size
        k = loader.micro_batches_consumed % a
        warnings.warn(
            f"dptrain: {type(optimizer).__name__}.step() ran after micro-batch {k} of {a} of an optimizer step: the "
            f"loader accumulates grad_accum_steps={a} micro-batches per step (global_batch_size={g}), so stepping "
            f"on every micro-batch trains at a batch {a}x smaller, {a}x as often. Step after the last one: "
            "`if micro == accum - 1:` with dptrain.micro_steps, or `if (i + 1) % dptrain.grad_accum_steps(loader) "
            "== 0:` (this warning is shown once)",
            UserWarning,
            stacklevel=3,
        )
