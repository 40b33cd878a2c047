"""What a checkpoint holds, as named `Stateful` objects: the manager never sees a Trainer.

`CheckpointState` lists the pieces a run is made of; each is anything with `state_dict()` and
`load_state_dict(sd)` (torch.distributed.checkpoint.stateful.Stateful):

- `model_parts`: a list (one entry today; one per pipeline stage later). `ModelState` gets and
  sets a module's state through DCP's `get_model_state_dict`/`set_model_state_dict`, so the
  names are the plain module's whatever wraps it (DDP, FSDP2) and sharded tensors stay sharded
  (`full=False`, the `dcp` format) or come back whole on CPU (`full=True`, the `full` format);
- `optimizers`: a list, `OptimizerState` through `get/set_optimizer_state_dict` (keyed by
  parameter name); ZeRO-1's ZeroRedundancyOptimizer, which DCP does not handle, is consolidated
  on rank 0 and converted to the same name-keyed layout, so ddp/zero1/single read each other's;
- `schedule`, `scaler` (the LR schedule and GradScaler are Stateful already);
- `data` (`DataPosition`: the sampler's world-size-free position at the trained step);
- `train` (step, samples seen, skipped steps; anything whose state_dict has those keys);
- `per_rank`: each rank's own state besides its RNG (which the manager always adds), e.g. the
  logging window; restored only at the same world size.

A ParallelModel (or any object) that owns state-dict get/set can stand in for `ModelState` and
`OptimizerState`: any Stateful works.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.optim import ZeroRedundancyOptimizer

from dptrain.checkpoint.rng import get_rng_state, set_rng_state
from dptrain.distributed import collectives
from dptrain.parallel import unwrap


def _options(full: bool, *, flat: bool = False) -> StateDictOptions:
    # full: whole tensors on CPU, complete on rank 0 (the only rank that writes the full format). flat: the
    # optimizer's hyperparameters keyed by parameter name ("param_groups.<name>.lr"), not by group index: DCP
    # keeps one copy of a key that several ranks write, so with ranks holding different parameters (pipeline
    # stages) the nested layout's "param_groups.0.params" of one rank would stand for every rank's.
    return StateDictOptions(full_state_dict=full, cpu_offload=full, flatten_optimizer_state_dict=flat)


class ModelState:
    """A model (part) as a Stateful, through DCP's state-dict helpers. `trainable_only` (LoRA adapters): only the
    parameters that require gradients are saved and loaded (DCP's `ignore_frozen_params`); the frozen base comes from
    the model factory again, and its identity is checked by the manager (checkpoint/base_identity.py)."""

    def __init__(self, module: nn.Module, *, full: bool, trainable_only: bool = False) -> None:
        self.module, self.full, self.trainable_only = module, full, trainable_only

    def _opts(self, *, full: bool, cpu_offload: bool) -> StateDictOptions:
        return StateDictOptions(full_state_dict=full, cpu_offload=cpu_offload,
                                ignore_frozen_params=self.trainable_only, strict=not self.trainable_only)

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module, options=self._opts(full=self.full, cpu_offload=self.full))

    def live_state_dict(self) -> dict[str, Any]:
        """`state_dict` from the module's own: its tensors live (a sharded module's: its DTensors), and 30x cheaper
        than DCP's helper (the in-memory snapshots take it at every step; see live_state.py)."""
        own = unwrap(self.module).state_dict()
        if not self.trainable_only:
            return own
        return {k: v for k, v in own.items() if k in self._trainable()}

    def _trainable(self) -> set[str]:
        return {n for n, p in unwrap(self.module).named_parameters() if p.requires_grad}

    def _check_complete(self, state_dict: dict[str, Any]) -> None:
        """With `trainable_only` DCP loads non-strictly (the frozen keys are absent by design): refuse a state dict
        that lacks a trainable parameter, which strict loading would have caught."""
        missing = sorted(self._trainable() - set(state_dict)) if self.trainable_only else []
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} trainable parameter(s) of this model, e.g. "
                             f"{missing[0]!r}: it was written for other adapters")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Whole tensors go into an unsharded module as they are: DCP's full_state_dict loading path
        # (meant for distributing into shards) is not needed for the `full` format's models.
        self._check_complete(state_dict)
        set_model_state_dict(self.module, state_dict, options=self._opts(full=False, cpu_offload=False))

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Whole tensors (the `full` format, every rank holding them) into this module, sharded
        or not: each rank keeps its own shard (a full checkpoint resumed under FSDP2 or tp)."""
        self._check_complete(state_dict)
        set_model_state_dict(self.module, state_dict, options=self._opts(full=True, cpu_offload=False))


def param_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The plain module's name of every parameter, in the optimizer's order (torch numbers them so)."""
    name_of = {p: n for n, p in unwrap(module).named_parameters()}
    return [name_of[p] for group in optimizer.param_groups for p in group["params"]]


