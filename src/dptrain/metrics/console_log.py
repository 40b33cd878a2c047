"""RUN_DIR/console.log: a plain-text copy of everything the run prints to the console.

`dptrain run` tees its launcher's and rank 0's `sys.stdout` and `sys.stderr` into the file (other
ranks print almost nothing; what they do print stays on the console). The copy is made for reading
later: ANSI escape sequences (colours, the progress line's erase-line) are removed, and a line redrawn
in place with a carriage return is written as one line per redraw, so the file holds every progress
line once. The file is appended to, one whole line per write, so the launcher's and rank 0's lines do
not tear each other and a resumed run continues the same file. Only Python-level writes are seen:
output a C++ library writes straight to file descriptor 1 or 2 reaches the console only.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, TextIO

NAME = "console.log"
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


class LineCleaner:
    """Turns terminal output into plain lines: ANSI removed, each '\\r'-redrawn line kept once."""

    def __init__(self) -> None:
        self.partial = ""

    def feed(self, text: str) -> list[str]:
        """The complete lines `text` finishes (without their newline)."""
        out = []
        for piece in re.split(r"(\r\n|\n|\r)", _ANSI.sub("", self.partial + text)):
            if piece in ("\n", "\r\n"):
                out.append(self.partial)
                self.partial = ""
            elif piece == "\r":  # a redraw: the line so far was shown, keep it (an empty one is nothing)
                if self.partial.strip():
                    out.append(self.partial)
                self.partial = ""
            else:
                self.partial = piece
        return out

    def flush(self) -> list[str]:
        rest, self.partial = self.partial, ""
        return [rest] if rest.strip() else []


class Tee:
    """A text stream that writes to `stream` and a cleaned copy to `log` (shared by stdout and stderr)."""

    def __init__(self, stream: TextIO, log: TextIO, lock: threading.Lock) -> None:
        self._stream, self._log, self._lock = stream, log, lock
        self._cleaner = LineCleaner()

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        with self._lock:
            lines = self._cleaner.feed(text)
            if lines and not self._log.closed:
                self._copy("".join(line.rstrip() + "\n" for line in lines))
        return n

    def _copy(self, text: str) -> None:
        """Append to the log; when it cannot be written (a full disk), say so once on the console and stop copying:
        the console itself never fails for the copy."""
        try:
            self._log.write(text)
            self._log.flush()
        except OSError as e:
            with contextlib.suppress(OSError, ValueError):
                self._log.close()  # closed: no further copy is tried (the buffered rest is lost with it)
            self._stream.write(f"dptrain: warning: {self._log.name} could not be written ({e.strerror or e}): the "
                               "console is no longer copied there\n")

    def flush(self) -> None:
        self._stream.flush()

    def finish(self) -> None:
        with self._lock:
            rest = self._cleaner.flush()
            if rest and not self._log.closed:
                self._copy(rest[0].rstrip() + "\n")

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the console's
        return getattr(self._stream, name)


@contextlib.contextmanager
def console_log(run_dir: Path) -> Any:
    """Copy this process's stdout and stderr into RUN_DIR/console.log while the block runs.
    Nested use (the launcher runs a one-rank job in its own process) copies once."""
    if isinstance(sys.stdout, Tee):
        yield
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    log = open(Path(run_dir) / NAME, "a", encoding="utf-8", errors="replace")  # noqa: SIM115 (closed below)
    with contextlib.closing(_QuietClose(log)):
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = Tee(out, log, lock), Tee(err, log, lock)
        try:
            yield
        except Exception:  # Python prints it after the block, to the console only: keep it in the file too
            with lock, contextlib.suppress(OSError, ValueError):
                log.write(_ANSI.sub("", traceback.format_exc()))
            raise
        finally:
            for tee in (sys.stdout, sys.stderr):
                if isinstance(tee, Tee):
                    tee.finish()
            sys.stdout, sys.stderr = out, err


class _QuietClose:
    """Closes the log at the end; data it could not flush (a full disk) is dropped without an error."""

    def __init__(self, log: TextIO) -> None:
        self.log = log

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.log.close()
