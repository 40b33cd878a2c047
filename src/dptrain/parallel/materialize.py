"""Meta-device init: build the model with no storage, shard or wrap it, then give every rank
exactly the weights that eager construction under `torch.manual_seed(seed)` produces.

Why a replay. Eager construction draws from the global CPU RNG in construction order, and a
DTensor's random ops do not reproduce a single-device stream. So `materialize` replays the
draws on the CPU, one module at a time in `model.named_modules()` order, on full-size scratch
tensors holding only that module's own parameters and buffers (peak extra memory: the largest
module, not the model). It then copies each result into the rank's local piece: the whole
tensor when replicated, the rank's chunk when it is a sharded DTensor. Every rank replays the
same stream, so no collective is needed.

The init contract (what a model needs for meta init). For each module, in order:

1. `module.reset_parameters()`, when the module defines it. PyTorch's layers (Linear,
   Embedding, LayerNorm, Conv, ...) call it in their constructors.
2. `model.init_submodule(name, module)`, when the ROOT model defines it. This is the model's
   own initialisation of that module's own tensors (not its children's). Its eager
   constructor must end by calling it for every `named_modules()` entry in that order
   (`LlamaLM.init_weights` does).

3. PEFT's LoRA adapters (a factory returning `get_peft_model(...)`, or `model.lora`): after every
   other draw, each LoRA layer in `named_modules()` order draws its adapters as peft's injection
   did (`dptrain.models.lora.replay_adapter_init`: the adapters' nn.Linear constructors, then
   peft's own `reset_lora_parameters`, so B is zero and the model starts equal to its base). Under
   a PEFT model, hook 2 is the base model's `init_submodule`, called with the base's module names.

Eager construction runs every hook 1 (in the constructors) before any hook 2, so the replay
keeps two RNG cursors. Hook 2's cursor starts where all of hook 1's draws end; a first walk
over hook 1, whose values are thrown away, finds that point. Afterwards the global RNG is left
where eager construction leaves it.

The model must also satisfy these rules:

- between them, the two hooks write every parameter and buffer of the module that owns it,
  and nothing else;
- the constructor draws from the RNG only through these hooks, in this order;
- non-persistent buffers (rotary tables) are recomputed by a hook.

`check_init_contract` tests what can be checked on the meta model: every tensor is written;
no hook writes another module's tensors; and the hooks write each tensor as many times as
construction did, which catches a constructor that initialises weights some other way
(nanoGPT's `self.apply(self._init_weights)`). `dptrain.train.build.build_model_meta` also checks that
construction on meta left every tensor on meta, in the dtype it was registered with
(`converted_after_registration`: no `model.to(dtype)` in the factory), and left the CPU RNG
untouched. A factory that
fails any of these checks, or cannot be built on meta at all, is built eagerly as before, and
the reason is returned. The built-in models are tested bit-for-bit against eager construction.

Pretrained weights. A model that carries a `PretrainedSource` (dptrain/models/pretrained.py: a factory
built it from a local Hugging Face folder) is loaded instead: after allocation each rank reads its own
shards of the files (dptrain/parallel/load_pretrained.py). Its buffers were computed for real at build
time and are kept; only the tensors the files do not hold (adapters added later) are initialised by the
replay above, and only they must satisfy the init contract (`provided_names` lists the others).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from dptrain.models import lora
from dptrain.models.pretrained import find_source, load_names
from dptrain.parallel.load_pretrained import LoadReport, load_pretrained

__all__ = [
    "Materializer",
    "check_init_contract",
    "converted_after_registration",
    "local_chunk",
    "make_materializer",
    "materialize",
    "provided_names",
    "replay_init",
    "track_registrations",
]

Hook = Callable[[], None]


def _method(obj: nn.Module, name: str) -> Callable[..., None] | None:
    """`obj.<name>`, bound, when `obj`'s class defines it. Looked up on the class: a wrapper that
    forwards unknown attributes to the module inside (activation checkpointing's) does not count."""
    fn = getattr(type(obj), name, None)
    return functools.partial(fn, obj) if callable(fn) else None


def _init_root(model: nn.Module) -> Callable[..., None] | None:
    """The root's `init_submodule`, bound; for a PEFT model the base model's (peft wraps it)."""
    return _method(lora.base_of(model), "init_submodule")


def _hooks(model: nn.Module, name: str, module: nn.Module) -> tuple[Hook | None, Hook | None]:
    """(reset_parameters, the root's init_submodule) for one module; None where not defined. Under a PEFT model the
    root's hook gets the module's name in the base model (`lora.base_name`)."""
    init = _init_root(model)
    if init is not None and lora.is_peft_model(model):
        name = lora.base_name(name)
    return _method(module, "reset_parameters"), (functools.partial(init, name, module) if init else None)


def _own(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's own (non-recursive) parameters and buffers, by attribute name."""
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


@contextlib.contextmanager
def _scratch(module: nn.Module, device: torch.device | str) -> Iterator[dict[str, torch.Tensor]]:
    """Swap the module's own tensors for uninitialised full-size tensors on `device`; yield a dict
    that, on exit of the body, holds the tensors the module then holds (a hook may reassign a
    buffer); put the originals back on exit."""
    originals = dict(_own(module))
    for name, t in originals.items():
        empty = torch.empty(t.shape, dtype=t.dtype, device=device)
        setattr(module, name, nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty)
    after: dict[str, torch.Tensor] = {}
    try:
        yield after
        after.update((name, getattr(module, name)) for name in originals)
    finally:
        for name, t in originals.items():
            setattr(module, name, t)


def _write(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full-size `full` into `dst`: all of it, or this rank's chunk of a DTensor."""
    if isinstance(dst, DTensor):
        full = local_chunk(full, dst.device_mesh, dst.placements)
        dst = dst.to_local()
    if full.shape != dst.shape:
        raise RuntimeError(
            f"meta init: an init hook produced shape {tuple(full.shape)} for a tensor of shape {tuple(dst.shape)}"
        )
    dst.copy_(full)


def local_chunk(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's piece of `full` under `placements`, as `distribute_tensor` cuts it, without a
    collective. For plain Shard/Replicate placements it is a view: no copy of the module's
    tensor (the copy would double the replay's transient memory). Any other placement goes
    through `distribute_tensor(..., src_data_rank=None)`, which moves `full` to the mesh's
    device and copies it."""
    if not all(type(p) in (Shard, Replicate) for p in placements):
        return distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
    for mesh_dim, p in enumerate(placements):  # DTensor shards left to right over the mesh dims
        if isinstance(p, Shard):
            pieces = torch.chunk(full, mesh.size(mesh_dim), dim=p.dim)
            rank = mesh.get_local_rank(mesh_dim)
            # torch.chunk returns fewer pieces than ranks for a short dim: the rest get empty ones
            full = pieces[rank] if rank < len(pieces) else full.narrow(p.dim, 0, 0)
    return full


def _run(hook: Hook | None, state: torch.Tensor) -> torch.Tensor:
    """Run `hook` with the global CPU RNG at `state`; return the RNG state after it."""
    if hook is None:
        return state
    torch.set_rng_state(state)
    hook()
    return torch.get_rng_state()


def _full_name(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr


def _kept(name: str, module: nn.Module, skip: frozenset[str]) -> bool:
    """The module's own tensors all come from elsewhere (`skip`: pretrained files, real buffers)."""
    return bool(skip) and all(_full_name(name, attr) in skip for attr, _ in _own(module))


def provided_names(model: nn.Module) -> frozenset[str]:
    """Names (in `model`, every alias) of the tensors that are not initialised by the replay: those a
    `PretrainedSource` loads and the buffers a pretrained build computed for real. Empty without a source."""
    found = find_source(model)
    if found is None:
        return frozenset()
    loaded = {id(t) for t, _, _ in load_names(model, *found)}
    out = set()
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, t in _own(module):
            if id(t) in loaded or (not _on_meta(t) and attr in module._buffers):
                out.add(_full_name(mod_name, attr))
    return frozenset(out)


@torch.no_grad()
def replay_init(model: nn.Module, *, seed: int, skip_meta: bool = False, skip: frozenset[str] = frozenset()) -> None:
    """Fill every parameter and buffer of `model` (already materialized with `to_empty`) with the
    values eager construction under `torch.manual_seed(seed)` gives them (see the module docstring).
    `skip_meta`: leave tensors still on the meta device alone (a pipeline stage cut from `model`
    shares its modules; the rest of `model` stays on meta, but its draws are replayed all the same).
    `skip`: names of tensors that come from elsewhere (`provided_names`): they are not written, and a
    module holding only such tensors is not replayed at all."""
    adapters = lora.adapter_modules(model)  # LoRA adapters: hook 3, after the base's draws
    modules = [(n, m) for n, m in model.named_modules() if id(m) not in adapters and not _kept(n, m, skip)]
    has_init = _init_root(model) is not None
    torch.manual_seed(seed)
    cursor1 = cursor2 = torch.get_rng_state()
    if has_init:
        for name, module in modules:  # find where hook 2's draws start; the values are discarded
            reset, _ = _hooks(model, name, module)
            if reset is not None:
                with _scratch(module, "cpu"):
                    cursor2 = _run(reset, cursor2)
    for name, module in modules:
        reset, init = _hooks(model, name, module)
        targets = dict(_own(module))
        with _scratch(module, "cpu") as produced:
            cursor1 = _run(reset, cursor1)
            cursor2 = _run(init, cursor2)
        for attr, full in produced.items():
            if not (skip_meta and _on_meta(targets[attr])) and _full_name(name, attr) not in skip:
                _write(targets[attr], full)
    torch.set_rng_state(cursor2 if has_init else cursor1)  # where eager construction of the base leaves it
    for _, layer in lora.lora_layers(model):  # hook 3: peft's injection, in its order, continuing the stream
        _replay_adapters(model, layer, skip_meta=skip_meta)


def _replay_adapters(model: nn.Module, layer: nn.Module, *, skip_meta: bool) -> None:
    """Write `layer`'s LoRA adapters as peft's injection drew them (`lora.replay_adapter_init`), on CPU scratch."""
    owners = [m for attr in lora.ADAPTER_WEIGHTS for m in getattr(layer, attr).values()]
    targets = [dict(_own(m)) for m in owners]
    with contextlib.ExitStack() as stack:
        produced = [stack.enter_context(_scratch(m, "cpu")) for m in owners]
        lora.replay_adapter_init(model, layer)
    for target, out in zip(targets, produced, strict=True):
        for attr, full in out.items():
            if not (skip_meta and _on_meta(target[attr])):
                _write(target[attr], full)


def _on_meta(t: torch.Tensor) -> bool:
    return (t.to_local() if isinstance(t, DTensor) else t).is_meta


def materialize(
    module: nn.Module, *, device: torch.device | str, seed: int, source: nn.Module | None = None
) -> LoadReport | None:
    """Allocate `module`'s meta parameters and buffers on `device` (`to_empty`; for FSDP with CPU
    offload pass the CPU: the shards live there) and initialise them as eager construction would,
    or, for a model with a pretrained source, load them (returns what this rank read; None otherwise).
    `source`: the whole (meta) model `module` was cut from, sharing its modules (a pipeline
    stage): the init of all of `source` is replayed, so the RNG stream is eager construction's,
    and only `module`'s tensors are written."""
    whole = module if source is None else source
    found = find_source(whole)
    skip = provided_names(whole)
    aliases = _aliases(module)
    real = [(m, attr, t) for m in module.modules() for attr, t in m.named_buffers(recurse=False) if not t.is_meta]
    module.to_empty(device=device)
    # to_empty gives each module its own new Parameter (meta -> a real device cannot swap data in
    # place), which unties shared weights (tied embeddings); tie them again.
    for owner, attr, src, src_attr in aliases:
        setattr(owner, attr, getattr(src, src_attr))
    for owner, attr, t in real:  # buffers a pretrained build computed for real (rotary tables)
        setattr(owner, attr, t.to(device))
    replay_init(whole, seed=seed, skip_meta=source is not None, skip=skip)
    return None if found is None else load_pretrained(whole, *found)


def _aliases(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, attribute, first module, its attribute) for every tensor registered more than once."""
    first: dict[int, tuple[nn.Module, str]] = {}
    out = []
    for module in model.modules():
        for attr, t in _own(module):
            if id(t) in first:
                out.append((module, attr, *first[id(t)]))
            else:
                first[id(t)] = (module, attr)
    return out


class Materializer:
    """The hook `parallelize(..., materialize=...)` calls once the model is sharded (FSDP) or
    before it is wrapped (DDP): `hook(module)`. `for_part(source)` is the hook for a part cut from
    `source` (a pipeline stage), replaying the whole model's init. A model with pretrained weights
    is loaded instead; `reports` then holds what this rank read, and `say` (rank 0's console) gets one
    line saying so."""

    def __init__(self, *, device: torch.device | str, seed: int, say: Callable[[str], None] | None = None) -> None:
        self.device, self.seed, self.say = device, seed, say
        self.reports: list[LoadReport] = []

    def __call__(self, module: nn.Module, *, source: nn.Module | None = None) -> None:
        report = materialize(module, device=self.device, seed=self.seed, source=source)
        if report is not None:
            self.reports.append(report)
            if self.say is not None:
                self.say(report.line())

    def for_part(self, source: nn.Module) -> Callable[[nn.Module], None]:
        return functools.partial(self, source=source)


def make_materializer(
    *, device: torch.device | str, seed: int, say: Callable[[str], None] | None = None
) -> Materializer:
    """The meta-device init hook for `parallelize` (see `Materializer`)."""
    return Materializer(device=device, seed=seed, say=say)


@contextlib.contextmanager
def track_registrations() -> Iterator[dict[int, tuple[torch.Tensor, torch.dtype]]]:
    """Record every parameter and buffer registered on any module while the body runs, with
    its dtype at that moment (PyTorch's global registration hooks, removed on exit). The tensors
    are held, so their ids stay unique. Used around a meta build: see `converted_after_registration`."""
    seen: dict[int, tuple[torch.Tensor, torch.dtype]] = {}

    def record(module: nn.Module, name: str, t: torch.Tensor | None) -> None:
        if t is not None:
            seen[id(t)] = (t, t.dtype)

    handles = [register_module_parameter_registration_hook(record), register_module_buffer_registration_hook(record)]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def converted_after_registration(
    model: nn.Module, seen: dict[int, tuple[torch.Tensor, torch.dtype]], *, skip: frozenset[str] = frozenset()
) -> str | None:
    """Why a tensor of `model` is not as it was registered (`model.to(dtype)` or `.half()` in
    the factory), or None. The replay would initialise such a tensor in its final dtype, but
    eager construction initialised it first and converted it afterwards."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name in skip:  # loaded from pretrained files, or a buffer computed for real
            continue
        if id(t) not in seen:
            return f"{name!r} was replaced after construction (e.g. by model.to(...) in the factory)"
        if seen[id(t)][1] != t.dtype:
            return (
                f"{name!r} was converted from {seen[id(t)][1]} to {t.dtype} after it was initialised "
                "(e.g. model.to(dtype) in the factory)"
            )
    return None


@torch.no_grad()
def check_init_contract(model: nn.Module, *, skip: frozenset[str] = frozenset()) -> str | None:
    """None if the init hooks of `model`, freshly built on meta, write every parameter and buffer
    of the module that owns it, nothing else, and as often as construction wrote it; otherwise the
    first violation, in words. The last part compares version counters (one bump per in-place
    write, also on meta). It catches a constructor that initialises weights some other way, as
    nanoGPT's `self.apply(self._init_weights)` does. A tensor shared by several modules (tied
    weights) is exempt from that count. `skip`: names of tensors that come from elsewhere
    (`provided_names`): they need no hook."""
    problem = lora.unsupported_init(model)
    if problem is not None:
        return problem
    adapters = lora.adapter_modules(model)  # written by peft's own init (hook 3), replayed exactly
    modules = [(n, m) for n, m in model.named_modules() if id(m) not in adapters]
    owners: dict[int, int] = {}
    for _, m in modules:
        for _, t in _own(m):
            owners[id(t)] = owners.get(id(t), 0) + 1
    every = {id(t): t for _, m in modules for _, t in _own(m)}
    built = {k: t._version for k, t in every.items()}  # in-place writes during construction
    for name, module in modules:
        if _kept(name, module, skip):
            continue
        problem = _check_module(model, name, module, every=every, built=built, owners=owners, skip=skip)
        if problem is not None:
            return problem
    return None


def _check_module(
    model: nn.Module,
    name: str,
    module: nn.Module,
    *,
    every: dict[int, torch.Tensor],
    built: dict[int, int],
    owners: dict[int, int],
    skip: frozenset[str],
) -> str | None:
    where = f"module {name or '<root>'!r} ({type(module).__name__})"
    before = {k: t._version for k, t in every.items()}
    originals = dict(_own(module))
    with _scratch(module, "meta") as produced:
        scratch = dict(_own(module))
        for hook in _hooks(model, name, module):
            if hook is not None:
                hook()
    if any(t._version != before[k] for k, t in every.items()):
        return f"an init hook of {where} writes tensors of other modules"
    for attr, t in scratch.items():
        if produced[attr] is not t or _full_name(name, attr) in skip:  # a recomputed buffer; a loaded tensor
            continue
        if t._version == 0:
            return (
                f"{where}: {attr!r} is not set by reset_parameters() or the model's "
                "init_submodule(); its eager value cannot be replayed"
            )
        key = id(originals[attr])
        if owners[key] == 1 and t._version != built[key]:
            return (
                f"{where}: construction wrote {attr!r} {built[key]} time(s) but its init hooks write it "
                f"{t._version} time(s): it is initialised some other way (define the model's "
                "init_submodule(name, module) for it)"
            )
    return None
