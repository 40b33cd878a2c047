"""Running a port or its original (examples/ports/) as a subprocess and reading the losses it wrote."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

from support import subprocess_env

# What an original (plain torch.distributed on gloo) prints when one of its ranks dies in the interpreter's
# teardown after its last line ran: a gloo worker thread still freeing the last collective's tensors needs
# the GIL while Python finalizes (pytorch/pytorch#179291 describes it). It comes from torch, not from the
# script or from dptrain (whose own teardown settles first: dptrain.distributed.process_group), and only
# on a loaded machine.
_TORCH_TEARDOWN_ABORT = "terminate called without an active exception"


def _died_in_torchs_teardown(r: subprocess.CompletedProcess[str]) -> bool:
    aborted = r.returncode in (1, -signal.SIGABRT, 128 + signal.SIGABRT)  # mp.spawn / torchrun report 1
    return aborted and _TORCH_TEARDOWN_ABORT in r.stderr and "SIGABRT" in r.stderr


def run_script(
    cmd: list[str], losses: Path, cwd: Path, *, original: bool = False, timeout: float = 90
) -> tuple[dict[str, Any], str]:
    """Run `cmd` (OMP_NUM_THREADS=1) and return the losses file it wrote, with its stderr. An original that
    died in torch's own teardown abort (above) runs again, up to 3 times in all (CI once saw two aborts in a row
    under load): its numbers are deterministic, so another run gives the same ones; any other failure, or a
    port's, fails the test."""
    env = subprocess_env(tests=False, OMP_NUM_THREADS="1")
    attempts = 3
    for attempt in range(1, attempts + 1):
        losses.unlink(missing_ok=True)
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)
        if not (original and attempt < attempts and _died_in_torchs_teardown(r)):
            break
    assert r.returncode == 0, f"{cmd[-1]} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(losses.read_text()), r.stderr
