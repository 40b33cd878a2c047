"""`dptrain data prepare SOURCE... --tokenizer T --out DIR` (registered by dptrain/cli/main.py)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from dptrain.config import ConfigError


def add_data_parser(sub: Any) -> None:
    data = sub.add_parser("data", help="prepare your own text for training (tokenise into memory-mapped shards)")
    data_sub = data.add_subparsers(metavar="SUBCOMMAND")
    prep = data_sub.add_parser(
        "prepare",
        help="tokenise text/JSONL/Parquet/Arrow files or a datasets directory into sharded token files + manifest",
        description="Tokenise documents in parallel worker processes into sharded memory-mapped token files with a "
        "manifest (counts, SHA-256 of every shard, the tokenizer's identity). Run it again on the same --out after an "
        "interruption: finished shards are verified by their hashes and kept. Train on the result with "
        "dptrain run data.source=DIR.",
    )
    prep.add_argument("sources", nargs="+", metavar="SOURCE",
                      help="files, directories or globs (.txt/.md, .jsonl, .parquet, .arrow), or a datasets "
                      "save_to_disk directory")
    prep.add_argument("--tokenizer", required=True,
                      help="'bytes' (built-in), a tokenizer.json file, or a local from_pretrained directory")
    prep.add_argument("--out", required=True, help="output directory (resumed if it holds the same prepare)")
    prep.add_argument("--text-key", default="text", help="JSONL field / column holding the text (default: text)")
    prep.add_argument("--split", default="train", help="split of a datasets DatasetDict directory (default: train)")
    prep.add_argument("--workers", type=int, default=None, help="tokenising processes (default: CPU count)")
    prep.add_argument("--shard-docs", type=int, default=20_000, help="documents per shard (default: 20000)")
    prep.add_argument("--eos-token", default=None,
                      help="end-of-document token (default: the tokenizer's eos, else a usual name)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.set_defaults(func=cmd_data_prepare)
    data.set_defaults(func=lambda _args: (data.print_help(), 2)[1])


def progress_columns() -> tuple:
    return (TextColumn("tokenising"), BarColumn(), MofNCompleteColumn(), TextColumn("docs"),
            TextColumn("{task.fields[tokens]:,} tokens"), TimeElapsedColumn(), TimeRemainingColumn())


def cmd_data_prepare(args: argparse.Namespace) -> int:
    # lazy: numpy and torch (dptrain.data): never for `dptrain --help`
    from dptrain.data.prepare import prepare

    bar_columns = progress_columns()
    workers = args.workers if args.workers is not None else (os.cpu_count() or 1)
    if workers < 0:
        raise ConfigError(f"--workers must be >= 0, got {workers}")
    with Progress(*bar_columns, disable=args.no_progress, transient=False) as bar:
        task = bar.add_task("prepare", total=None, tokens=0)

        def progress(done: int, total: int, tokens: int) -> None:
            bar.update(task, completed=done, total=total, tokens=tokens)

        stats = prepare(args.sources, tokenizer=args.tokenizer, out=args.out, workers=workers,
                        text_key=args.text_key, split=args.split, shard_docs=args.shard_docs,
                        eos_token=args.eos_token, progress=progress)
    print(f"prepared {stats.out}: {stats.n_tokens:,} tokens, {stats.n_docs:,} documents in {stats.n_shards} shards "
          f"({stats.done_now} tokenised now, {stats.kept} kept from before); "
          f"{stats.tokens_now:,} tokens in {stats.seconds:.2f} s = {stats.tokens_per_s:,.0f} tokens/s "
          f"with {stats.workers} worker(s)")
    print(f"train on it: dptrain run data.source={stats.out}")
    return 0
