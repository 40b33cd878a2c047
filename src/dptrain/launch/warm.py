"""Warm spare workers (launch.warm_workers): when torchrun restarts a worker group, the new workers skip the
Python, torch and dptrain imports (seconds each, more under load).

torchrun's elastic agent stays the only launcher and the only owner of membership, restarts and failure reports:
it still starts one process per worker, but that process is a small client (launch/warm_client.py, standard library
only) which has this node's warm server (launch/warm_server.py, started here as a child of the launcher, with the
environment the workers inherit) fork the worker out of an interpreter that already imported everything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from dptrain.config import ConfigError, LaunchConfig
from dptrain.config.nodes import is_elastic
from dptrain.launch.warm_client import SOCKET_ENV

CLIENT_MODULE = "dptrain.launch.warm_client"
SERVER_MODULE = "dptrain.launch.warm_server"
STOP_GRACE_S = 5.0


def warm_workers_on(cfg: LaunchConfig) -> bool:
    """Whether a `dptrain run` launch uses warm spares: launch.warm_workers, or when null (auto) on Linux for a run
    that can restart its workers (launch.max_restarts > 0 or an elastic node range)."""
    linux = sys.platform.startswith("linux")
    if cfg.warm_workers is None:
        return linux and (cfg.max_restarts > 0 or is_elastic(cfg))
    if cfg.warm_workers and not linux:
        raise ConfigError(
            f"launch.warm_workers=true needs Linux (this is {sys.platform}); set it to null (auto) or false"
        )
    return bool(cfg.warm_workers)


class WarmServer:
    """This node's warm server process: started by `start` (None if it cannot be), ended by `stop`."""

    def __init__(self, proc: subprocess.Popen, folder: Path) -> None:
        self.proc, self.folder = proc, folder

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, preload: tuple[str, ...] = ()) -> WarmServer | None:
        """Start the server with this process's environment (what torchrun's workers inherit) and point the workers
        at it (`SOCKET_ENV`). The listening socket is bound here and handed over, so workers that start while the
        server is still importing wait in its backlog; once the server is gone, connecting fails at once and the
        workers start cold. `preload`: the modules the server imports (default: a dptrain worker's)."""
        folder = Path(tempfile.mkdtemp(prefix="dptrain-warm-"))  # mode 0700: only this user reaches the socket
        path = folder / "sock"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
                listener.bind(str(path))
                listener.listen(128)
                fd = listener.fileno()
                proc = subprocess.Popen(
                    [sys.executable, "-m", SERVER_MODULE, str(folder), str(fd), str(os.getpid()), *preload],
                    pass_fds=[fd], stdin=subprocess.DEVNULL, start_new_session=True,
                )
        except OSError as e:
            shutil.rmtree(folder, ignore_errors=True)
            print(f"dptrain: warm spares are off for this launch: cannot start the warm server ({e})",
                  file=sys.stderr, flush=True)
            return None
        os.environ[SOCKET_ENV] = str(path)
        return cls(proc, folder)

    def stop(self) -> None:
        os.environ.pop(SOCKET_ENV, None)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def client_command(module: str, module_args: list[str]) -> tuple[str, list[str]]:
    """The module and arguments torchrun starts instead of `python -m module module_args...`."""
    return CLIENT_MODULE, [module, *module_args]
