"""The process torchrun starts on every rank: `python -m dptrain.worker RUN_DIR [--resume X] [--trust-checkpoint]`.

The launcher has already resolved and validated the config and written it to RUN_DIR/config.yaml.
Exit codes: 0 done, 143 preempted (SIGTERM; a checkpoint of the last finished step is committed).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from dptrain.checkpoint import EXIT_PREEMPTED
from dptrain.overrides import load_config
from dptrain.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dptrain.worker")
    p.add_argument("run_dir")
    p.add_argument("--resume", default="auto")
    p.add_argument("--trust-checkpoint", action="store_true")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    run_dir = Path(args.run_dir)
    cfg = load_config(run_dir / "config.yaml")
    trainer = Trainer(cfg, out_dir=run_dir, resume=args.resume, trust_checkpoint=args.trust_checkpoint)
    try:
        summary = trainer.fit()
    except BaseException:
        trainer.ckpt.record_error(traceback.format_exc())  # for the restart report (attempts.jsonl)
        raise
    return EXIT_PREEMPTED if summary.get("preempted") else 0


if __name__ == "__main__":
    sys.exit(main())
