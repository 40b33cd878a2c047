"""`dptrain report RUN_DIR [--out DIR]` (registered by dptrain/cli/main.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dptrain.config import ConfigError
from dptrain.launch.checks import check_dir_writable
from dptrain.tools.report import MissingExtra, build_report


def add_report_parser(sub: Any) -> None:
    rep = sub.add_parser("report", help="write an HTML report of a run (finished or still going) with its figures")
    rep.add_argument("run_dir", metavar="RUN_DIR")
    rep.add_argument("--out", help="folder for index.html and its PNGs (default: RUN_DIR/report)")
    rep.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    run = Path(args.run_dir)
    if not run.is_dir() or not any((run / name).is_file() for name in ("metrics.jsonl", "config.yaml", "console.log")):
        raise ConfigError(
            f"{args.run_dir!r} is not a run directory (no metrics.jsonl, config.yaml or console.log); "
            "pass the --out folder of a dptrain run"
        )
    if args.out is not None:
        check_dir_writable(args.out, what="--out")
    try:
        page = build_report(args.run_dir, out_dir=args.out)
    except FileNotFoundError as e:
        raise ConfigError(
            f"{args.run_dir!r} is not a run directory ({e}); pass the --out folder of a dptrain run"
        ) from None
    except MissingExtra as e:
        print(f"dptrain: error: {e}", file=sys.stderr)
        return 2
    print(f"report: {page} (open it in a browser; the folder can be copied as a whole)")
    return 0
