"""`python -m dptrain.launch.record_script SCRIPT [ARGS]`: run a user's script as `python SCRIPT ARGS` would,
under torchelastic's `record`, so that an uncaught exception lands in the error file torchrun
reads (TORCHELASTIC_ERROR_FILE) and torchrun's failure report shows the root-cause rank's
traceback, starting at the script's own frames. `dptrain launch` runs plain `.py` scripts through
it; with `-m`/`--module`, `--no-python` or `--run-path` the user's command runs as given (decorate
your own entry point with `torch.distributed.elastic.multiprocessing.errors.record` for the same
report). The script never outlives its launcher by more than a few seconds, even hung in a collective
(launch/worker.py `exit_when_orphaned`).
"""

from __future__ import annotations

import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from dptrain.launch.worker import exit_when_orphaned


class ScriptErrorHandler(ErrorHandler):
    """torchelastic's error handler, with the traceback cut to start at the script's first frame
    (the frames of `runpy` and of this module are noise in the report)."""

    def __init__(self, script: str) -> None:
        super().__init__()
        self.script = os.path.abspath(script)

    def record_exception(self, e: BaseException) -> None:
        tb = e.__traceback__
        while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != self.script:
            tb = tb.tb_next
        if tb is not None:  # none of the script's frames (a SyntaxError): keep the whole traceback
            e.__traceback__ = tb  # Python >= 3.11 formats the handled exception from it
        super().record_exception(e)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m dptrain.launch.record_script SCRIPT [ARGS]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]  # the script sees exactly what `python SCRIPT ARGS` gives it
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    exit_when_orphaned()  # the script ends a few seconds after its launcher at most, even hung in a collective

    def run() -> None:
        runpy.run_path(script, run_name="__main__")

    record(run, error_handler=ScriptErrorHandler(script))()


if __name__ == "__main__":
    main()
