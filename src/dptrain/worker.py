"""The process torchrun starts on every rank: `python -m dptrain.worker RUN_DIR`.

The launcher has already resolved and validated the config and written it to RUN_DIR/config.yaml.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dptrain.overrides import load_config
from dptrain.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dptrain.worker RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    cfg = load_config(run_dir / "config.yaml")
    Trainer(cfg, out_dir=run_dir).fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
