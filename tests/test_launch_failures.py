"""Launcher and worker failures that must end with one line, never a traceback: a rendezvous that
does not complete, a rank SIGKILLed under --max-restarts, Ctrl-C while the launcher starts its
workers, and a NaN loss under diagnostics.nonfinite=error|skip.

Imports no other test module: the toy recipe's overrides are copied here, and
`nan_loss` below is the loss the NaN cases name (`train.loss=test_launch_failures:nan_loss`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from support import ROOT, subprocess_env
from support import overrides as join
from support.mp import find_free_port

TOY = [
    "model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
    "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every_steps=1", "train.eval_every_steps=0",
    "log.progress=false",
]
JOIN_TIMEOUT_S = 3


def nan_loss(model, batch):
    """NaN from the first step on."""
    return model(batch) * float("nan")


def data_swallowing_ctrl_c(**kwargs):
    """The toy data, built after a Ctrl-C that C code swallows: a SIGINT to this process group lands inside a
    C-level `PyRun_SimpleString` (as it can inside `import torch`), which prints the KeyboardInterrupt and
    returns as if nothing happened. Only the launcher's check of the factory does this (not the workers)."""
    import ctypes

    from dptrain.models.toy import build_regression_data

    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        ctypes.pythonapi.PyRun_SimpleString(b"import os, signal, time; os.killpg(0, signal.SIGINT); time.sleep(2)")
    return build_regression_data(**kwargs)


def slow_loss(model, batch):
    """The model's own loss, after a short sleep (steps slow enough to signal a worker mid-run)."""
    time.sleep(0.02)
    return model(batch)


def dptrain_run(out: Path, *overrides: str, nproc: int = 1, timeout: float = 90) -> tuple[int, str, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dptrain", "run", *join(TOY, ["train.max_steps=3", *overrides]),
                        "--nproc-per-node", str(nproc), "--out", str(out)],
                       capture_output=True, text=True, timeout=timeout, env=subprocess_env(), cwd=ROOT)
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


def no_traceback(output: str) -> None:
    assert "Traceback" not in output and "frame #" not in output, output[-3000:]


# ---------------------------------------------------------------------------------------------- rendezvous
def two_nodes(port: int | str, rank: int) -> list[str]:
    endpoint = port if isinstance(port, str) else f"127.0.0.1:{port}"
    return ["launch.nnodes=2", f"launch.node_rank={rank}", f"launch.rdzv_endpoint={endpoint}",
            f"launch.rdzv_conf=join_timeout={JOIN_TIMEOUT_S}"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [1, 0], ids=["nobody-hosts-it", "the-other-node-never-comes"])
def test_rendezvous_that_nobody_completes_ends_with_one_line(tmp_path, rank):
    port = find_free_port()
    code, output, took = dptrain_run(tmp_path / "run", *two_nodes(port, rank))
    assert code == 2, output[-3000:]
    no_traceback(output)
    line = next(ln for ln in output.splitlines() if ln.startswith("dptrain: error:"))
    assert f"127.0.0.1:{port}" in line and f"join_timeout={JOIN_TIMEOUT_S}s" in line
    assert f"node_rank {1 - rank}" in line
    assert took < JOIN_TIMEOUT_S + 30  # start-up (imports, factories) + join_timeout + a few seconds


@pytest.mark.timeout(60)
def test_unresolvable_rendezvous_host_is_refused_before_launch(tmp_path):
    code, output, took = dptrain_run(tmp_path / "run", *two_nodes("no-such-host.invalid:29500", 1))
    assert code == 2, output[-3000:]
    no_traceback(output)
    assert "'no-such-host.invalid' does not resolve" in output and "launch.rdzv_endpoint" in output
    assert took < 20


@pytest.mark.timeout(120)
@pytest.mark.parametrize("listen", [True, False], ids=["listening", "bound-only"])
def test_rendezvous_port_taken_by_another_program_is_named(tmp_path, listen):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        port = squatter.getsockname()[1]
        if listen:
            squatter.listen()  # accepts connections and never answers: torchrun's store client waits forever
        code, output, took = dptrain_run(tmp_path / "run", *two_nodes(port, 0))
    assert code == 2, output[-3000:]
    no_traceback(output)
    line = next(ln for ln in output.splitlines() if ln.startswith("dptrain: error:"))
    assert f"127.0.0.1:{port}" in line, line
    # The holder is named when the system lists the socket's owner; otherwise the line says no store answered.
    assert "held by another program" in line or "no rendezvous store answered there" in line, line
    if listen and "held by another program" in line:
        assert f"pid {os.getpid()}" in line
    assert took < 20, took  # refused before launch, not after the join timeout
    assert not (tmp_path / "run" / "config.pending.yaml").exists()


