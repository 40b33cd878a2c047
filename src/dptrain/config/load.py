"""Loading configs: YAML recipes, JSON files, and `section.field=value` overrides.

DeepSpeed-style JSON is translated by `config/deepspeed.py`.

Everything goes through one path: file -> nested dict -> overrides applied to the dict ->
`build_config` which turns the dict into the frozen dataclass tree, refusing unknown keys
with the list of valid ones.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from dptrain.config.datasource import resolve_data_source
from dptrain.config.deepspeed import translate_deepspeed
from dptrain.config.dotted import current_key, has_dotted, rename_old_keys, set_dotted, tell_renamed
from dptrain.config.fields import Config, ConfigError, to_dict
from dptrain.config.layout import strategy_mode
from dptrain.config.ranges import RANGES


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                defaults: Sequence[str] = ()) -> Config:
    """Read a YAML recipe or a JSON file (native or DeepSpeed-style), then apply dotted overrides.
    `defaults`: `field=value` items under the file (a preset: set only where the file does not)."""
    data: dict[str, Any] = {}
    if path is not None:
        data = load_file(path)
    for item in defaults:
        key, value = parse_override(item)
        if not has_dotted(data, key):
            set_dotted(data, key, value)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    return resolve_data_source(build_config(data))


def load_file(path: str | Path) -> dict[str, Any]:
    """The nested dict a config file describes; DeepSpeed JSON is translated (unknown keys warned about)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory; pass a YAML recipe or a JSON file")
    if not p.exists():  # a FIFO or /dev/fd/N (`<(...)`) exists without being a regular file: read it
        section = str(path).split(".")[0]
        if "." in str(path) and section in {f.name for f in dataclasses.fields(Config)} and "/" not in str(path):
            raise ConfigError(f"{str(path)!r} has no value: an override is section.field=value, e.g. {path}=VALUE")
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
        # JSON by its name, or (a pipe has none) by its first character
        is_json = p.suffix == ".json" or (p.suffix not in (".yaml", ".yml") and text.lstrip().startswith("{"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(p)!r} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {e.strerror or e}") from None
    try:
        raw = json.loads(text, object_pairs_hook=_unique_object) if is_json else load_yaml(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot parse config file {str(p)!r}: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"config file {str(p)!r}: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level, not {type(raw).__name__}")
    sections = {f.name for f in dataclasses.fields(Config)}
    # A JSON file is dptrain's own when any top-level key is one of its sections (then an unknown key,
    # e.g. a misspelled section, is refused below like YAML's); else DeepSpeed's, translated.
    # `checkpoint` is a section of both.
    if is_json and not set(raw) & (sections - {"checkpoint"}):
        m = translate_deepspeed(raw)
        for note in m.notes:
            warn(f"{p.name}: {note}")
        if m.ignored:
            warn(f"{p.name}: DeepSpeed keys dptrain does not use (ignored): {', '.join(sorted(m.ignored))}")
        return rename_old_keys(m.config)
    return rename_old_keys(raw)


def warn(message: str) -> None:
    """A clean `dptrain: warning: ...` line on stderr (no Python source line)."""
    print(f"dptrain: warning: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- YAML 1.2 scalars
# PyYAML implements YAML 1.1, where `1:2` is the base-60 integer 62, `no`/`off`/`yes` are
# booleans and `010` is octal. Config files and override values are read with the YAML 1.2
# core schema instead: null/~, true/false, decimal/0o/0x integers, floats (1e-3, .inf, .nan);
# everything else is a string, which the field's type then accepts or refuses by name.
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


def resolve_scalar(text: str) -> Any:
    """A plain (unquoted) scalar read by the YAML 1.2 core schema."""
    if _NULL.match(text):
        return None
    if _BOOL.match(text):
        return text.lower() == "true"
    if _INT.match(text):
        return _int12(text)
    if _FLOAT.match(text):
        return _float12(text)
    return text


def _int12(text: str) -> int:
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


def _float12(text: str) -> float:
    low = text.lower()
    if low.endswith(".inf"):
        return float("-inf") if low.startswith("-") else float("inf")
    if low == ".nan":
        return float("nan")
    return float(text)


class Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema implicit resolvers (no sexagesimals, no yes/no/on/off)."""

    yaml_implicit_resolvers: dict[Any, Any] = {}


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    return _int12(loader.construct_scalar(node))


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    return _float12(loader.construct_scalar(node))


for _tag, _rx, _first in (
    ("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", _BOOL, list("tTfF")),
    ("tag:yaml.org,2002:int", _INT, list("-+0123456789")),
    ("tag:yaml.org,2002:float", _FLOAT, list("-+.0123456789")),
):
    Yaml12Loader.add_implicit_resolver(_tag, _rx, _first)
def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    """A mapping whose keys are all different: a key given twice (YAML would keep the last silently)
    is refused, naming the key, both values and their lines."""
    loader.flatten_mapping(node)
    seen: dict[Any, tuple[Any, int]] = {}
    out: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        value = loader.construct_object(value_node, deep=True)
        if key in seen:
            first, line = seen[key]
            raise ConfigError(
                f"duplicate key {key!r}: {first!r} (line {line}) and {value!r} (line {key_node.start_mark.line + 1}); "
                "keep one"
            )
        seen[key] = (value, key_node.start_mark.line + 1)
        out[key] = value
    return out


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads`' object hook: a key given twice in one JSON object is refused, naming both values."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"duplicate key {key!r}: {out[key]!r} and {value!r}; keep one")
        out[key] = value
    return out


Yaml12Loader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)
Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
Yaml12Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def load_yaml(text: str) -> Any:
    """Parse YAML text with the YAML 1.2 core schema for plain scalars."""
    return yaml.load(text, Loader=Yaml12Loader)  # noqa: S506 - a SafeLoader subclass


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", value parsed as a YAML 1.2 scalar, or a flow list/mapping)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.field=value")
    key, _, text = item.partition("=")
    key = key.strip()
    if not key or "." not in key:
        raise ConfigError(f"override {item!r}: the key must be dotted, e.g. train.max_steps=100")
    key = current_key(key)
    if re.search(r"(^|\s)#", text):  # YAML would drop ` #...` as a comment: a shell line means it literally
        return key, text
    try:
        value = load_yaml(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    return key, value


def build_config(data: dict[str, Any]) -> Config:
    """Nested dict -> Config; unknown keys raise ConfigError naming the valid keys. Renamed keys under their old
    names load, said in one warning line (config/dotted.py `RENAMED`)."""
    cfg = _build(Config, rename_old_keys(data), prefix="")
    tell_renamed()
    return cfg


def _build(cls: type, data: dict[str, Any], *, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        where = prefix.rstrip(".") or "the top level"
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r}; valid keys in {where}: {', '.join(fields)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if value is None:  # `train:` with nothing under it
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix + name!r} must be a section (mapping), not {value!r}")
            kwargs[name] = _build(hint, value, prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**_merge_kwargs(cls, kwargs))


def _merge_kwargs(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Dict-valued fields (`kwargs`) given partially are merged over their defaults only when the
    factory is the default one; a different factory starts from an empty dict."""
    out = dict(kwargs)
    for f in dataclasses.fields(cls):
        if f.name == "kwargs" and "kwargs" in out and "factory" not in out:
            default = f.default_factory() if callable(f.default_factory) else {}
            out["kwargs"] = {**default, **(out["kwargs"] or {})}
        elif f.name == "kwargs" and "factory" in out and "kwargs" not in out:
            out["kwargs"] = {}
    return out


def _coerce(value: Any, hint: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{name} cannot be null")
    if origin in (typing.Union, types.UnionType):
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, name)
            except ConfigError:
                continue
        raise _type_error(name, value, hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, str):  # "1_000", "+5" in a JSON string
            value = _number(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, str):  # "inf", "nan", "1_000.5": read, then range-checked by validate()
            value = _number(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # e.g. launch.rdzv_id=42
    elif origin is dict:
        if isinstance(value, dict):
            return value
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[int, ...]
        if isinstance(value, list | tuple):
            return tuple(_coerce(v, args[0], name) for v in value)
    elif origin is tuple:
        if isinstance(value, list | tuple) and len(value) == len(args):
            return tuple(_coerce(v, a, name) for v, a in zip(value, args, strict=True))
    else:
        return value
    raise _type_error(name, value, hint)


def _type_error(name: str, value: Any, hint: Any) -> ConfigError:
    """`name=value has the wrong type`, with the field's valid range where it has one."""
    section, _, field = name.partition(".")
    rng = RANGES.get(section, {}).get(field)
    valid = f"; it must be {rng.describe()}" if rng is not None else ""
    return ConfigError(f"{name}={value!r} has the wrong type; expected {_hint_name(hint)}{valid}")


def _number(text: str) -> Any:
    """`text` as an int or float when it spells one, else unchanged (the caller reports the type error)."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            continue
    return text


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def dump_yaml(cfg: Config, extra: dict[str, Any] | None = None) -> str:
    """The config as YAML (plus an optional `resolved` section of derived values, ignored when loaded back)."""
    d = to_dict(cfg)
    text = yaml.safe_dump(d, sort_keys=False)
    if extra:
        text += "# derived values (not read back):\n" + "".join(f"#   {k}: {v}\n" for k, v in extra.items())
    return text


def load_command_line(items: list[str], *, extra: Sequence[str] | Mapping[str, str] = (),
                      run_dir: str | None = None, flags: Mapping[str, str] | None = None,
                      defaults: Sequence[str] = ()) -> Config:
    """The config a `dptrain` command line names: CONFIG is the one item without '=' (if any, in any
    position); the rest are overrides, then `extra` (from the command's options: a list of overrides,
    or {field: override}). An option and an override that set one field to different values are
    refused, naming both (`flags`: field -> the option's name, for the message). Without CONFIG, an
    existing `run_dir`'s config.yaml is the base (continuing that run). `defaults`: a preset's
    `field=value` items under CONFIG (`--defaults torch`)."""
    files = [item for item in items if "=" not in item]
    overrides = [item for item in items if "=" in item]
    given: dict[str, Any] = {}
    for item in overrides:  # one value per key on a command line: the later one would silently win
        key, value = parse_override(item)
        if key in given and given[key] != value:
            raise ConfigError(f"override {key} given twice: {key}={given[key]!r} and {key}={value!r}; keep one")
        given[key] = value
    if isinstance(extra, Mapping):
        for field, item in extra.items():
            _, value = parse_override(item)
            if field in given and given[field] != value:
                flag = (flags or {}).get(field, field)
                raise ConfigError(f"{flag} {value} and the override {field}={given[field]} disagree; give one of them")
        extra = [item for field, item in extra.items() if field not in given]
    if len(files) > 1:
        raise ConfigError(
            f"{files[1]!r} is not an override of the form section.field=value "
            f"(only one CONFIG file may be given; {files[0]!r} is the first)"
        )
    path = files[0] if files else None
    if path is None and run_dir is not None and (Path(run_dir) / "config.yaml").is_file():
        path = str(Path(run_dir) / "config.yaml")
    cfg = load_config(path, [*overrides, *extra], defaults=defaults)
    if cfg.launch.nproc_per_node == "auto" and strategy_mode(cfg.parallel).single_process:
        # one-process strategies: `auto` means one worker (dp drives every GPU from it)
        cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, nproc_per_node=1))
    return cfg
