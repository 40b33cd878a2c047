"""What the warm-spare tests (tests/test_warm_spares.py) run through the warm client:
`python -m dptrain.launch.warm_client support.warm_target MODE [ARG]`.

- `report [CODE]`: one JSON line on stdout (argv, cwd, $WARM_TEST, the blocked signals, SIGINT's and SIGHUP's
  handlers), one line on stderr, then exit CODE (0);
- `killself SIGNUM`: end killed by that signal;
- `term PIDFILE`: write this pid, then wait for SIGTERM, print "TERM" and exit 7;
- `sleep PIDFILE`: write this pid, then sleep;
- `follow PIDFILE`: launch/worker.py's `die_with_launcher`, write this pid, then sleep.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def handler_name(sig: int) -> str:
    h = signal.getsignal(sig)
    return {signal.SIG_DFL: "dfl", signal.SIG_IGN: "ign", signal.default_int_handler: "int"}.get(h, repr(h))


def write_pid(path: str) -> None:
    Path(path + ".tmp").write_text(str(os.getpid()))
    os.replace(path + ".tmp", path)


def main(argv: list[str]) -> int:
    mode, arg = argv[0], (argv[1] if len(argv) > 1 else "")
    if mode == "report":
        mask = sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("WARM_TEST"), "mask": mask,
                          "sigint": handler_name(signal.SIGINT), "sighup": handler_name(signal.SIGHUP),
                          "main": __name__}))
        print("to stderr", file=sys.stderr)
        return int(arg or 0)
    if mode == "killself":
        os.kill(os.getpid(), int(arg))
        time.sleep(5)
        return 99
    if mode == "term":
        signal.signal(signal.SIGTERM, lambda *_: (print("TERM", flush=True), os._exit(7)))
    if mode == "follow":
        from dptrain.launch.worker import die_with_launcher

        die_with_launcher()
    write_pid(arg)
    time.sleep(60)
    return 98


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
