"""How many of dptrain's source files one training step touches, with the default config.

    python benchmarks/architecture/step_files.py [--nproc 1] [--list] [key=value ...]

Starts itself under torchrun (default: 1 process; the default config is the built-in LLaMA,
strategy ddp, fp32) and prints what `dptrain.tools.bench.step_files.step_files` finds on rank 0: the
distinct dptrain source files whose Python functions are entered on the main thread during a step
that does not log and during a logging step (`train.log_every_steps`). tests/test_step_files.py
bounds the same count. `--list` prints the files.

Measured here (1 process, CPU): before issue 20's step work (commit a278187) 21 files for a step
that does not log, 28 for a logging step; after it 15 and 24 (16 and 25 by issue 36's time); after
issue 36's second pass 10 and 23 (docs/architecture.md lists them). Python calls in a steady step, 2 ranks,
the default config: 209 in dptrain's files and 2590 in all before issue 36's pass, 177 and 2551 after it; the
hand-written DDP loop of dptrain/tools/bench/raw_ddp.py makes 2495.
"""

from __future__ import annotations

import argparse
import sys


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--list", action="store_true", help="print the files each step touches")
    p.add_argument("overrides", nargs="*", help="config overrides (key=value); none: the default config")
    return p.parse_args(argv)


def worker(a: argparse.Namespace) -> None:
    from dptrain.distributed.env import DistEnv
    from dptrain.tools.bench.step_files import step_files

    found = step_files(list(a.overrides), warmup=a.warmup)
    if DistEnv.from_env().rank == 0:
        print(found.describe(listing=a.list))


def main(argv: list[str]) -> int:
    from dptrain.tools.bench.harness import under_torchrun

    a = _args(argv)
    # the workers need no --nproc (and torchrun would take it for an abbreviation of its own --nproc-per-node)
    passed = [*(["--list"] if a.list else []), f"--warmup={a.warmup}", *a.overrides]
    return under_torchrun(lambda: worker(a), script=__file__, argv=passed, nproc=a.nproc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
