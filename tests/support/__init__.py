"""What the tests share: the multi-process harness (mp), run and checkpoint helpers, the parity
ladder's reference, and the factories and losses the tests' configs name by import path
(`support.slow_loss:slow_loss`; tests/ is on sys.path, see conftest.py).

No test module imports another: what two of them need lives here.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout: src/, tests/, benchmarks/, examples/."""
TESTS = ROOT / "tests"


def subprocess_env(*, tests: bool = True, **extra: str) -> dict[str, str]:
    """os.environ with PYTHONPATH led by this checkout's src/ and, with `tests`, tests/ (so a worker can
    import `support.*` factories and losses), plus `extra` variables (e.g. OMP_NUM_THREADS="1")."""
    paths = [str(ROOT / "src"), *([str(TESTS)] if tests else []), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}


def overrides(*parts: list[str] | tuple[str, ...]) -> list[str]:
    """Override lists joined with the later setting of a key winning (a test's case on top of its base
    recipe): `dptrain` refuses one key given twice with two values on a command line. Items without
    `=` (a config file, options and their values) are kept in place."""
    out: list[str] = []
    where: dict[str, int] = {}
    for item in (i for part in parts for i in part):
        key = item.split("=", 1)[0] if "=" in item and not item.startswith("-") else None
        if key is not None and key in where:
            out[where[key]] = item
            continue
        if key is not None:
            where[key] = len(out)
        out.append(item)
    return out
