"""Strictly valid JSON for every file a run writes.

`json.dumps` writes bare `NaN` and `Infinity` by default, which is not JSON: strict parsers fail
and jq reads them as null. A non-finite number is written as `null` instead, and its kind is
kept next to it: `{"loss": NaN}` becomes `{"loss": null, "loss_nonfinite": "nan"}` (`"inf"`,
`"-inf"` likewise). Inside a list the element becomes null and the list's key gets the flag of
the first such element. `allow_nan=False` then makes any number that slipped through fail loudly.
"""

from __future__ import annotations

import math
from typing import Any

SUFFIX = "_nonfinite"


def _kind(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _is_nonfinite(x: Any) -> bool:
    return isinstance(x, float) and not math.isfinite(x)


def sanitize(obj: Any) -> Any:
    """A copy of `obj` with every non-finite float replaced by None and flagged (see the module doc)."""
    if isinstance(obj, dict):
        out: dict[Any, Any] = {}
        for k, v in obj.items():
            flag = _first_nonfinite(v)
            out[k] = sanitize(v)
            if flag is not None and not isinstance(v, dict):
                out[f"{k}{SUFFIX}"] = flag
        return out
    if isinstance(obj, list | tuple):
        return [sanitize(v) for v in obj]
    return None if _is_nonfinite(obj) else obj


def _first_nonfinite(v: Any) -> str | None:
    if _is_nonfinite(v):
        return _kind(v)
    if isinstance(v, list | tuple):
        return next((f for f in map(_first_nonfinite, v) if f is not None), None)
    return None


def dumps(obj: Any, **kwargs: Any) -> str:
    """`json.dumps` of `sanitize(obj)` with `allow_nan=False`: always strictly valid JSON."""
    import json

    return json.dumps(sanitize(obj), allow_nan=False, **kwargs)
