"""LoRA adapters in and out of PEFT's own layout: `final/` of a run that trains a PEFT model is what
`PeftModel.save_pretrained` writes (`adapter_model.safetensors` + `adapter_config.json`), loadable by
`PeftModel.from_pretrained(base, final/)`; `merged_model` builds the run's model, puts a checkpoint's (or final/'s)
adapters in and merges them with peft's own `merge_and_unload` (`dptrain ckpt export --merge`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dptrain.models import lora
from dptrain.parallel import unwrap

__all__ = ["ADAPTER_FILE", "adapter_state", "is_adapter_folder", "merge_adapters", "save_adapters"]

ADAPTER_FILE = "adapter_model.safetensors"


def adapter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of `module` (a PEFT model, wrapped or sharded) as whole CPU tensors under the plain
    module's names; the frozen base is never gathered. Collective under FSDP2 (call on every rank); complete on rank 0.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    sd = get_model_state_dict(module, options=options)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def save_adapters(module: nn.Module, state: dict[str, torch.Tensor], out_dir: Path) -> None:
    """`PeftModel.save_pretrained(out_dir, state_dict=state)`: PEFT's adapter files (rank 0 only; `state` from
    `adapter_state`)."""
    peft_model = lora.peft_model_of(unwrap(module))
    if peft_model is None:
        raise ValueError(f"{type(unwrap(module)).__name__} is not a PEFT model: it has no adapters to save")
    peft_model.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)


def is_adapter_folder(folder: Path) -> bool:
    """Whether `folder` holds PEFT's adapter files."""
    return (folder / ADAPTER_FILE).is_file() and (folder / "adapter_config.json").is_file()


def merge_adapters(model: nn.Module, trained: dict[str, Any]) -> nn.Module:
    """The PEFT model `model` with the trained adapter values `trained` (a run checkpoint's model state, under the
    PEFT model's names: frozen keys, if any, are ignored), merged into its base by peft's `merge_and_unload`."""
    peft_model = lora.peft_model_of(model)
    if peft_model is None:
        raise ValueError(f"{type(model).__name__} is not a PEFT model: there are no adapters to merge")
    names = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    missing = sorted(names - set(trained))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} adapter tensor(s) of this model, e.g. {missing[0]!r}")
    with torch.no_grad():
        params = dict(peft_model.named_parameters())
        for name in names:
            params[name].copy_(trained[name])
    return peft_model.merge_and_unload()
