"""The `dptrain` command: one module per command group (main.py parses and runs `run`, `launch`,
`config`, `doctor`, `bench`; ckpt.py, plan.py, report.py, manifest.py, top.py, generate.py add theirs).
Only the front end imports these modules; nothing in the core does."""

from dptrain.cli.main import main

__all__ = ["main"]
