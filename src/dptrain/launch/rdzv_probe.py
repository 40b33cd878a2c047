"""Is the rendezvous endpoint a torch.distributed store? A program that accepts connections there and never answers
(not a store: a stray server, a port forward to nowhere) leaves torchrun's store client waiting for a reply that never
comes, past join_timeout and read_timeout alike. `SilentStoreWatch` asks the endpoint what torch's own store client
asks first (validate, then ping: the TCPStore wire protocol) while torchrun connects; a store answers the ping at
once. Silence for `silent_after_s` (`SILENT_AFTER_S`, or the configured read_timeout / join_timeout when shorter),
with no worker started, ends the launcher with one line naming the endpoint and, on this machine, the program that
holds the port (exit 2). A refused connection says nothing (node_rank 0 may start later: join_timeout covers it),
nor does an answer, or a connection the other side closes.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable

from dptrain.config.resolve import parse_endpoint

SILENT_AFTER_S = 10.0
"""How long an accepted connection may stay without an answer to a ping before the endpoint is called silent (a store
answers in milliseconds); shorter when the rendezvous's read_timeout or join_timeout is."""
VALIDATE, PING = 0, 13
"""torch's TCPStore query types (c10d/TCPStoreBackend.hpp `QueryType`) its client sends first."""
VALIDATION_MAGIC = 0x3C85F7CE
"""The number a TCPStore client validates itself with (c10d `validationMagicNumber`)."""


def store_answers(host: str, port: int, *, wait_s: float, connect_s: float = 2.0) -> bool | None:
    """True when the endpoint answers a store ping (or closes the connection: something that speaks and refuses),
    False when it accepts the connection and stays silent for `wait_s`, None when nothing accepts it."""
    try:
        conn = socket.create_connection((host, port), timeout=connect_s)
    except OSError:
        return None
    with conn:
        nonce = os.getpid() & 0xFFFFFFFF
        try:  # native byte order, as the client writes its values
            conn.sendall(struct.pack("=BI", VALIDATE, VALIDATION_MAGIC) + struct.pack("=BI", PING, nonce))
            conn.settimeout(wait_s)
            conn.recv(4)  # the nonce back from a store; b"" when the other side closed
        except TimeoutError:
            return False
        except OSError:
            return True  # reset: it spoke (refused us), which is not the silence this watch is for
        return True


def rdzv_timeouts(conf: str | None) -> dict[str, int]:
    """join_timeout and read_timeout from a torchrun --rdzv-conf string ('key=value,...'; other keys ignored)."""
    out: dict[str, int] = {}
    for item in (conf or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() in ("join_timeout", "read_timeout") and value.strip().isdigit():
            out[key.strip()] = int(value)
    return out


class SilentStoreWatch:
    """While no worker has started, probe `endpoint` (every second until something accepts the connection); when it
    accepts and stays silent, print one line and end the launcher (exit 2). `setting` names the endpoint as the user
    set it (`launch.rdzv_endpoint`, `--rdzv-endpoint`); `holder` says who holds the port on this machine;
    `abandon` runs before the exit."""

    def __init__(self, endpoint: str, *, conf: str | None, setting: str, holder: Callable[[str], str | None],
                 abandon: Callable[[], None] | None = None, ignore: set[int] | None = None) -> None:
        self.endpoint, self.setting, self.holder, self.abandon = endpoint, setting, holder, abandon
        self.ignore = ignore or set()
        self.timeouts = rdzv_timeouts(conf)
        self.silent_after_s = min([SILENT_AFTER_S, *self.timeouts.values()])
        self._stop = threading.Event()
        threading.Thread(target=self._loop, name="dptrain-store-probe", daemon=True).start()

    def _workers_started(self) -> bool:
        import psutil

        return bool({c.pid for c in psutil.Process().children()} - self.ignore)

    def _loop(self) -> None:
        host, port = parse_endpoint(self.endpoint)
        while not self._stop.is_set() and not self._workers_started():
            answered = store_answers(host, port, wait_s=self.silent_after_s)
            if answered:
                return
            if answered is False and not self._stop.is_set() and not self._workers_started():
                self._give_up()
            self._stop.wait(1.0)

    def _give_up(self) -> None:
        holder = self.holder(self.endpoint)
        by = f", {holder}," if holder else ""
        settings = "".join(f", {k}={v}s" for k, v in sorted(self.timeouts.items()))
        print(f"dptrain: error: the rendezvous endpoint {self.endpoint} accepts connections but never answers: "
              f"the program there{by} is not a torch.distributed store (no reply to a store ping in "
              f"{self.silent_after_s:.0f}s{settings}). Point {self.setting} at node_rank 0's store (the same on "
              "every node), or stop that program", file=sys.stderr, flush=True)
        if self.abandon is not None:
            with contextlib.suppress(Exception):
                self.abandon()
        sys.stdout.flush()
        os._exit(2)  # the main thread is inside torchrun's store client (C++): nothing else ends it

    def stop(self) -> None:
        self._stop.set()