SILENT_SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
held = []
while True:
    held.append(s.accept()[0])  # accepts every connection and never answers
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["run", "launch"])
def test_a_rendezvous_peer_that_accepts_and_never_answers_is_named_within_the_configured_timeout(tmp_path, command):
    """The endpoint is on another host (a network namespace), so no check before the launch can see its program:
    torchrun's store client would wait for its answer forever (past join_timeout and read_timeout)."""
    from dptrain.tools.netns import RDZV_PORT, Cluster, unavailable_reason

    if (reason := unavailable_reason()) is not None:
        pytest.skip(reason)
    conf = "join_timeout=15,read_timeout=15" if command == "run" else "join_timeout=15,read_timeout=4"
    with Cluster() as c:
        squatter = c.popen(0, [sys.executable, "-c", SILENT_SERVER, str(RDZV_PORT)], stdout=subprocess.PIPE, text=True)
        assert squatter.stdout.readline().strip() == "listening"
        if command == "run":
            argv = [sys.executable, "-m", "dptrain", "run", *TOY, "train.max_steps=3", *c.launch_overrides(1),
                    f"launch.rdzv_conf={conf}", "--out", str(tmp_path / "run")]
        else:
            script = tmp_path / "hello.py"
            script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n")
            argv = [sys.executable, "-m", "dptrain", "launch", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", c.rdzv_endpoint(), "--rdzv-conf", conf, str(script)]
        t0 = time.monotonic()
        node = c.popen(1, argv, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
        try:
            output, started, named = "", None, None
            for line in node.stdout:  # each line timed as it comes
                output += line
                if started is None and ("c10d rendezvous at" in line or "node_rank is only used" in line):
                    started = time.monotonic()  # the launcher hands over to torchrun
                if line.startswith("dptrain: error:"):
                    named = time.monotonic()
            node.wait(timeout=30)
        finally:
            for i in (0, 1):
                c.kill_node(i)
    assert node.returncode == 2, output[-3000:]
    no_traceback(output)
    line = next(ln for ln in output.splitlines() if ln.startswith("dptrain: error:"))
    assert f"the rendezvous endpoint {c.rdzv_endpoint()} accepts connections but never answers" in line, line
    assert "is not a torch.distributed store" in line and conf.replace(",", "s, ") + "s" in line, line
    assert ("launch.rdzv_endpoint" if command == "run" else "--rdzv-endpoint") in line, line
    assert named is not None, output[-3000:]
    read_timeout = int(conf.rsplit("=", 1)[1])
    print(f"{command}: named {named - t0:.1f}s after the command started"
          f"{f' ({named - started:.1f}s after torchrun did)' if started else ''}")
    if started is not None:  # `dptrain run` says when it hands over to torchrun: from there, the configured timeout
        assert named - started < min(read_timeout, 10) + 3, (named - started, line)
    assert named - t0 < min(read_timeout, 10) + 20, (named - t0, line)  # start-up (imports) + the timeout


# -------------------------------------------------------------------------------- SIGKILL under restarts
@pytest.mark.timeout(30)
def test_a_lost_peer_is_told_from_the_gloo_error():
    from dptrain.launch.worker import first_line, peer_lost

    gloo = RuntimeError(
        "Got the following error when running the callback: RuntimeError: Got the following error when running "
        "the callback: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:57514. This is typically caused by a remote worker crashing.\n\nAt:\n  x.py(31): f\n"
    )
    assert peer_lost(gloo) and not peer_lost(RuntimeError("shape mismatch")) and not peer_lost(ValueError("x"))
    assert first_line(gloo).startswith("[/pytorch") and "Connection closed by peer" in first_line(gloo)


def logged_steps(out: Path) -> list[int]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(ln)["step"] for ln in lines if '"loss"' in ln and ln.endswith("}")]


def losses(out: Path) -> list[tuple[int, str]]:
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], float.hex(r["loss"])) for r in recs if "loss" in r]


def start(out: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dptrain", "run", *TOY, "train.loss=test_launch_failures:slow_loss",
         "train.max_steps=20", "checkpoint.every_steps=5", "--nproc-per-node", "2", "--out", str(out), *flags],
        env=subprocess_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


@pytest.mark.timeout(300)
def test_sigkill_of_rank_1_with_restarts_recovers_without_a_traceback(tmp_path):
    ref = start(tmp_path / "ref")
    assert ref.wait(timeout=120) == 0, ref.communicate()[0][-3000:]
    out = tmp_path / "run"
    proc = start(out, "--max-restarts", "2")
    deadline = time.monotonic() + 90
    while max(logged_steps(out), default=0) < 8:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.005)
    # max_restarts > 0: warm spares (launch.warm_workers auto): the process that trains rank 1 was forked by this
    # node's warm server; its client (torchrun's worker) reports its SIGKILL to torchrun
    victim = psutil.Process(json.loads((out / "attempts" / "rank1.json").read_text())["pid"])
    assert "dptrain.launch.warm_server" in victim.parent().cmdline()
    victim.send_signal(signal.SIGKILL)
    output = proc.communicate(timeout=150)[0]
    assert proc.returncode == 0, output[-3000:]
    no_traceback(output)
    assert "(cold)" not in output and "exitcode: -9" in output, output[-3000:]
    assert "restart 1: attempt 0 failed" in output and "resumed from" in output
    assert losses(out) == losses(tmp_path / "ref")
    assert (out / "final" / "model.safetensors").read_bytes() == (tmp_path / "ref" / "final" /
                                                                   "model.safetensors").read_bytes()


