"""`zero2` and `fsdp`: FSDP2 `fully_shard` on every block, deepest first, then on the root.

`fsdp` (ZeRO-3) frees the gathered parameters after forward; `zero2` keeps them until
backward (`reshard_after_forward=False`): gradients and optimizer state stay sharded,
parameters are gathered once per step. `cpu_offload` keeps the shards on the host. On a 2-D
mesh (dp_replicate, dp_shard) FSDP2 shards within a dp_shard group and all-reduces across
replicas: HSDP.

The blocks ("units") are the classes named in the model's `_no_split_modules` (Hugging Face's
convention) when it has one, else the members of every `nn.ModuleList`; a model that names its input and
output embeddings (Hugging Face's `get_input_embeddings`/`get_output_embeddings`, also through a PEFT
wrapper) and does not tie them gets each as a unit of its own, as torchtitan shards its token embedding: then
the root holds neither, and the two vocabulary-sized tensors are never gathered at the same time. Each is sharded before
any module that contains it (FSDP2 requires children before parents); a model with no unit is
sharded at the root only, with a warning, since then every parameter is gathered at once.

`reshard_after_forward` may also be an int N (a divisor of the shard group's size): after forward
the parameters stay sharded over groups of N ranks, so backward all-gathers over N ranks only.
Explicit prefetching (`prefetch=(forward, backward)`, blocks ahead) calls FSDP2's
`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` on each block in forward
order; (0, 0) keeps FSDP2's implicit one-block prefetch.

A model on the meta device is sharded there; the `materialize` hook (`dptrain.parallel.materialize`)
then allocates and fills only this rank's shards.

An `nn.Embedding` unit is not gathered again in backward (its backward reads only the ids and the gradient). On the
host (`free_gather_buffers_early`), each unit's all-gather is one broadcast per rank into FSDP2's flat buffer, and
that buffer is freed at its copy-out: the gathered unit exists twice at most, for the copy, where gloo's all-gather and
FSDP2's GPU-minded deferred free made it three or four times.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

try:  # FSDP2's custom-communication interface (set_custom_all_gather); not exported by torch.distributed.fsdp
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
except ImportError:  # an older torch: FSDP2's own all-gather stays (HostAllGather is never set)
    AllGather = object  # type: ignore[assignment,misc]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def block_units(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(depth, module) of every block below the root: `_no_split_modules` classes when the model
    names any that it contains, else the members of every nn.ModuleList. Each module once."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: dict[int, tuple[int, nn.Module]] = {}
    if names:
        for path, module in model.named_modules():
            if path and type(module).__name__ in names:
                found.setdefault(id(module), (path.count(".") + 1, module))
    if not found:
        for path, module in model.named_modules():
            if isinstance(module, nn.ModuleList):
                depth = path.count(".") + 2 if path else 1
                for child in module:
                    found.setdefault(id(child), (depth, child))
    if found:
        embeddings = {id(m) for m in _untied_embeddings(model)}
        for path, module in model.named_modules():
            if path and id(module) in embeddings:
                found.setdefault(id(module), (path.count(".") + 1, module))
    return list(found.values())


def _untied_embeddings(model: nn.Module) -> list[nn.Module]:
    """The model's input and output embedding modules when it names both (Hugging Face's getters) and they share
    no parameter; [] otherwise (a tied pair stays with the root: one parameter cannot be in two units)."""
    try:
        pair = [model.get_input_embeddings(), model.get_output_embeddings()]  # type: ignore[operator]
    except (AttributeError, NotImplementedError, TypeError):
        return []
    if not all(isinstance(m, nn.Module) for m in pair):
        return []
    first, second = ({id(p) for p in m.parameters()} for m in pair)
    return [] if first & second or pair[0] is pair[1] else pair


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one, deepest first (children before the blocks that hold them)."""
    units = sorted(block_units(model), key=lambda du: -du[0])  # stable: registration order within a depth
    return [m for _, m in units]


