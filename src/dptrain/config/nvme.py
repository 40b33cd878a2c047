"""`parallel.nvme_offload_dir` (DeepSpeed's nvme_path): the directory must exist and take files. Checked by the
launcher before any worker starts (cli) and by the Trainer when it maps the optimizer state
(parallel/nvme_offload.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from dptrain.config.fields import ConfigError


def check_nvme_dir(path: str | Path, *, what: str = "parallel.nvme_offload_dir") -> Path:
    """`path` is an existing directory this process can create files in; else a ConfigError naming it."""
    p = Path(path)
    if not p.is_dir():
        why = "is a file, not a directory" if p.exists() else "does not exist"
        raise ConfigError(f"{what}={str(p)!r} {why}: NVMe offload needs an existing directory on the drive "
                          "(DeepSpeed's nvme_path); create it or point it at a mounted drive")
    try:
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ConfigError(f"{what}={str(p)!r} cannot hold files: {e.strerror or e}") from None
    return p
