"""Users' models measured with fake tensors: one micro-batch forward and backward, no real allocation.

`measure_model` builds the model from `model.factory` under PyTorch's `FakeTensorMode` (every
tensor carries shape, dtype and device but no storage: a 20B-parameter model costs a few MB of
host memory), makes one fake micro-batch and runs dptrain's loss (`train.loss` or the model's
forward, `dptrain.train.loss`) forward and backward under the run's autocast (`dptrain.train.precision`),
on the CPU's op set. It counts:

- parameters: count and bytes in all, by dtype, and the trainable ones (a tensor shared by
  several modules once);
- activations: the bytes autograd saves for backward (`saved_tensors_hooks`, each storage once,
  parameters excluded; autocast's half copies of weights count), in all and per outermost block
  (the blocks `parallel.activation_checkpointing` checkpoints), and the bytes of the blocks' inputs;
- training FLOPs per micro-batch (`FlopCounterMode` over forward and backward: matmuls,
  convolutions, attention), and the blocks' forward FLOPs (recomputed by full checkpointing);
- the largest FSDP unit: the parameter bytes one `fully_shard` call owns under dptrain's wrapping
  (`parallel.fsdp.shard_units`, deepest first, then the root with the rest).

The micro-batch: the data factory's dataset is built (cheap for synthetic data; the built-in
corpus reads its cache), ONE real sample `train[0]` is taken, and `micro_batch` references to it
are collated (`data.collate` or torch's `default_collate`) inside the fake mode, so the batch has
the shapes and dtypes the trainer's loader gives and no storage. Values are not known: a model
whose shapes depend on its data (boolean masks, `.item()`) cannot be measured and raises.
Activation checkpointing `full` is derived from the one uncheckpointed pass: the storages alive
while the largest block is recomputed, each once (outside the blocks + every block's input + that
block's own set). plan/llama.py counts the recomputed block's input a second time (one [B, T, d]
fp32 tensor more); `selective` is counted as `none` (an upper bound), as there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dptrain.config.fields import ConfigError

if TYPE_CHECKING:  # the planner's CLI imports this module; torch is imported inside the functions
    import torch
    from torch import nn

    from dptrain.config import DataConfig, ModelConfig


class MeasureError(ConfigError):
    """The model (or its data) could not be built or run on fake tensors; names the factory."""


@dataclass(frozen=True)
class ModelProfile:
    """What one fake (or real) micro-batch forward and backward of a model measured."""

    factory: str
    params: int
    trainable: int
    param_bytes: int
    trainable_bytes: int
    bytes_by_dtype: dict[str, int]
    units: int  # FSDP units below the root
    largest_unit_bytes: int
    micro_batch: int
    precision: str
    saved_bytes: int  # saved for backward, no checkpointing
    outside_bytes: int  # of which first saved outside the outermost blocks
    block_input_bytes: int  # the blocks' inputs not saved outside (what full checkpointing keeps)
    block_recompute_bytes: tuple[int, ...]  # per block: saved inside it, less the blocks' inputs
    flops: int  # forward + backward of one micro-batch
    block_forward_flops: int
    seq_len: int | None = None  # tokens per sample, when the dataset says (`seq_len`)
    optimizer_groups: tuple[tuple[int, ...], ...] = ()  # numel of each trainable tensor, by dptrain's groups

    def activation_bytes(self, checkpointing: str = "none") -> int:
        """Bytes saved for backward by one micro-batch under `checkpointing`: none/selective all of
        them; full the storages alive while the largest block is recomputed, each once (outside
        the blocks + every block's input + that block's own set)."""
        if checkpointing != "full" or not self.block_recompute_bytes:
            return self.saved_bytes
        return self.outside_bytes + self.block_input_bytes + max(self.block_recompute_bytes)

    def training_flops(self, checkpointing: str = "none") -> int:
        """FLOPs of one micro-batch's forward and backward; full checkpointing runs the blocks'
        forward again (selective keeps the matmul outputs, the only FLOPs counted)."""
        return self.flops + (self.block_forward_flops if checkpointing == "full" and self.block_recompute_bytes else 0)


def param_stats(model: nn.Module) -> dict[str, Any]:
    """Parameter count and bytes: all, trainable, by dtype (each tensor once); the trainable
    tensors' sizes in `dptrain.train.optim.param_groups`' groups (matrices, then 1-D), for zero1."""
    params = list(model.parameters())  # deduplicated by nn.Module
    by_dtype: dict[str, int] = {}
    for p in params:
        key = str(p.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + p.numel() * p.element_size()
    train = [p for p in params if p.requires_grad]
    groups = (tuple(p.numel() for p in train if p.ndim >= 2), tuple(p.numel() for p in train if p.ndim < 2))
    return {"params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in train),
            "param_bytes": sum(by_dtype.values()), "trainable_bytes": sum(p.numel() * p.element_size() for p in train),
            "bytes_by_dtype": by_dtype, "optimizer_groups": tuple(g for g in groups if g)}


def fsdp_unit_bytes(model: nn.Module) -> list[int]:
    """Parameter bytes each `fully_shard` call of dptrain's FSDP wrapping owns: the units deepest
    first (each takes the parameters of its subtree not yet taken), the root last."""
    # lazy: torch: only to measure a user's model (the LLaMA's formulas need none)
    from dptrain.parallel.fsdp import shard_units

    taken: set[int] = set()
    out = []
    for unit in [*shard_units(model), model]:
        own = [p for p in unit.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        out.append(sum(p.numel() * p.element_size() for p in own))
    return out


class _Recorder:
    """Saved-tensor bytes by region (outside the blocks = -1, else block index), block inputs and
    the blocks' forward FLOPs, through module hooks around the outermost blocks."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], flop_counter: Any) -> None:
        self.params = {p.untyped_storage()._cdata for p in model.parameters()}
        self.seen: dict[int, tuple[Any, int, int]] = {}  # storage id -> (storage, bytes, region)
        self.inputs: dict[int, tuple[Any, int]] = {}
        self.region, self.counter, self.flops_at, self.block_flops = -1, flop_counter, 0, 0
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._enter(i), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._leave))

    def _enter(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            import torch
            from torch.utils._pytree import tree_leaves

            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and self._key(t) not in self.params:
                    self.inputs.setdefault(self._key(t), (t.untyped_storage(), t.untyped_storage().nbytes()))
            self.region, self.flops_at = index, self.counter.get_total_flops()
        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.block_flops += self.counter.get_total_flops() - self.flops_at
        self.region = -1

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata  # the StorageImpl: views and fake tensors share it

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = self._key(t)
        if key not in self.params and key not in self.seen:
            self.seen[key] = (t.untyped_storage(), t.untyped_storage().nbytes(), self.region)
        return t

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _loss(model: nn.Module, batch: Any, *, loss: str | None) -> torch.Tensor:
    # lazy: torch: only to measure a user's model (the LLaMA's formulas need none)
    from dptrain.train.build import build_loss_fn
    from dptrain.train.loss import count_targets, takes_num_items

    fn = build_loss_fn(loss)
    count = count_targets(batch) if takes_num_items(fn, model) else None
    if count is None:  # sample rule (the division by grad_accum_steps saves nothing)
        return fn(model, batch)
    return fn(model, batch, num_items_in_batch=count.clamp_min(1).float())  # token rule, one rank


def profile_module(model: nn.Module, batch: Any, *, micro_batch: int, precision: str, loss: str | None = None,
                   factory: str = "", seq_len: int | None = None) -> ModelProfile:
    """Measure one forward (dptrain's loss under the run's autocast) and backward of `model` on
    `batch` (`micro_batch` samples): real or fake tensors alike. The backward runs, so parameters
    get gradients."""
    import contextlib

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    # lazy: torch: only to measure a user's model (the LLaMA's formulas need none)
    from dptrain.parallel.activation_checkpointing import outermost_blocks

    blocks = outermost_blocks(model)
    counter = FlopCounterMode(display=False)
    rec = _Recorder(model, blocks, counter)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    amp = torch.autocast("cpu", dtype=half) if half is not None else contextlib.nullcontext()
    try:
        with counter:
            with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t), amp:
                value = _loss(model, batch, loss=loss)
            value.backward()
    finally:
        rec.remove()
    outside = {k for k, v in rec.seen.items() if v[2] < 0}
    inputs = {k: n for k, (_, n) in rec.inputs.items() if k not in outside}
    per_block = [0] * len(blocks)
    for key, (_, nbytes, region) in rec.seen.items():
        if region >= 0 and key not in inputs:
            per_block[region] += nbytes
    units = fsdp_unit_bytes(model)
    return ModelProfile(
        factory=factory, **param_stats(model), units=len(units) - 1, largest_unit_bytes=max(units),
        micro_batch=micro_batch,
        precision=precision, saved_bytes=sum(v[1] for v in rec.seen.values()),
        outside_bytes=sum(rec.seen[k][1] for k in outside), block_input_bytes=sum(inputs.values()),
        block_recompute_bytes=tuple(per_block),
        flops=int(counter.get_total_flops()), block_forward_flops=int(rec.block_flops), seq_len=seq_len)


