"""The package itself: `import dptrain` stays cheap, and every public name resolves."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.fast]


def test_import_is_light() -> None:
    """Neither torch.distributed's FSDP nor its checkpoint stack (nor torch at all) loads on import."""
    code = (
        "import sys, dptrain; "
        "heavy = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.distributed.fsdp', "
        "'torch.distributed.checkpoint', 'dptrain.train.trainer'))]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import dptrain loaded: {out}"


def test_public_names_resolve() -> None:
    import dptrain

    for name in dptrain.__all__:
        assert getattr(dptrain, name) is not None, name
    assert set(dptrain.__all__) == {"__version__", *dptrain._EXPORTS}
    with pytest.raises(AttributeError):
        dptrain.no_such_name  # noqa: B018
