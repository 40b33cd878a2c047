"""torch's flight recorder as the ring of each rank's recent collectives, with gloo as with NCCL.

torch (2.13) keeps, per process, a ring of the last N collectives every process group issued
(`TORCH_FR_BUFFER_SIZE`, default 2000; 0: off; read once per process, when the first process group is
made). Each entry says the group, its sequence number in that group, the op, the input shapes and dtypes,
and whether it has finished ("retired": set when the work completes, waited on or not). dptrain's workers
(`dptrain run`, `dptrain launch`, `init_distributed`) get a smaller ring unless the user set a size
(`enable_by_default`): 128 entries are a few steps of DDP buckets, and the dump the desync watchdog
reads (diagnostics/collective_ring.py) then takes about a millisecond. Standard library only: the launcher
imports it. Not recorded under gloo: `monitored_barrier` and send/recv (the desync report names a rank
waiting there by its stack).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
_FR_LEGACY_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"  # torch's older name, read when the new one is unset
DEFAULT_ENTRIES = 128
"""Ring size dptrain sets when the user set none."""
TORCH_DEFAULT_ENTRIES = 2000
"""torch's own default (FlightRecorder.hpp), in effect when nobody set a size."""


def enable_by_default(environ: MutableMapping[str, str] | None = None) -> None:
    """A ring of DEFAULT_ENTRIES unless the user set a size (0 keeps the recorder off). Must run before the
    process's first process group (torch reads the size once)."""
    env = os.environ if environ is None else environ
    if FR_BUFFER_ENV not in env and _FR_LEGACY_ENV not in env:
        env[FR_BUFFER_ENV] = str(DEFAULT_ENTRIES)


def recorder_size() -> int:
    """The ring size this process asked for (0: off)."""
    value = os.environ.get(FR_BUFFER_ENV, os.environ.get(_FR_LEGACY_ENV, str(TORCH_DEFAULT_ENTRIES)))
    return int(value) if value.strip().isdigit() else TORCH_DEFAULT_ENTRIES
