"""`dptrain launch SCRIPT`: a user's own training script under torchrun, with dptrain's checks and failure reports."""

from __future__ import annotations

import argparse
from pathlib import Path

from dptrain.config import (
    ConfigError,
    LaunchConfig,
    local_world_size,
)
from dptrain.launch import torchrun as launch
from dptrain.launch.rendezvous_wait import check_rdzv_port


def cmd_launch(args: argparse.Namespace) -> int:
    if not args.argv:
        raise ConfigError("dptrain launch needs a script: dptrain launch [torchrun options] SCRIPT [ARGS]")
    if args.argv[0] in ("-h", "--help"):  # before torch is imported: help stays instant
        print(LAUNCH_HELP)
        return 0
    _check_nproc_option(args.argv)
    _check_script(args.argv)
    opts = launch.torchrun_options(args.argv)
    check_rdzv_port(launch.option_value(opts, "--rdzv-endpoint", "--rdzv_endpoint"))
    argv = launch.user_script_args(args.argv, default_nproc=local_world_size(LaunchConfig()))
    argv = launch.record_failures(argv)  # the script's traceback reaches torchrun's failure report
    return launch.run_torchrun(argv, restarts=_wants_restarts(argv), own_workers=False)


LAUNCH_HELP = """usage: dptrain launch [torchrun options] SCRIPT [ARGS]

Run your own training script under torchrun with dptrain's defaults: --nproc-per-node every local GPU
(2 workers on the CPU) and --standalone when no rendezvous is named. A plain SCRIPT.py runs through
dptrain.launch.record_script, so its traceback reaches torchrun's failure report; the exit status is the
script's own. torchrun's options (before SCRIPT) are torchrun's: see `torchrun --help`."""


def _check_script(argv: list[str]) -> None:
    """The script `dptrain launch` is to run exists (with -m/--module or --no-python it is a module or a
    command, checked by Python or the shell)."""

    at = launch.script_index(argv)
    opts = argv[:at]
    if at == len(argv):
        raise ConfigError("dptrain launch needs a script after torchrun's options: "
                          "dptrain launch [torchrun options] SCRIPT [ARGS]")
    if any(o.split("=")[0] in ("-m", "--module", "--no-python", "--no_python") for o in opts):
        return
    script = Path(argv[at])
    if not script.is_file():
        what = "is a directory" if script.is_dir() else "does not exist"
        raise ConfigError(f"script {argv[at]!r} {what}; dptrain launch [torchrun options] SCRIPT.py [ARGS]")


def _wants_restarts(argv: list[str]) -> bool:
    """Whether torchrun's own --max-restarts (before the script; the script's own is its business) asks
    for restarts, which need the separate-store setting (launch.RESTART_ENV)."""

    value = launch.option_value(launch.torchrun_options(argv), "--max-restarts", "--max_restarts")
    return value is not None and value != "0"


def _check_nproc_option(argv: list[str]) -> None:
    """torchrun's --nproc-per-node must be a positive integer or one of its words (it asserts otherwise).
    Only torchrun's options count: those before the script, told apart by torchrun's own parser."""

    value = launch.option_value(launch.torchrun_options(argv), "--nproc-per-node", "--nproc_per_node")
    if value is not None and value not in ("auto", "cpu", "gpu", "xpu") and not (value.isdigit() and int(value) >= 1):
        raise ConfigError(f"--nproc-per-node={value!r} is not valid; use a positive integer, auto, cpu or gpu")