def fake_batch(*, data: DataConfig, collate: str | None, micro_batch: int, mode: Any) -> tuple[Any, int | None]:
    """(micro-batch of fake tensors, the dataset's `seq_len` or None): `micro_batch` references to
    the dataset's first sample collated inside `mode` (module docstring)."""
    import torch
    from torch.utils._pytree import tree_map
    from torch.utils.data import default_collate

    # lazy: torch: only to measure a user's model (the LLaMA's formulas need none)
    from dptrain.train.build import build_datasets, import_object

    train, _ = build_datasets(data)
    sample = train[0]
    fn = import_object(collate) if collate else default_collate
    with mode:
        batch = fn([sample] * micro_batch)
    # a collate that built real tensors (torch.from_numpy): their fake counterparts
    batch = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) and not _is_fake(t) else t, batch)
    return batch, getattr(train, "seq_len", None)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def measure_model(*, model: ModelConfig, data: DataConfig, micro_batch: int, precision: str,
                  loss: str | None = None, collate: str | None = None, seed: int = 0) -> ModelProfile:
    """Build `model.factory` on fake tensors and measure one fake micro-batch (module docstring).
    Any error of the data factory, the model factory or the forward and backward is a
    `MeasureError` naming the factory and the step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # lazy: torch: only to measure a user's model (the LLaMA's formulas need none)
    from dptrain.train.build import build_model

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    step = f"building model.factory {model.factory!r} on fake tensors"
    try:
        with mode:
            module = build_model(model, seed=seed)
        step = f"building one micro-batch from data.factory {data.factory!r}"
        batch, seq_len = fake_batch(data=data, collate=collate, micro_batch=micro_batch, mode=mode)
        with mode:
            step = f"running model.factory {model.factory!r} forward and backward on fake tensors"
            return profile_module(module, batch, micro_batch=micro_batch, precision=precision, loss=loss,
                                  factory=model.factory, seq_len=seq_len)
    except Exception as e:  # noqa: BLE001 - whatever the user's code raised, said with where it was
        raise MeasureError(f"dptrain plan has formulas for the built-in LLaMA and measures other models on fake "
                           f"tensors; "
                           f"{step} failed: {type(e).__name__}: {e}") from e
