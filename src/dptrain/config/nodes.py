"""`launch.nnodes`: a node count `N`, or an elastic range `MIN:MAX` (torch-free).

Overrides and files are read with YAML 1.2 scalars (config/load.py), so `1:2` arrives as the
string '1:2' (YAML 1.1 would read the base-60 integer 62).
"""

from __future__ import annotations

import re

from dptrain.config.fields import ConfigError, LaunchConfig

_RANGE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")

RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat", "keep_alive_interval",
                  "keep_alive_max_attempt", "read_timeout")
"""torchrun's c10d rendezvous settings a `launch.rdzv_conf` may set (all take whole seconds or counts)."""

ELASTIC_RDZV_DEFAULTS = {"last_call_timeout": 2, "keep_alive_interval": 1, "keep_alive_max_attempt": 3}
"""What an elastic run (`launch.nnodes=MIN:MAX`) uses where `launch.rdzv_conf` says nothing, instead of torchrun's
30 s last call and 5 s x 3 keep-alive: after a node is lost the survivors re-form the group once the dead node's
heartbeat is 3 s old (not 15 s) and wait 2 s (not 30 s) for more nodes. Nodes started more than 2 s apart begin
with fewer nodes; the late one joins at the next step boundary (a join costs no restart and no step)."""


def node_range(nnodes: int | str) -> tuple[int, int]:
    """`launch.nnodes` as (min, max): N -> (N, N), 'MIN:MAX' -> (MIN, MAX). ConfigError otherwise."""
    if isinstance(nnodes, int) and not isinstance(nnodes, bool):
        lo = hi = nnodes
    else:
        m = _RANGE.match(str(nnodes))
        if not m:
            raise ConfigError(f"launch.nnodes={nnodes!r} is not valid; write a node count (2) or an elastic range "
                              "MIN:MAX (1:2)")
        lo, hi = int(m[1]), int(m[2])
    if lo < 1 or hi < lo:
        raise ConfigError(f"launch.nnodes={nnodes!r} is not valid; it must be an integer >= 1 or MIN:MAX with "
                          "1 <= MIN <= MAX")
    return lo, hi


def max_nodes(launch: LaunchConfig) -> int:
    """The most nodes the run may have (the world size the launcher plans for)."""
    return node_range(launch.nnodes)[1]


def is_elastic(launch: LaunchConfig) -> bool:
    """Whether the node count may change while the run goes on (MIN < MAX)."""
    lo, hi = node_range(launch.nnodes)
    return lo < hi


def torchrun_nnodes(launch: LaunchConfig) -> str:
    """torchrun's --nnodes value: 'N' or 'MIN:MAX'."""
    lo, hi = node_range(launch.nnodes)
    return str(hi) if lo == hi else f"{lo}:{hi}"


def parse_rdzv_conf(text: str | None) -> dict[str, int]:
    """`launch.rdzv_conf` ('key=value,...') checked against torchrun's c10d settings; ConfigError otherwise."""
    out: dict[str, int] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in RDZV_CONF_KEYS or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"launch.rdzv_conf={text!r}: {item.strip()!r} is not valid; write key=N (N >= 1 "
                              f"seconds or counts) with key one of {', '.join(RDZV_CONF_KEYS)}")
        out[key] = int(value)
    return out


def rdzv_settings(launch: LaunchConfig) -> dict[str, int]:
    """The c10d settings the launcher hands torchrun: `launch.rdzv_conf`'s, on top of ELASTIC_RDZV_DEFAULTS for
    an elastic run (torchrun's own defaults otherwise)."""
    return {**(ELASTIC_RDZV_DEFAULTS if is_elastic(launch) else {}), **parse_rdzv_conf(launch.rdzv_conf)}
