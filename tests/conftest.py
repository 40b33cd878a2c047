"""Shared fixtures: every test must leave no process group and no launcher variables behind."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Make tests/support (the shared helpers, and the factories configs name such as
# `support.parity:tiny_tokens`) importable whatever pytest's import mode or rootdir.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from support.mp import DIST_ENV_VARS  # noqa: E402
from support.run_helpers import SLOW_TOY, dptrain, losses  # noqa: E402

# Variables a launcher sets; a test that leaves them in os.environ makes every later test
# (and every later Trainer) believe it was started by torchrun.
LEAK_CHECKED_VARS = (*DIST_ENV_VARS, "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")


def _dist_initialized() -> bool:
    if "torch" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _patchable() -> dict[str, object]:
    """The CheckpointManager methods tests wrap, as they are now (empty until dptrain is imported)."""
    manager = sys.modules.get("dptrain.checkpoint.manager")
    if manager is None:
        return {}
    return {name: getattr(manager.CheckpointManager, name) for name in ("save", "maybe_resume")}


@pytest.fixture(autouse=True)
def no_leaked_distributed_state():
    """Fail a test that leaves torch.distributed initialised or launcher env vars changed in this process."""
    before = {k: os.environ.get(k) for k in LEAK_CHECKED_VARS}
    was_initialized = _dist_initialized()
    patched_before = _patchable()
    yield
    problems = []
    patched = [name for name, fn in _patchable().items() if name in patched_before and patched_before[name] is not fn]
    if patched:  # a helper that wraps these (tests/support/checkpoints.py:fit_capturing) must run in a forked rank
        import dptrain.checkpoint.manager as manager

        for name in patched:
            setattr(manager.CheckpointManager, name, patched_before[name])
        problems.append(f"CheckpointManager.{', '.join(patched)} left patched in the test process (later ranks "
                        "forked from it would inherit the patch)")
    if _dist_initialized() and not was_initialized:
        import torch.distributed as dist

        dist.destroy_process_group()  # clean up so the next test starts fresh
        problems.append("torch.distributed was left initialised in the test process")
    changed = {k: (before[k], os.environ.get(k)) for k in LEAK_CHECKED_VARS if os.environ.get(k) != before[k]}
    for k, (old, _new) in changed.items():
        if old is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = old
    if changed:
        problems.append(
            "environment variables leaked: " + ", ".join(f"{k}: {o!r} -> {n!r}" for k, (o, n) in changed.items())
        )
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture(scope="session")
def slow_toy_reference(tmp_path_factory) -> Path:
    """One uninterrupted `dptrain run` of SLOW_TOY on 2 ranks (30 steps, a checkpoint every 5): what the
    signal, restart and run-directory tests (test_checkpoint_e2e, test_run_dirs) must end bit-identical
    to. Trained once per session; a test that changes a run directory works on a copy."""
    out = tmp_path_factory.mktemp("slow-toy") / "ref"
    r = dptrain("run", *SLOW_TOY, "--nproc-per-node", "2", "--out", str(out), timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s for s, _ in losses(out)] == list(range(1, 31))
    return out
