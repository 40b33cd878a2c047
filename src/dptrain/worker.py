"""The process torchrun starts on every rank: `python -m dptrain.worker RUN_DIR [--resume X] [--trust-checkpoint]`.

The launcher has already resolved and validated the config and written it to RUN_DIR/config.yaml.
Exit codes: 0 done, 143 preempted (SIGTERM; a checkpoint of the last finished step is committed).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from dptrain.checkpoint import EXIT_PREEMPTED
from dptrain.config.load import load_config
from dptrain.trainer import Trainer


def main(argv: list[str] | None = None, *, keep: list | None = None) -> int:
    """Train the run in RUN_DIR on this rank; the exit code. `keep` receives the Trainer so that the
    caller decides when it (and the process groups its model holds) is destroyed."""
    p = argparse.ArgumentParser(prog="python -m dptrain.worker")
    p.add_argument("run_dir")
    p.add_argument("--resume", default="auto")
    p.add_argument("--trust-checkpoint", action="store_true")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    run_dir = Path(args.run_dir)
    cfg = load_config(run_dir / "config.yaml")
    trainer = Trainer(cfg, out_dir=run_dir, resume=args.resume, trust_checkpoint=args.trust_checkpoint)
    if keep is not None:
        keep.append(trainer)
    try:
        summary = trainer.fit()
    except BaseException:
        trainer.ckpt.record_error(traceback.format_exc())  # for the restart report (attempts.jsonl)
        raise
    return EXIT_PREEMPTED if summary.get("preempted") else 0


if __name__ == "__main__":
    _trainer: list = []
    # Under `record`, an uncaught exception also goes to torchrun's error file (TORCHELASTIC_ERROR_FILE),
    # so torchrun's failure report shows this rank's traceback.
    code = record(main)(keep=_trainer) or 0
    # Everything is written and the process group destroyed; skip the interpreter's teardown. Freeing a
    # DDP model there drops the last reference to its gloo process group, whose destructor joins a
    # worker thread that may be waiting for the GIL (seen as a hang of a finished rank under load).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
