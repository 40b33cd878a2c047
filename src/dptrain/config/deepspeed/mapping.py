"""The translation record (`DeepSpeedMapping`) and the small readers every DeepSpeed section uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dptrain.config.dotted import set_dotted
from dptrain.config.fields import ConfigError


@dataclass
class DeepSpeedMapping:
    """What a DeepSpeed file became: (ds key, dptrain field, value) rows, DeepSpeed defaults applied,
    keys ignored (with the reason), and notes worth a warning (lenient reads, semantic differences)."""

    config: dict[str, Any] = field(default_factory=dict)
    mapped: list[tuple[str, str, Any]] = field(default_factory=list)
    defaults: list[tuple[str, str, Any]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def put(self, ds_key: str, target: str, value: Any) -> None:
        set_dotted(self.config, target, value)
        self.mapped.append((ds_key, target, value))

    def default(self, ds_key: str, target: str, value: Any) -> None:
        set_dotted(self.config, target, value)
        self.defaults.append((ds_key, target, value))

    def report(self) -> str:
        """The `config show` section: one line per key."""
        lines = ["# DeepSpeed keys -> dptrain fields:"]
        lines += [f"#   {k} -> {t} = {v!r}" for k, t, v in self.mapped]
        lines += ["# DeepSpeed defaults applied (keys the file leaves out):"]
        lines += [f"#   {k} (DeepSpeed default) -> {t} = {v!r}" for k, t, v in self.defaults] or ["#   (none)"]
        lines += ["# ignored (not used by dptrain):"] + ([f"#   {u}" for u in self.ignored] or ["#   (none)"])
        lines += [f"# note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def bad(key: str, value: Any, valid: str) -> ConfigError:
    return ConfigError(f"DeepSpeed {key}={value!r} is not valid; {valid}")


def block(ds: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The mapping under `key` (None when absent), with "auto" values dropped; refuses a non-mapping."""
    if key not in ds or ds[key] is None:
        return None
    v = ds[key]
    if not isinstance(v, dict):
        raise bad(key, v, "it must be a mapping (a JSON object)")
    return {k: x for k, x in v.items() if x != "auto"}


def number(key: str, v: Any, *, integer: bool = False, positive: bool = False) -> Any:
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if not ok or isinstance(v, bool) or (positive and v <= 0):
        kind = "an integer" if integer else "a number"
        raise bad(key, v, f'it must be {kind}{" > 0" if positive else ""} (or "auto")')
    return v


def enabled(key: str, v: Any, m: DeepSpeedMapping) -> bool:
    """DeepSpeed's `enabled` flag. Strings "true"/"false" and 0/1 are read (pydantic does) with a note."""
    if isinstance(v, bool):
        return v
    lenient = {"true": True, "false": False, 1: True, 0: False}
    if isinstance(v, str | int) and v in lenient:
        m.notes.append(f"{key}={v!r} read as {lenient[v]} (write true or false)")
        return lenient[v]
    raise bad(key, v, "use true or false")
