"""`python -m dptrain` and the `dptrain` console script (`entry`)."""

import os
import sys

INTERRUPTED = "\ndptrain: interrupted (Ctrl-C) before training started: nothing to save\n"


def entry() -> None:
    try:
        # lazy: a Ctrl-C during these imports (about 1 s on a loaded machine) gets one line, not a traceback
        from dptrain.cli.main import main
        from dptrain.launch.interrupts import exit_after_early_ctrl_c
    except KeyboardInterrupt:
        os.write(2, INTERRUPTED.encode())
        os._exit(130)  # not sys.exit: CPython may end an interrupted start with SIGINT (status -2) instead
    code = main()
    exit_after_early_ctrl_c(code)  # keeps `code` where CPython would end an interrupted start with SIGINT
    sys.exit(code)


if __name__ == "__main__":
    entry()