def is_index_keyed(sd: dict[str, Any]) -> bool:
    """True for torch's own optimizer layout (parameters numbered 0..n-1), which format version 1
    wrote to `optim.pt`; False for the name-keyed layout of DCP's helpers."""
    groups = sd.get("param_groups") or [{}]
    return any(isinstance(p, int) for p in groups[0].get("params", []))


def index_to_names(sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """torch's index-keyed optimizer state dict -> DCP's name-keyed one."""
    if sum(len(g["params"]) for g in sd["param_groups"]) != len(names):
        raise ValueError(f"optimizer state has {sum(len(g['params']) for g in sd['param_groups'])} parameters, "
                         f"this model {len(names)}")
    return {"state": {names[i]: s for i, s in sd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}


def names_to_index(sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of `index_to_names`. DCP lists a shared (tied) parameter under each of its names;
    `names` has the first only, so the other names are dropped."""
    index = {n: i for i, n in enumerate(names)}
    return {
        "state": {index[n]: s for n, s in sd["state"].items() if n in index},
        "param_groups": [{**g, "params": [index[n] for n in g["params"] if n in index]} for g in sd["param_groups"]],
    }


class OptimizerState:
    """An optimizer as a Stateful keyed by parameter name. Collective for ZeRO-1 and FSDP."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool) -> None:
        self.module, self.optimizer, self.full = module, optimizer, full
        self.flat = True  # sharded state dicts in DCP's flattened layout (format version 3); False: version <= 2

    def state_dict(self) -> dict[str, Any]:
        opt = self.optimizer
        if isinstance(opt, ZeroRedundancyOptimizer):
            opt.consolidate_state_dict(to=0)  # collective: every rank sends its shard to rank 0
            if collectives.rank() != 0:
                return {}
            return index_to_names(opt.state_dict(), param_names(self.module, opt))
        return get_optimizer_state_dict(self.module, opt, options=_options(self.full, flat=self.flat and not self.full))

    def live_state_dict(self) -> dict[str, Any]:
        """`state_dict` (not ZeRO-1's; DCP's nested layout) from torch's own, keyed by name."""
        return index_to_names(self.optimizer.state_dict(), param_names(self.module, self.optimizer))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        names = param_names(self.module, self.optimizer)
        if is_index_keyed(state_dict):  # a format-version-1 `optim.pt`
            state_dict = index_to_names(state_dict, names)
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            self.optimizer.load_state_dict(names_to_index(state_dict, names))  # ZeRO re-partitions the full state
            return
        set_optimizer_state_dict(self.module, self.optimizer, state_dict)

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Whole, name-keyed optimizer state (the `full` format) into this optimizer, sharded or not."""
        if is_index_keyed(state_dict):
            state_dict = index_to_names(state_dict, param_names(self.module, self.optimizer))
        set_optimizer_state_dict(
            self.module, self.optimizer, state_dict, options=StateDictOptions(full_state_dict=True)
        )


class RngState:
    """This process's Python, numpy, torch (and CUDA) generator states."""

    def state_dict(self) -> dict[str, Any]:
        return get_rng_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_rng_state(state_dict)


class DataPosition:
    """The sampler's position at the trained step (the loader prefetches ahead of training)."""

    def __init__(self, sampler: Any, train: Stateful) -> None:
        self.sampler, self.train = sampler, train

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict(step=int(self.train.state_dict()["step"]))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state_dict)


@dataclass
class CheckpointState:
    """Everything a checkpoint saves and restores; see the module docstring. `full`: the `full`
    format (plain/DDP/ZeRO-1 models) rather than DCP shards (FSDP2). `meta` goes into the
    manifest as is (e.g. the global batch size, which a resume at another world size keeps)."""

    model_parts: list[Stateful]
    optimizers: list[Stateful]
    schedule: Stateful
    scaler: Stateful | None
    data: Stateful
    train: Stateful
    full: bool
    per_rank: dict[str, Stateful] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    extra_files: dict[str, Any] = field(default_factory=dict)
    """Further files rank 0 writes into the step folder (name -> tensors and plain data, `torch.save`d, read back
    with `weights_only=True`), hashed like the others: the `Checkpointer`'s `extra.pt`."""

    def __post_init__(self) -> None:
        if not self.model_parts or not self.optimizers:
            raise ValueError(
                f"CheckpointState needs at least one model part and one optimizer, got "
                f"{len(self.model_parts)} and {len(self.optimizers)}"
            )
        if "rng" in self.per_rank:
            raise ValueError("per_rank name 'rng' is reserved: the manager saves every rank's RNG states itself")
