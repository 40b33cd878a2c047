"""Nested dicts addressed by dotted keys ('train.max_steps'): how overrides and DeepSpeed's translation set config
values before the dataclasses are built."""

from __future__ import annotations

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