def mixed_precision(param_dtype: str | None, reduce_dtype: str | None) -> MixedPrecisionPolicy | None:
    """FSDP2's policy from dtype names; None (the parameters' own dtype throughout) when neither is set."""
    if param_dtype is None and reduce_dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype] if param_dtype else None,
                                reduce_dtype=DTYPES[reduce_dtype] if reduce_dtype else None)


def apply_fsdp(
    model: nn.Module, *, device: torch.device, mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True, cpu_offload: bool = False, mp_policy: MixedPrecisionPolicy | None = None,
    materialize: Callable[[nn.Module], None] | None = None, prefetch: tuple[int, int] = (0, 0),
) -> nn.Module:
    """Shard `model` in place over `mesh` (default: every rank, 1-D) and return it (now an FSDPModule).
    Parameters on the meta device are sharded first and then handed to `materialize`."""

    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and materialize is None:
        raise ValueError(
            "the model's parameters are on the meta device: pass materialize= to allocate and initialise them"
        )
    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if cpu_offload:
        # pinned host memory only helps (and only exists) with an accelerator to copy to
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    elif not on_meta:
        model = model.to(device)
    units = shard_units(model)
    if not units:
        warnings.warn(
            f"FSDP: {type(model).__name__} has no nn.ModuleList and no _no_split_modules naming its blocks, so it is "
            "sharded as one unit at the root: every parameter is gathered at once and sharding saves no memory "
            "during forward/backward. Put the repeated blocks in an nn.ModuleList, or set "
            "`_no_split_modules = ['BlockClassName']` on the model",
            UserWarning,
            stacklevel=3,
        )
    for unit in units:
        fully_shard(unit, **kwargs)
        if isinstance(unit, nn.Embedding):
            # its backward reads no weight (only the ids and the gradient), so FSDP2 need not gather it again, and
            # does not prefetch it while the first block's backward holds its own gathered unit
            unit.set_unshard_in_backward(False)  # type: ignore[operator]
    fully_shard(model, **kwargs)
    set_prefetch(model, forward=prefetch[0], backward=prefetch[1])
    if device.type == "cpu":
        free_gather_buffers_early(model)
    if on_meta:
        assert materialize is not None
        materialize(model)  # after sharding: each rank allocates only its shards
    return model


def set_prefetch(model: nn.Module, *, forward: int = 0, backward: int = 0) -> None:
    """Each block (FSDP unit below the root, in forward order) prefetches the next `forward` blocks'
    all-gathers in forward and the previous `backward` blocks' in backward; 0 keeps FSDP2's implicit
    prefetch for that direction."""
    blocks = [m for path, m in model.named_modules() if path and isinstance(m, FSDPModule)]  # forward order
    for i, block in enumerate(blocks):
        if forward:
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + forward])
        if backward:
            block.set_modules_to_backward_prefetch(blocks[max(0, i - backward) : i][::-1])


def free_gather_buffers_early(model: nn.Module) -> None:
    """On the host: no all-gather buffer beyond the one FSDP2 gathers into, and none kept past its copy-out.

    - FSDP2's synchronous unshard (its default) keeps a unit's flat all-gather output alive in forward until the next
      unit's copy-out, so that on a GPU that copy-out overlaps the next all-gather on another stream. A CPU has no
      streams: nothing overlaps, and the kept buffer was a whole unit (0.2 GB for a block of a 1B Llama) on top of the
      next unit's gather. FSDP2's asynchronous unshard (`_set_unshard_async_op`: a Work waited at the copy-out) frees
      it at once.
    - gloo's all-gather into one tensor gathers into a flat buffer of its own and then copies it out
      (ProcessGroupGloo's allgather): a second copy of the gathered unit while it runs. `HostAllGather`
      (FSDP2's `set_custom_all_gather`) gathers with one broadcast from each rank straight into its slice.

    Measured on a 1B Llama under LoRA on 4 ranks (benchmarks/memory/finetune_memory_phases.py): each saves one
    block's bytes at the peaks of forward and backward. Same bytes moved per rank, same values."""
    setter = getattr(model, "_set_unshard_async_op", None)
    if callable(setter):  # FSDPModule's since torch 2.6; without it the buffer is only kept longer
        setter(True)
    for module in model.modules():
        if isinstance(module, FSDPModule) and hasattr(module, "set_custom_all_gather"):
            groups = module._get_fsdp_state()._fsdp_param_groups
            if len(groups) == 1:  # the custom comm is per unit
                params = groups[0].fsdp_params
                module.set_custom_all_gather(HostAllGather(into=params[0] if len(params) == 1 else None))


