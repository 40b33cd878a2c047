"""Nested dicts addressed by dotted keys ('train.max_steps'): how overrides and DeepSpeed's translation set config
values before the dataclasses are built."""

from __future__ import annotations

import sys
from typing import Any

from dptrain.config.fields import ConfigError


def has_dotted(data: dict[str, Any], key: str) -> bool:
    """Whether data[a][b][c] exists for key 'a.b.c'."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set data[a][b][c] = value for key 'a.b.c', creating dicts on the way."""
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(f"override {key!r}: {part!r} holds a value, not a section")
        node = nxt
    node[parts[-1]] = value


# Fields renamed since a release: old dotted key -> new. The old names still load (files, overrides, a run
# directory's saved config.yaml) with one warning line naming them (`rename_old_keys`, `current_key`).
RENAMED: dict[str, str] = {
    "checkpoint.memory_every_steps": "checkpoint.snapshot_every_steps",
    "checkpoint.memory_dir": "checkpoint.snapshot_dir",
    "diagnostics.memory_every_steps": "diagnostics.rss_every_steps",
    "diagnostics.memory_window": "diagnostics.rss_window",
    "diagnostics.memory_leak_mb": "diagnostics.rss_leak_mb",
}
_pending: list[str] = []  # old names met while loading, said at the next `tell_renamed`
_told: set[str] = set()  # old names already said in this process


def tell_renamed() -> None:
    """One warning line naming the renamed keys met since the last call (each once per process): old -> new."""
    fresh = [key for key in dict.fromkeys(_pending) if key not in _told]
    _pending.clear()
    if fresh:
        _told.update(fresh)
        pairs = ", ".join(f"{key} -> {RENAMED[key]}" for key in fresh)
        print(f"dptrain: warning: renamed config keys: {pairs} (the old names still load; use the new ones)",
              file=sys.stderr, flush=True)


def current_key(key: str) -> str:
    """`key`, or its new name when it was renamed (noted for `tell_renamed`)."""
    new = RENAMED.get(key)
    if new is None:
        return key
    _pending.append(key)
    return new


def rename_old_keys(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with every renamed key moved to its new name (in place; noted for `tell_renamed`); an old and a new
    name both set is refused."""
    for old, new in RENAMED.items():
        if not has_dotted(data, old):
            continue
        *path, name = old.split(".")
        parent = data
        for part in path:
            parent = parent[part]
        if has_dotted(data, new):
            raise ConfigError(f"{old} and {new} are both set; {old} is the old name of {new}: keep {new}")
        set_dotted(data, new, parent.pop(name))
        _pending.append(old)
    return data
