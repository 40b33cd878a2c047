"""Warm spare workers (launch/warm.py, warm_server.py, warm_client.py): the client stands for the worker torchrun
started (argv, environment, cwd, stdio, signal mask and dispositions, exit status, signals), the forked worker dies
with its client and with its server, and without a server the client runs the worker cold.

The server here preloads only `json` (not torch): the mechanics are the same and each test takes about a second.
A real `dptrain run` through warm spares (a worker SIGKILLed, the same final weights as an undisturbed run) is
tests/test_launch_failures.py's `test_sigkill_of_rank_1_with_restarts_recovers_without_a_traceback`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dptrain.config import ConfigError
from dptrain.config.load import load_config
from dptrain.launch import warm
from dptrain.launch.warm_client import SOCKET_ENV
from dptrain.launch.warm_server import exit_code
from support import subprocess_env

TARGET = "support.warm_target"


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])  # the server and its clients alike
    s = warm.WarmServer.start(preload=("json",))
    assert s is not None
    yield s
    s.stop()
    assert not s.folder.exists()  # the socket's folder is gone


def client(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """`python -u -m dptrain.launch.warm_client support.warm_target ARGS` as torchrun would start it."""
    return subprocess.Popen([sys.executable, "-u", "-m", "dptrain.launch.warm_client", TARGET, *args],
                            env={**os.environ, "WARM_TEST": "from the client", **(env or {})}, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)


def wait_pid(path: Path, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not written"
        time.sleep(0.01)
    return int(path.read_text())


def gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.timeout(30)
def test_the_worker_gets_the_clients_argv_env_cwd_stdio_mask_and_exit_code(server, tmp_path):
    # Started with SIGINT blocked and SIGHUP ignored, as the launcher's agent starts a worker (blocked) or nohup would.
    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    for code in (0, 2):
        p = client("report", str(code), cwd=tmp_path, preexec_fn=setup)
        out, err = p.communicate(timeout=20)
        assert p.returncode == code, err
        cold = subprocess.run([sys.executable, "-u", "-m", TARGET, "report", str(code)], cwd=tmp_path, env={
            **os.environ, "WARM_TEST": "from the client"}, capture_output=True, text=True, preexec_fn=setup)
        report, expected = json.loads(out), json.loads(cold.stdout)
        assert "without it (cold)" not in err and err == cold.stderr == "to stderr\n"
        assert report["argv"][1:] == expected["argv"][1:] == ["report", str(code)]
        assert report == {**expected, "argv": report["argv"]}  # cwd, env, mask [SIGINT], handlers, __main__
        assert report["mask"] == [signal.SIGINT] and report["sighup"] == "ign"
        pid = int(json.loads((server.folder / "ready.json").read_text())["pid"])
        assert pid == server.pid


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGUSR1])
def test_a_worker_killed_by_a_signal_kills_its_client_by_the_same(server, sig):
    p = client("killself", str(int(sig)))
    _, err = p.communicate(timeout=20)
    assert p.returncode == -sig, err


@pytest.mark.timeout(30)
def test_sigterm_to_the_client_reaches_the_worker(server, tmp_path):
    p = client("term", str(tmp_path / "pid"))
    worker = wait_pid(tmp_path / "pid")
    assert worker != p.pid and psutil.Process(worker).ppid() == server.pid
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=20)
    assert (p.returncode, out) == (7, "TERM\n"), err


@pytest.mark.timeout(30)
def test_a_sigkilled_client_takes_its_worker_along(server, tmp_path):
    p = client("sleep", str(tmp_path / "pid"))
    worker = wait_pid(tmp_path / "pid")
    p.kill()
    p.wait(timeout=10)
    assert gone(worker, timeout=1.0)


@pytest.mark.timeout(30)
def test_the_worker_dies_with_the_server_and_the_client_then_ends(server, tmp_path):
    """The forked worker follows its parent, the server (launch/worker.py `die_with_launcher`), which itself follows
    the launcher: the worker gets SIGTERM (here it has no handler: killed by it), and its client ends."""
    p = client("follow", str(tmp_path / "pid"), env={"DPTRAIN_LAUNCHER_PID": str(os.getpid())})
    worker = wait_pid(tmp_path / "pid")
    os.kill(server.pid, signal.SIGKILL)
    assert gone(worker, timeout=5.0)
    _, err = p.communicate(timeout=10)
    assert p.returncode == 1 and "warm server went away" in err


@pytest.mark.timeout(30)
def test_without_a_server_the_client_runs_the_worker_cold(server, tmp_path):
    server.stop()
    os.environ[SOCKET_ENV] = str(server.folder / "sock")  # still pointing at it, as a worker's environment would
    try:
        p = client("report", "2", cwd=tmp_path)
        out, err = p.communicate(timeout=60)
    finally:
        os.environ.pop(SOCKET_ENV)
    assert p.returncode == 2
    assert json.loads(out)["cwd"] == str(tmp_path)
    assert err.count("without it (cold)") == 1 and err.endswith("to stderr\n")


@pytest.mark.timeout(30)
def test_a_client_whose_interpreter_differs_runs_cold(server, tmp_path):
    p = subprocess.Popen([sys.executable, "-u", "-m", "dptrain.launch.warm_client", TARGET, "report"],
                         env={**os.environ, "PYTHONHASHSEED": "7"}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "PYTHONHASHSEED differs" in err and "without it (cold)" in err


@pytest.mark.fast
def test_when_warm_workers_are_on(monkeypatch):
    def on(*items: str) -> bool:
        return warm.warm_workers_on(load_config(None, list(items)).launch)

    monkeypatch.setattr(sys, "platform", "linux")
    assert not on()  # a run that cannot restart: nothing to gain
    assert on("launch.max_restarts=2") and on("launch.nnodes=1:2", "launch.rdzv_endpoint=h:1")
    assert not on("launch.max_restarts=2", "launch.warm_workers=false")
    assert on("launch.warm_workers=true")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not on("launch.max_restarts=2")
    with pytest.raises(ConfigError, match="launch.warm_workers=true needs Linux"):
        on("launch.warm_workers=true")


@pytest.mark.fast
def test_exit_codes_match_cpythons():
    assert [exit_code(c) for c in (None, 0, 3, 256 + 4)] == [0, 0, 3, 4]
    assert exit_code("a message") == 1
