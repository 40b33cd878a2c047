"""Where a model's weights come from when they are pretrained: a local folder of `*.safetensors` files.

A factory that starts from pretrained weights (`dptrain.models.hf:causal_lm`, or the built-in LLaMA with
`pretrained=DIR`) builds its module with every parameter on the meta device (`meta_parameters`: buffers, such
as rotary tables, are computed for real: they are small and derived from the config) and attaches a
`PretrainedSource`: the folder, its files, and which key of the files each parameter reads. The meta-device
init (`dptrain.parallel.materialize`) then LOADS those parameters, each rank only its own shards
(`dptrain.parallel.load_pretrained`), instead of initialising them at random. Parameters the files do not
hold (adapters added to the model afterwards) are initialised as any meta-built model's.

Everything here reads only the files' headers (names, shapes, dtypes): checking a folder costs no memory, so
factories check it on the meta build the launcher makes before any worker starts, and a missing folder, a
missing or unexpected key, or a shape mismatch is a ConfigError naming it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from dptrain.config import ConfigError

__all__ = [
    "ATTRIBUTE",
    "PretrainedSource",
    "TensorInfo",
    "attach_source",
    "files_dtype",
    "find_source",
    "load_names",
    "meta_parameters",
    "plain_name",
    "read_config",
    "read_index",
    "source_for",
]

ATTRIBUTE = "_dptrain_pretrained"
"""The attribute of the module a pretrained factory returns that holds its `PretrainedSource`."""

# segments wrappers insert into parameter names: activation checkpointing, torch.compile, PEFT's LoRA layers
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "base_layer.")

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the files, from its header: the file holding it, its shape and dtype, and where its bytes
    start in the file (`offset`; safetensors stores each tensor contiguous, row-major)."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = -1

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class PretrainedSource:
    """Where a model's parameters come from. `keys`: parameter name (relative to the module that carries
    this source, without wrapper segments) -> key in the files; every name a tied tensor has is listed.
    `cast`: convert floating tensors to the parameter's dtype (the model asked for another dtype than the
    files'); False: a dtype mismatch is an error."""

    folder: Path
    index: Mapping[str, TensorInfo]
    keys: Mapping[str, str]
    cast: bool = False

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(sorted({info.file for info in self.index.values()}))

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.index.values())


def read_index(folder: str | Path, *, what: str = "model.kwargs.pretrained") -> dict[str, TensorInfo]:
    """Key -> TensorInfo of a Hugging Face model folder's weights: `model.safetensors.index.json`'s files, or
    `model.safetensors`. Reads headers only. ConfigError naming the folder and what is expected otherwise."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(
            f"{what}={str(folder)!r} is not a directory; give a local folder written by save_pretrained "
            "(config.json and model.safetensors); nothing is ever downloaded"
        )
    if not (root / "config.json").is_file():
        raise ConfigError(f"{what}={str(folder)!r} has no config.json; a save_pretrained folder holds one")
    index_file = root / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text()).get("weight_map") or {}
        files = sorted({root / name for name in weight_map.values()})
    elif (root / "model.safetensors").is_file():
        files = [root / "model.safetensors"]
    else:
        found = sorted(p.name for p in root.iterdir())
        raise ConfigError(
            f"{what}={str(folder)!r} holds no model.safetensors and no model.safetensors.index.json (it holds: "
            f"{', '.join(found) or 'nothing'}); dptrain loads pretrained weights from safetensors files only "
            "(save the model with save_pretrained(..., safe_serialization=True))"
        )
    out: dict[str, TensorInfo] = {}
    for path in files:
        if not path.is_file():
            raise ConfigError(f"{what}={str(folder)!r}: {index_file.name} names {path.name}, which is missing")
        offsets = _data_offsets(path)
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                dtype = DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise ConfigError(f"{path}: tensor {key!r} has dtype {sl.get_dtype()}, which dptrain cannot load")
                if key in out:
                    raise ConfigError(
                        f"{what}={str(folder)!r}: {key!r} is in both {out[key].file.name} and {path.name}"
                    )
                out[key] = TensorInfo(path, tuple(sl.get_shape()), dtype, offsets[key])
    return out


def _data_offsets(path: Path) -> dict[str, int]:
    """Key -> the byte offset of its data in the safetensors file `path` (the format: an 8-byte little-endian header
    length, the JSON header with each tensor's `data_offsets` relative to the data that follows it)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {k: 8 + size + int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}


def read_config(folder: str | Path, *, what: str = "model.kwargs.pretrained") -> dict[str, object]:
    """The folder's config.json as a dict (after `read_index`'s checks)."""
    path = Path(folder) / "config.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what}={str(folder)!r}: config.json cannot be read: {e}") from None


