"""`python -m dptrain.launch.record_script SCRIPT [ARGS]`: run a user's script as `python SCRIPT ARGS` would,
under torchelastic's `record`, so that an uncaught exception lands in the error file torchrun
reads (TORCHELASTIC_ERROR_FILE) and torchrun's failure report shows the root-cause rank's
traceback, starting at the script's own frames. `dptrain launch` runs plain `.py` scripts through
it; with `-m`/`--module`, `--no-python` or `--run-path` the user's command runs as given (decorate
your own entry point with `torch.distributed.elastic.multiprocessing.errors.record` for the same
report). The script never outlives its launcher by more than a few seconds, even hung in a collective
(launch/worker.py `exit_when_orphaned`).

The shim also starts the collective desync watchdog (`watch_collectives`) once the script has made its
process group, so that an own loop without `dptrain.monitor` is not silent for the process-group
timeout when its ranks call different collectives: a certain desync (another op, shape or dtype at the
same collective; ranks blocked in collectives the others have not called) ends the job within seconds
with the report on the console (exit 3); a rank merely outside the collective the others wait in gets
a warning naming it and its line, and the job goes on. It steps aside while `dptrain.monitor` runs
its own watchdog, which does the same and more. A rank that fails leaves its last collectives for the
launcher (diagnostics/collective_record.py), so that a collective called with another shape, which gloo
answers by aborting the receiving rank, is named with both sides rather than by the aborted rank.
"""

from __future__ import annotations

import math
import os
import runpy
import sys
import threading
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from dptrain.config import DiagnosticsConfig
from dptrain.diagnostics.collective_record import install_abort_record, record_failure
from dptrain.diagnostics.watchdog import Watchdog, job_store
from dptrain.distributed.exit_marks import clear_exit_mark
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


def watch_collectives(*, poll_s: float = 0.5,
                      desync_after_s: float = DiagnosticsConfig.desync_after_s) -> threading.Thread:
    """A daemon thread that waits for the script's process group, then starts a desync-only watchdog on it."""

    def quiet(error: BaseException) -> None:
        if dist.is_initialized():  # a destroyed group (the script's end) is no news
            print(f"dptrain: the collective desync watchdog stopped ({type(error).__name__}: {error})",
                  file=sys.stderr, flush=True)

    def wait_then_watch() -> None:
        while not dist.is_initialized():
            time.sleep(poll_s)
        if dist.get_world_size() > 1:
            install_abort_record()  # a rank gloo aborts (data of another size arrived) says what it called
            Watchdog(timeout_s=math.inf, store=job_store(), rank=dist.get_rank(), world_size=dist.get_world_size(),
                     run_dir=None, desync_after_s=desync_after_s, yielding=True, on_death=quiet).start()

    thread = threading.Thread(target=wait_then_watch, name="dptrain-desync-start", daemon=True)
    thread.start()
    return thread


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m dptrain.launch.record_script SCRIPT [ARGS]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]  # the script sees exactly what `python SCRIPT ARGS` gives it
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    clear_exit_mark()  # an earlier attempt's mark and collective record, under torchrun's --max-restarts
    exit_when_orphaned()  # the script ends a few seconds after its launcher at most, even hung in a collective

    def run() -> None:
        watch_collectives()
        try:
            runpy.run_path(script, run_name="__main__")
        except BaseException as e:
            if dist.is_initialized() and dist.get_world_size() > 1:
                record_failure(e)  # this rank's unfinished collectives, for the launcher's verdict
            raise

    record(run, error_handler=ScriptErrorHandler(script))()


if __name__ == "__main__":
    main()
