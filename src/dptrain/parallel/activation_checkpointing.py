"""Activation checkpointing per block: store less in forward, recompute in backward.

Applied with PyTorch's composable `checkpoint` (torch.distributed._composable), which hooks the
block's forward without wrapping it: parameter names, state dicts and FSDP2 units stay the same.
The blocks are the outermost units FSDP would shard (`fsdp.block_units`), except a module that says
`skip_activation_checkpointing = True` (the chunked-loss head of dptrain/models/chunked_loss.py: it keeps no
logits for backward, and a recompute would run its every chunk again).

- `full`: keep only each block's input; the whole block is recomputed in backward.
- `selective`: op-level selective activation checkpointing (SAC): the outputs of matrix
  multiplications and attention are kept, everything else in the block (activations,
  norms, elementwise ops) is recomputed. Most of the memory of `full` is saved on the cheap ops,
  at a fraction of its recompute cost (the matmuls are not run twice).
- `selective_torchtitan`: torchtitan's default op-level SAC (`activation_checkpoint.mode="selective"`,
  `selective_ac_option="op"`; torchtitan/distributed/activation_checkpoint.py): the outputs of `mm`,
  scaled-dot-product attention, `max` and the functional reduce-scatter are kept, except every second `mm`
  of the block, counted in forward and again, separately, in the recompute. In a LLaMA block
  (wq, wk, wv, wo, w1, w3, w2) that keeps wq, wv, w1 and w2 and recomputes wk, wo and w3: less memory than
  `selective`, three of the seven matmuls run twice.

Both selective modes give SAC's forward cache one `record_function` of its own (`_with_fsdp_cast_entry`): under
FSDP2 with `fsdp_param_dtype` the unit's pre-forward hook casts the block's inputs inside a `record_function`
before checkpointing's hook in forward but inside the recompute in backward, and SAC (torch 2.13) refuses an op
in the recompute that its forward cache never saw ("... not found in storage").

Recomputation replays the same ops on the same inputs (and the same RNG state), so gradients are
identical to training without checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dptrain.parallel.fsdp import block_units

MODES = ("none", "full", "selective", "selective_torchtitan")


def _saved_ops() -> set[Any]:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_cudnn_attention")
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def _policy(saved: set[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _with_fsdp_cast_entry(caching: Any) -> Iterator[None]:
    """SAC's forward context, plus one `record_function` in its cache (recomputed, nothing saved) for the one FSDP2's
    input cast opens only in the recompute (module docstring)."""
    with caching:
        with torch.profiler.record_function("dptrain::selective_checkpoint"):
            pass
        yield


def _contexts(policy: Any) -> tuple[Any, Any]:
    caching, cached = create_selective_checkpoint_contexts(policy)
    return _with_fsdp_cast_entry(caching), cached


def selective_context() -> Any:
    """The `context_fn` of op-level SAC: save matmul/attention outputs, recompute the rest."""
    return _contexts(functools.partial(_policy, _saved_ops()))


def _torchtitan_saved_ops() -> set[Any]:
    aten = torch.ops.aten
    names = ("mm", "max", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    return ops


def _torchtitan_policy(saved: set[Any], counts: dict[str, int], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    mm = op == torch.ops.aten.mm.default
    # torch 2.13 asks the policy in forward only; where the recompute asks too, it counts its own mms (as torchtitan)
    key = "recompute" if ctx.is_recompute else "forward"
    if mm:
        counts[key] += 1
    keep = op in saved and not (mm and counts[key] % 2 == 0)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def torchtitan_context() -> Any:
    """The `context_fn` of torchtitan's op-level SAC: save mm (but every second one), attention, max and
    reduce-scatter outputs, recompute the rest; the mm counts are fresh for each checkpointed call."""
    counts: dict[str, int] = defaultdict(int)
    return _contexts(functools.partial(_torchtitan_policy, _torchtitan_saved_ops(), counts))


def outermost_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks not contained in another block, in registration order."""
    units = block_units(model)
    inner = {id(m) for _, unit in units for m in unit.modules() if m is not unit}
    return [m for _, m in sorted(units, key=lambda du: du[0]) if id(m) not in inner]


def apply_activation_checkpointing(model: nn.Module, *, mode: str) -> list[nn.Module]:
    """Checkpoint every outermost block of `model` in place; returns the blocks (empty for none)."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not valid; choose one of: {', '.join(MODES)}")
    if mode == "none":
        return []
    from torch.distributed._composable import checkpoint

    # a block that keeps nothing worth recomputing says so (the chunked-loss head, dptrain/models/chunked_loss.py)
    blocks = [b for b in outermost_blocks(model) if not getattr(b, "skip_activation_checkpointing", False)]
    if not blocks:
        warnings.warn(
            f"activation_checkpointing={mode}: {type(model).__name__} has no nn.ModuleList and no _no_split_modules "
            "naming its blocks, so nothing is checkpointed; put the repeated blocks in an nn.ModuleList",
            UserWarning, stacklevel=3,
        )
    for block in blocks:
        if mode == "full":
            checkpoint(block)
        elif mode == "selective":
            checkpoint(block, context_fn=selective_context)
        else:
            checkpoint(block, context_fn=torchtitan_context)
    return blocks