def files_dtype(index: Mapping[str, TensorInfo], *, folder: str | Path) -> torch.dtype:
    """The one floating dtype of the files (ConfigError if they mix several: then the model needs a dtype)."""
    kinds = {i.dtype for i in index.values() if i.dtype.is_floating_point}
    if len(kinds) != 1:
        names = ", ".join(sorted(str(k).removeprefix("torch.") for k in kinds)) or "no"
        raise ConfigError(
            f"model.kwargs.pretrained={str(folder)!r} holds floating tensors of {names} dtype; "
            "name the dtype to train in with model.kwargs.dtype (float32, bfloat16, float16)"
        )
    return kinds.pop()


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build modules with every parameter on the meta device and every buffer computed for real on the CPU
    (whatever device context is around). A new parameter is swapped for a meta one when it is registered,
    before the module's own init runs, so initialisers write nothing and draw nothing; an already meta
    parameter (a tied weight assigned again) is kept, so ties hold."""

    def to_meta(module: nn.Module, name: str, param: torch.Tensor | None) -> torch.Tensor | None:
        if param is None or param.is_meta:
            return None
        return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(to_meta)  # type: ignore[arg-type]  # may return one
    try:
        with torch.device("cpu"):
            yield
    finally:
        handle.remove()


def plain_name(name: str, prefix: str = "") -> str:
    """A parameter's name as the files know it: relative to `prefix` (the carrier of the source), without the
    segments wrappers insert (activation checkpointing, torch.compile, PEFT's `base_layer`)."""
    if prefix:
        name = name[len(prefix) + 1:]
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def attach_source(model: nn.Module, source: PretrainedSource) -> None:
    model.__dict__[ATTRIBUTE] = source  # not setattr: a module's __setattr__ is for tensors and modules


def find_source(model: nn.Module) -> tuple[str, PretrainedSource] | None:
    """(the carrier's name in `model`, its source) for the first module of `model` carrying a
    `PretrainedSource` (the model itself, or the base model inside a PEFT wrapper), or None."""
    for name, module in model.named_modules():
        src = module.__dict__.get(ATTRIBUTE)
        if isinstance(src, PretrainedSource):
            return name, src
    return None


def named_tensors(model: nn.Module) -> dict[int, tuple[torch.Tensor, list[str]]]:
    """id -> (tensor, every name it has) over parameters and persistent buffers, in registration order."""
    out: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        persistent = [(n, b) for n, b in module.named_buffers(recurse=False)
                      if n not in module._non_persistent_buffers_set]
        for attr, t in [*module.named_parameters(recurse=False), *persistent]:
            name = f"{mod_name}.{attr}" if mod_name else attr
            out.setdefault(id(t), (t, []))[1].append(name)
    return out


def load_names(model: nn.Module, carrier: str, source: PretrainedSource) -> list[tuple[torch.Tensor, str, str]]:
    """(tensor, its first name, the file key it loads from) for every tensor of `model` the files hold.
    Every file key must be read by some tensor, and every tensor under `source.keys` must be found: a
    ConfigError naming the key otherwise. Tensors outside the carrier or outside `source.keys` (adapters added
    later) are not listed: they are initialised, not loaded."""
    out: list[tuple[torch.Tensor, str, str]] = []
    used: set[str] = set()
    for t, names in named_tensors(model).values():
        plain = [plain_name(n, carrier) for n in names if not carrier or n.startswith(carrier + ".")]
        keys = [source.keys[p] for p in plain if p in source.keys]
        if not keys:
            continue
        present = [k for k in keys if k in source.index]
        if not present:
            raise ConfigError(
                f"model.kwargs.pretrained={str(source.folder)!r} has no tensor {keys[0]!r} for the model's parameter "
                f"{plain[0]!r}; the folder does not hold this model's weights"
            )
        used.update(keys)
        _check_shape(t, present[0], source)
        out.append((t, names[0], present[0]))
    unused = sorted(set(source.index) - used)
    if unused:
        raise ConfigError(
            f"model.kwargs.pretrained={str(source.folder)!r} holds {len(unused)} tensor(s) the model has no "
            f"parameter for, e.g. {unused[0]!r}; the folder is not this model's (check config.json)"
        )
    return out


def _check_shape(t: torch.Tensor, key: str, source: PretrainedSource) -> None:
    info = source.index[key]
    shape = tuple(t.shape)
    if shape != info.shape:
        raise ConfigError(
            f"model.kwargs.pretrained={str(source.folder)!r}: {key!r} has shape {list(info.shape)}, the model's "
            f"parameter {list(shape)}"
        )
    if t.dtype != info.dtype and not (source.cast and t.dtype.is_floating_point and info.dtype.is_floating_point):
        raise ConfigError(
            f"model.kwargs.pretrained={str(source.folder)!r}: {key!r} is {info.dtype}, the model's parameter "
            f"{t.dtype}; set model.kwargs.dtype to convert"
        )


def source_for(
    model: nn.Module, folder: str | Path, index: Mapping[str, TensorInfo], *,
    key_of: Callable[[str], str] = lambda name: name, cast: bool = False,
) -> PretrainedSource:
    """The source of a freshly built `model` (every parameter and persistent buffer named by `key_of`), checked
    against the files' headers now (names, shapes, dtypes), and attached to `model`."""
    keys = {name: key_of(name) for _, names in named_tensors(model).values() for name in names}
    source = PretrainedSource(Path(folder), dict(index), keys, cast=cast)
    load_names(model, "", source)
    attach_source(model, source)
    return source
