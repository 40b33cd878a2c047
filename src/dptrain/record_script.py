"""`python -m dptrain.record_script SCRIPT [ARGS]`: run a user's script as `python SCRIPT ARGS` would,
under torchelastic's `record`, so that an uncaught exception lands in the error file torchrun
reads (TORCHELASTIC_ERROR_FILE) and torchrun's failure report shows the root-cause rank's
traceback. `dptrain launch` runs plain `.py` scripts through it; with `-m`/`--module` or
`--no-python` the user's command runs as given (decorate your own entry point with
`torch.distributed.elastic.multiprocessing.errors.record` for the same report).
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m dptrain.record_script SCRIPT [ARGS]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]  # the script sees exactly what `python SCRIPT ARGS` gives it
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    record(lambda: runpy.run_path(script, run_name="__main__"))()


if __name__ == "__main__":
    main()
