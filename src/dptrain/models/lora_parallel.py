"""Tensor-parallel plans for peft's LoRA layers: a plan written for the plain model's linears (the built-in LLaMA's
`llama_tp_plan`, a Hugging Face `base_model_tp_plan`) rewritten for the LoRA layers peft put in their place
(`lora_tp_plan`). Only PyTorch's ParallelStyles split the tensors; no collective is written here.

A peft LoRA layer (`peft.tuners.lora.Linear`) holds the original linear as `base_layer` and the adapters as
`lora_A[name]` (r x in) and `lora_B[name]` (out x r); its forward is `base_layer(x) + lora_B(lora_A(dropout(x))) *
scaling`. The adapter's sum must come out in the base's layout, so each adapter follows the base's style
(the layouts PEFT's own Transformers TP integration and Megatron's LoRA layers use):

| base style | the LoRA layer | `base_layer` | `lora_A` | `lora_B` |
|---|---|---|---|---|
| ColwiseParallel (wq wk wv w1 w3; q/k/v, gate/up) | PrepareModuleInput -> Replicate | the base's style | ReplicateParallel: the full input, a replicated rank-r output | ColwiseParallel: its output sharded as the base's |
| RowwiseParallel (wo w2; o, down) | as it is | the base's style | RowwiseParallel: the sharded input, its partial sums reduced into the base's output layout | ReplicateParallel on that layout |

The colwise layer's PrepareModuleInput makes one replicated DTensor of `x` for both branches, so their input
gradients add up as partial sums and are reduced once (as the built-in plan does per block), and dropout, if any,
would see one tensor. Under sequence parallelism the rowwise base's output is Shard(1) (a reduce-scatter): lora_A's
output is reduced the same way and lora_B, replicated, runs on this rank's slice of the sequence (as
SequenceParallel runs a norm); its gradient is then a partial sum over the sequence slices, which DTensor reduces
as it does the norms' (the optimizer step, FSDP2's reduce-scatter and `clip_grad_norm_` see it whole).
"""  # noqa: E501 (a Markdown table: one row a line)

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

__all__ = ["ReplicateParallel", "keep_frozen", "lora_tp_plan"]


class ReplicateParallel(ParallelStyle):
    """A module whose parameters are replicated on the tp mesh (Replicate DTensors: `distribute_module`'s default),
    run on the layout of its input: a DTensor input as it is, a plain tensor taken as `input_layouts`. The output is
    a DTensor in the layout the computation gives (the input's, for a linear on a batch or sequence shard), or its
    local tensor (`use_local_output`). SequenceParallel is this for Shard(1) inputs; this one takes any layout."""

    def __init__(self, *, input_layouts: Placement | None = None, use_local_output: bool = False) -> None:
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.use_local_output = use_local_output

    @staticmethod
    def _prepare_input(layouts: tuple[Placement, ...], module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
        x = inputs[0]
        x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, layouts, run_check=False)
        return (x, *inputs[1:])

    @staticmethod
    def _prepare_output(use_local: bool, module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        return outputs.to_local() if use_local and isinstance(outputs, DTensor) else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            None,  # every parameter replicated
            functools.partial(self._prepare_input, self.input_layouts),
            functools.partial(self._prepare_output, self.use_local_output),
        )


def _lora_layer(module: nn.Module) -> bool:
    if "peft" not in sys.modules:  # a model cannot hold peft's layers unless peft is loaded
        return False
    from peft.tuners.lora import LoraLayer  # lazy: optional extra (dptrain[lora])

    return isinstance(module, LoraLayer)


def _check_layer(name: str, layer: nn.Module) -> None:
    from peft.tuners.lora import Linear  # lazy: optional extra (dptrain[lora])

    if not isinstance(layer, Linear):
        raise ValueError(f"tensor parallelism with LoRA: {name!r} is a {type(layer).__name__}; dptrain splits "
                         "peft's LoRA layers of nn.Linear only (target linears, or use parallel.tp=1)")
    variants = sorted({type(v).__name__ for v in (getattr(layer, "lora_variant", None) or {}).values()})
    others = [a for a in layer.adapter_layer_names if a not in ("lora_A", "lora_B") and len(getattr(layer, a, ()))]
    if variants or others:
        raise ValueError(f"tensor parallelism with LoRA: {name!r} has {', '.join(variants + others)} (a LoRA "
                         "variant such as DoRA); dptrain splits plain LoRA adapters only (or use parallel.tp=1)")


def _layer_plan(name: str, layer: Any, style: Any) -> dict[str, Any]:
    """The plan entries for one LoRA layer whose base linear the plan splits with `style`."""
    _check_layer(name, layer)
    plan: dict[str, Any] = {}
    if isinstance(style, ColwiseParallel):
        plan[name] = PrepareModuleInput(input_layouts=style.input_layouts, desired_input_layouts=(Replicate(),))
        plan[f"{name}.base_layer"] = style
        for adapter in layer.lora_A:
            plan[f"{name}.lora_A.{adapter}"] = ReplicateParallel(input_layouts=Replicate())
            plan[f"{name}.lora_B.{adapter}"] = ColwiseParallel(
                input_layouts=Replicate(), output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output)
    elif isinstance(style, RowwiseParallel):
        plan[f"{name}.base_layer"] = style
        out = style.output_layouts[0]
        for adapter in layer.lora_A:
            plan[f"{name}.lora_A.{adapter}"] = RowwiseParallel(
                input_layouts=style.input_layouts[0], output_layouts=out, use_local_output=False)
            plan[f"{name}.lora_B.{adapter}"] = ReplicateParallel(
                input_layouts=out, use_local_output=style.use_local_output)
    else:
        raise ValueError(f"tensor parallelism with LoRA: the plan splits the LoRA layer {name!r} with "
                         f"{type(style).__name__}; dptrain rewrites ColwiseParallel and RowwiseParallel entries for "
                         "LoRA layers only")
    return plan


def lora_tp_plan(root: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """`plan` (module names under `root`, no wildcards -> ParallelStyle) with each entry that names a peft LoRA layer
    replaced by the entries for its base linear and its adapters (module docstring); the plan as it is when it
    names none. Raises ValueError for a LoRA layer this cannot split (not a Linear's, a variant such as DoRA, a
    style other than Colwise/RowwiseParallel)."""
    out: dict[str, Any] = {}
    for name, style in plan.items():
        module = root.get_submodule(name) if name else root
        out.update(_layer_plan(name, module, style) if _lora_layer(module) else {name: style})
    return out


@contextlib.contextmanager
def keep_frozen(model: nn.Module) -> Iterator[None]:
    """Around a tensor-parallel plan's application: parameters frozen before it (LoRA's base) are frozen after it.
    SequenceParallel (torch 2.13) re-registers a norm's weight as a new `nn.Parameter`, which requires a gradient
    whatever the old one did: a frozen norm would silently train."""
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    yield
    params = dict(model.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
