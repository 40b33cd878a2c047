"""`train.compile`: torch.compile per block, in place.

Each block (the FSDP units, `fsdp.block_units`: the model's `_no_split_modules` classes, else the
members of every nn.ModuleList; only the outermost ones) is compiled with `nn.Module.compile`,
which compiles the module's call in place instead of wrapping it in an `OptimizedModule`: the
module tree, parameter names, state dicts and checkpoints stay exactly as without compile.

Order (torchtitan's `parallelize_llama`): after tensor parallelism and activation checkpointing
(so the compiled region contains the checkpointed block), before FSDP2 `fully_shard` or DDP.
Per-block compilation compiles one graph for the repeated block and reuses it for every layer;
FSDP2's hooks around each block stay outside the graph, and DDP's gradient buckets see the
gradients the compiled backward produces. The embedding, final norm and head run eagerly.
"""

from __future__ import annotations

import warnings

from torch import nn

from dptrain.parallel.activation_checkpointing import outermost_blocks


def apply_compile(model: nn.Module, *, backend: str = "inductor") -> list[nn.Module]:
    """Compile every outermost block of `model` in place with `backend`; returns the blocks."""

    blocks = outermost_blocks(model)
    if not blocks:
        warnings.warn(
            f"train.compile: {type(model).__name__} has no nn.ModuleList and no _no_split_modules naming its blocks, "
            "so nothing is compiled; put the repeated blocks in an nn.ModuleList", UserWarning, stacklevel=3,
        )
    for block in blocks:
        block.compile(backend=backend)
    return blocks
