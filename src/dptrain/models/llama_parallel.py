"""How the built-in `LlamaLM` is split for parallelism, kept with the model (as torchtitan keeps
`parallelize_llama` beside its model): the tensor-parallel plan (`llama_tp_plan`, applied by
`apply_llama_tp`; parallel/tensor.py documents the styles and picks this plan for a `LlamaLM`) and
the pipeline split (`split_llama` -> `LlamaStage`s, `split_batch`; parallel/pipeline.py schedules them).
The model code itself never knows it is parallelised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dptrain.models.llama import LlamaLM, rope_tables
from dptrain.models.lora_parallel import keep_frozen, lora_tp_plan

__all__ = ["LlamaStage", "apply_llama_tp", "is_builtin_llama", "llama_tp_plan", "split_batch", "split_llama"]


def is_builtin_llama(model: nn.Module) -> bool:
    return isinstance(model, (LlamaLM, LlamaStage))


def llama_tp_plan(*, sequence_parallel: bool, loss_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(root plan, per-block plan) for `LlamaLM`: fully qualified names -> ParallelStyle."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    root: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                use_local_output=not loss_parallel),
    }
    block: dict[str, Any] = {
        # One replicated DTensor input shared by q/k/v (and by w1/w3): their input gradients add up
        # as partial DTensors and are reduced once per block input, not once per projection (without
        # it each projection's own from_local boundary all-reduces its gradient: 5 instead of 2 per
        # block backward, measured by benchmarks/perf/tp_comm.py). Under SP this is also the all-gather
        # of the sequence. The rope tables (attention's other inputs) are plain tensors: left alone.
        "attn": PrepareModuleInput(input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None)),
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=stream),
        "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=stream),
    }
    if sp:
        root["norm"] = SequenceParallel()
        block.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
    return root, block


def apply_llama_tp(
    model: nn.Module, tp_mesh: Any, *, sequence_parallel: bool = True, loss_parallel: bool = False
) -> None:
    """The built-in plan (module docstring) applied in place to a `LlamaLM`, or to one of its
    pipeline stages (`LlamaStage`: the blocks it holds, and of tok_emb / norm / head those it has).
    Linears peft wrapped in LoRA layers (the base model of a PEFT model) get the plan's entries for their base
    linear and adapters (`lora_tp_plan`, models/lora_parallel.py).
    Between stages under sequence parallelism the activation is this rank's Shard(1) slice of the
    sequence (a plain local tensor): the pipeline group pairs ranks of the same tp coordinate."""
    from torch.distributed.tensor.parallel import parallelize_module

    root, block = llama_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    layers: Any = model.layers  # a ModuleList on LlamaLM; a pipeline stage's ModuleDict keyed by layer index
    with keep_frozen(model):  # SequenceParallel would make a frozen norm trainable again
        for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
            parallelize_module(layer, tp_mesh, lora_tp_plan(layer, block))
        # A pipeline stage holds tok_emb only on the first stage, norm and head only on the last: plan what it has.
        root = {name: style for name, style in root.items() if getattr(model, name, None) is not None}
        if root:
            parallelize_module(model, tp_mesh, lora_tp_plan(model, root))
    if loss_parallel:
        model.register_forward_hook(_local_loss)


def _local_loss(module: nn.Module, args: Any, output: Any) -> Any:
    """The loss computed on vocabulary-sharded logits is a replicated DTensor: hand the caller (the
    trainer, which mixes it with plain tensors) this rank's copy. `to_local` is differentiable, and
    a replicated value's gradient is the same on every rank, so backward is unchanged."""
    from torch.distributed.tensor import DTensor

    return output.to_local() if isinstance(output, DTensor) else output


class LlamaStage(nn.Module):
    """One pipeline stage of a `LlamaLM`: its modules under the plain model's names."""

    _no_split_modules = ["TransformerBlock"]  # the FSDP2 / activation-checkpointing units

    def __init__(self, model: LlamaLM, layer_ids: Sequence[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.tok_emb = model.tok_emb if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.head = model.head if last else None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # not a buffer: stays out of state dicts
        self.positions: torch.Tensor | None = None
        """Context parallelism: the global positions of this rank's tokens (set by the pipeline before each schedule);
        the rotary tables are read at them. None: positions 0..T-1."""

    def rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].device != device:
            self._rope = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device)
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={self.cfg.max_seq_len}")
        return self._rope[0][:seq_len], self._rope[1][:seq_len]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] (first stage) or hidden states [B, T, D] -> hidden states, or logits [B, T, V] (last)."""
        if self.tok_emb is not None:
            self.rope(x.size(1), x.device)  # refuses token ids longer than the model's context
            x = self.tok_emb(x)
        # The whole table: each block's attention takes the first T rows for its (gathered) sequence;
        # x.size(1) here may be a sequence-parallel shard of it (tensor parallelism within the stage).
        cos, sin = self.rope(self.cfg.max_seq_len, x.device)
        if self.positions is not None:  # cp: row i of the tables is the rank's i-th token's global position
            cos, sin = cos[self.positions], sin[self.positions]
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.head is not None:
            assert self.norm is not None
            x = self.head(self.norm(x))
        return x


def split_llama(model: LlamaLM, *, stages: Sequence[int], layer_counts: Sequence[int]) -> list[LlamaStage]:
    """Cut `model` (typically on meta) into the given stages; `layer_counts[s]` blocks for stage s."""
    if not isinstance(model, LlamaLM):
        raise TypeError(f"pipeline parallelism splits dptrain's LlamaLM, got {type(model).__name__}")
    if model.cfg.tie_embeddings:
        raise ValueError("tied embeddings cannot be split over pipeline stages (first and last stage)")
    starts = [sum(layer_counts[:s]) for s in range(len(layer_counts))]
    n = len(layer_counts)
    return [
        LlamaStage(model, range(starts[s], starts[s] + layer_counts[s]), first=s == 0, last=s == n - 1) for s in stages
    ]


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels aligned with the predictions) of a LlamaLM batch (see LlamaLM.forward)."""
    if isinstance(batch, Mapping):
        return batch["input_ids"], batch["labels"]
    if isinstance(batch, Sequence):
        ids, labels = batch
        return ids, labels
    return batch[:, :-1], batch[:, 1:]