# -------------------------------------------------------------------------------------------- NaN loss
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("policy", "restarts"), [("error", "2"), ("skip", "0")])
def test_nan_loss_ends_with_the_policy_report(tmp_path, policy, restarts):
    """Exit 4 with one report; under launch.max_restarts the stop is final: torchrun restarts nothing."""
    out = tmp_path / "run"
    code, output, _ = dptrain_run(out, "train.loss=test_launch_failures:nan_loss", f"diagnostics.nonfinite={policy}",
                                  "diagnostics.max_consecutive_skips=2", "train.max_steps=6",
                                  f"launch.max_restarts={restarts}", nproc=2)
    assert code == 4, output[-3000:]
    no_traceback(output)
    assert "restart" not in output.lower(), output[-3000:]
    assert "FAILED" not in output  # no torchrun failure report either
    stop = [ln for ln in output.splitlines() if ln.startswith("dptrain: stopped: ")]
    assert len(stop) == 1 and f"step {1 if policy == 'error' else 2}:" in stop[0], output[-3000:]
    assert "diagnostics.jsonl" in stop[0]
    records = [json.loads(ln) for ln in (out / "diagnostics.jsonl").read_text().splitlines()]
    stopped = [r for r in records if r["kind"] == "nonfinite" and r["action"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["policy"] == policy and stopped[0]["ranks"] == [0, 1]


# ------------------------------------------------------------------------------ Ctrl-C at the first spawn
@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05])
def test_ctrl_c_in_the_instant_the_first_worker_starts_leaves_no_traceback(tmp_path, delay):
    """A terminal's Ctrl-C (SIGINT to the whole foreground process group) while a worker's interpreter is still
    starting: the launcher spawns its workers with SIGINT blocked, so none dies in its imports with a traceback."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "dptrain", "run", *join(TOY, ["train.max_steps=3"]),
                             "--nproc-per-node", "2", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=subprocess_env(), cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not [c for c in psutil.Process(proc.pid).children(recursive=True)
               if "dptrain.launch.worker" in " ".join(c.cmdline())]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.001)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=90)[0]
    assert proc.returncode == 130, output[-3000:]
    no_traceback(output)
    assert "KeyboardInterrupt" not in output, output[-3000:]
    assert "dptrain: interrupted (Ctrl-C)" in output


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_ctrl_c_swallowed_during_the_launchers_checks_still_stops_before_training(tmp_path, nproc):
    """A Ctrl-C while the launcher checks the run, swallowed on its way up by C code (torch's import did so in 13 of
    30 tries): no worker starts, nothing trains, exit 130 (not 0, and not CPython's own SIGINT death, -2)."""
    out = tmp_path / "run"
    swallowing = "data.factory=test_launch_failures:data_swallowing_ctrl_c"
    proc = subprocess.run([sys.executable, "-m", "dptrain", "run", *join(TOY, ["train.max_steps=3", swallowing]),
                           "--nproc-per-node", nproc, "--out", str(out)], capture_output=True, text=True,
                          env=subprocess_env(), cwd=ROOT, start_new_session=True, timeout=100)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 130, output[-3000:]
    assert "dptrain: interrupted (Ctrl-C) before training started: nothing to save" in output, output[-3000:]
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()
    assert not (out / "checkpoints").exists()


# ------------------------------------------------------------------------ a checkpoint of another model
@pytest.mark.timeout(120)
def test_resuming_a_checkpoint_of_another_model_config_is_one_line(tmp_path):
    """The checkpoint's model section differs from this run's (another width, or an edited config.yaml): exit 2
    with the reason on one line, and no restart would change it."""
    a = tmp_path / "a"
    code, output, _ = dptrain_run(a, "train.max_steps=2", "checkpoint.every_steps=1")
    assert code == 0, output[-3000:]
    code, output, _ = dptrain_run(tmp_path / "b", "model.kwargs.hidden=8", "train.max_steps=4", "--resume", str(a))
    assert code == 2, output[-3000:]
    no_traceback(output)
    line = next(ln for ln in output.splitlines() if ln.startswith("dptrain: error:"))
    assert "written for another model config" in line and "resume with the run's own model settings" in line, line