def _all_of(works: list[dist.Work]) -> dist.Work:
    """One Work for several (FSDP2 waits for its all-gather's Work at the copy-out): torch's own Work of a future
    that completes when every one has, and fails when one failed. A rank that waits on it blocks inside FSDP2's
    copy-out, so the hang diagnostics see it waiting in torch.distributed as before."""
    done = torch.futures.collect_all([w.get_future() for w in works]).then(lambda f: [x.value() for x in f.value()])
    return torch._C._distributed_c10d._create_work_from_future(done)  # type: ignore[attr-defined]


class HostAllGather(AllGather):
    """FSDP2's all-gather as one broadcast from each rank into its slice of the output: on gloo the gathered unit
    exists once (see `free_gather_buffers_early`). The output is the flat ``[world * shard]`` buffer FSDP2
    allocates, the input this rank's slice of it (FSDP2 copies the shards in place).

    `into`: a unit of one parameter (an embedding, a head: the largest units) sharded on dim 0 gathers straight into
    the parameter's own unsharded storage, which is laid out as the flat buffer (its shards, padded, in rank order):
    FSDP2's copy-out then copies it onto itself (a no-op), and the vocabulary-sized matrix exists once instead of
    twice for that moment. From its second gather on (FSDP2 makes that storage at the first copy-out); any mismatch
    (dtype, size, a tensor subclass that packs its own all-gather inputs) gets a buffer of its own, as FSDP2's."""

    def __init__(self, *, into: Any = None) -> None:
        super().__init__()
        self.into = into  # FSDP2's FSDPParam of a one-parameter unit

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        own = self._own_storage(size, dtype, device)
        return own if own is not None else torch.empty(*size, dtype=dtype, device=device)

    def _own_storage(self, size: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        param = self.into
        outputs = getattr(param, "all_gather_outputs", None)
        if param is None or not outputs or len(outputs) != 1 or getattr(param.fsdp_placement, "dim", None) != 0:
            return None
        if hasattr(getattr(param, "_sharded_local_tensor", None), "fsdp_pre_all_gather"):
            return None
        out = outputs[0]
        numel = 1
        for n in size:
            numel *= int(n)
        if out.numel() != numel or out.dtype != dtype or out.device != device or not out.is_contiguous():
            return None
        storage = out.untyped_storage()
        if storage.size() != numel * out.itemsize:
            storage.resize_(numel * out.itemsize)  # FSDP2 frees it by resizing to 0 at every reshard
        # a tensor of its own on that storage: the gather's writes bump its version counter, not the parameter's
        # (which autograd checks for the weight a forward saved; FSDP2's own copy-out preserves it the same way)
        with torch.no_grad():
            shape = tuple(int(n) for n in size)
            contiguous = torch.empty(shape, device="meta").stride()
            return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape, contiguous)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        slices = output_tensor.view(group.size(), -1)
        mine = slices[group.rank()]
        if mine.data_ptr() != input_tensor.data_ptr():
            mine.copy_(input_tensor.view(-1))
        if not async_op:
            for i, piece in enumerate(slices):
                dist.broadcast(piece, group_src=i, group=group)
            return None
        return _all_of([dist.broadcast(piece, group_src=i, group=group, async_op=True)
                        for i, piece in enumerate(slices)])
