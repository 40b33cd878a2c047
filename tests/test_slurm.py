"""`dptrain manifest slurm`: the sbatch script run by a real Slurm (Debian's slurm-wlm: slurmctld and
slurmd on this machine, munge for authentication, started by the fixture in a temporary directory
on free ports and stopped after), and a simulated two-node allocation (stub srun/scontrol) for what
one machine cannot show: node ranks and the rendezvous on the first node."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dptrain.config.load import load_config
from dptrain.tools.deploy.slurm import CONFIG_NAME
from support import ROOT
from support import overrides as join
from support.mp import find_free_port
from support.run_helpers import SLOW_TOY as TOY
from support.run_helpers import logged_steps, subprocess_env

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel")


def _slurm_conf(d: Path, host: str) -> str:
    return f"""ClusterName=dptraintest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={find_free_port()}
SlurmdPort={find_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
ReturnToService=2
KillWait=60
UnkillableStepTimeout=180
JobRequeue=1
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _stop(pid_file: Path) -> None:
    """Stop the daemon we started (its pid file), waiting up to 10 s before SIGKILL."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster on this machine; yields the environment its commands need."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing or os.geteuid() != 0:
        pytest.skip(f"a real Slurm needs root and Debian's slurm-wlm + munge (missing: {', '.join(missing) or 'root'})")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    (d / "slurm.conf").write_text(_slurm_conf(d, socket.gethostname()))
    env = {**subprocess_env(), "SLURM_CONF": str(d / "slurm.conf")}
    try:
        subprocess.run(["munged", f"--socket={d}/munge.socket", f"--key-file={key}", f"--pid-file={d}/munged.pid",
                        f"--log-file={d}/munged.log", f"--seed-file={d}/munge.seed", "--force"],
                       check=True, timeout=30, env=env)
        subprocess.run(["slurmctld"], check=True, timeout=30, env=env)
        subprocess.run(["slurmd", "-N", socket.gethostname()], check=True, timeout=30, env=env)
        deadline = time.monotonic() + 60
        while subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env,
                             timeout=30).stdout.strip() != "idle":
            assert time.monotonic() < deadline, "the Slurm node did not become idle in 60 s:\n" + \
                "".join(p.read_text()[-2000:] for p in d.glob("*.log"))
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, timeout=30, capture_output=True)
        for name in ("slurmd", "slurmctld", "munged"):
            _stop(d / f"{name}.pid")


def _job(env: dict[str, str], job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _write_script(tmp: Path, out: Path, *overrides: str, name: str) -> Path:
    script = tmp / f"{name}.sh"
    r = subprocess.run([sys.executable, "-m", "dptrain", "manifest", "slurm", *join(TOY, overrides), "--nnodes", "1",
                        "--nproc-per-node", "2", "--gpus-per-node", "0", "--cpus-per-task", str(os.cpu_count() or 1),
                        "--out", str(out), "--job-name", name, "--dptrain", f"{sys.executable} -m dptrain",
                        "-o", str(script)], capture_output=True, text=True, timeout=120, env=subprocess_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return script


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_slurm_time_limit_signal_checkpoints_requeues_and_resumes_to_the_end(slurm, tmp_path):
    """The generated script on a real Slurm, 1 node x 2 workers. Mid-run the job steps get SIGTERM
    as `--signal=TERM@120` sends it before the time limit (scancel --signal=TERM: the steps, not the
    batch shell); dptrain checkpoints and exits 143, the script requeues the job, the second attempt
    resumes from that checkpoint and trains to max_steps."""
    out = tmp_path / "run"
    script = _write_script(tmp_path, out, "train.max_steps=40", "checkpoint.every_steps=0", name="requeue")
    assert "#SBATCH --signal=TERM@120" in script.read_text() and "#SBATCH --requeue" in script.read_text()
    assert subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, env=slurm,
                          cwd=tmp_path, timeout=30).returncode == 0
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=slurm,
                         cwd=tmp_path, timeout=30, check=True).stdout.strip().split(";")[0]
    log = tmp_path / f"requeue-{job}.out"
    deadline = time.monotonic() + 240
    while max(logged_steps(out), default=0) < 5:
        assert time.monotonic() < deadline and _job(slurm, job).get("JobState") in ("PENDING", "RUNNING"), \
            log.read_text()[-3000:] if log.exists() else _job(slurm, job)
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=TERM", job], env=slurm, timeout=30, check=True)
    deadline = time.monotonic() + 180
    while _job(slurm, job).get("Restarts") != "1" or _job(slurm, job).get("JobState") != "PENDING":
        assert time.monotonic() < deadline, (_job(slurm, job), log.read_text()[-3000:])
        time.sleep(0.5)
    saved = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    # slurmd revokes the first attempt's job credential when that attempt ends, and refuses every credential of the
    # job issued in the same second ("Job credential revoked"): start the second attempt a whole second later
    slurmd_log = Path(slurm["SLURM_CONF"]).parent / "slurmd.log"
    deadline = time.monotonic() + 60
    while f"[{job}.batch] done with job" not in (slurmd_log.read_text() if slurmd_log.exists() else ""):
        assert time.monotonic() < deadline, slurmd_log.read_text()[-2000:] if slurmd_log.exists() else "no slurmd.log"
        time.sleep(0.2)
    time.sleep(1.5)
    # Slurm holds a requeued job for about two minutes (BeginTime); start it now
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm, timeout=30, check=True)
    deadline = time.monotonic() + 300
    while (info := _job(slurm, job)).get("JobState") in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    text = log.read_text()
    logs = Path(slurm["SLURM_CONF"]).parent  # the daemons' logs say why a job failed outside the script
    daemons = "".join((logs / f).read_text()[-2000:] for f in ("slurmctld.log", "slurmd.log") if (logs / f).exists())
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:], daemons)
    assert "Exited with exit code 143" in text and f"requeueing job {job}" in text, text[-3000:]
    assert "(attempt 1)" in text and "(attempt 2)" in text
    resumed = re.search(r"resumed from \S+step_(\d+) at step (\d+)", text)
    assert resumed and int(resumed[2]) == saved > 0, text[-3000:]
    assert logged_steps(out) == list(range(1, 41)), "steps continue after the resume, none lost or repeated"
    assert json.loads((out / "summary.json").read_text())["steps"] == 40
    ran, written = load_config(out / "config.yaml"), load_config(out / CONFIG_NAME)
    assert ran.launch.rdzv_id == f"slurm-{job}"
    assert ran.launch.rdzv_endpoint == f"{socket.gethostname()}:{29500 + int(job) % 1000}"
    assert dataclasses.replace(ran, launch=written.launch) == written, "the run trained the script's config"


# ---------------------------------------------------------------------- a simulated 2-node allocation
STUB_SRUN = r"""#!/bin/bash
# srun of a 2-node allocation: run the task once per node, in parallel, with that node's SLURM_NODEID
while [ "${1#--}" != "$1" ]; do echo "$1" >> "$STUB_LOG.srun"; shift; done
pids=()
for node in 0 1; do SLURM_NODEID=$node "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait $p || rc=$?; done
exit $rc
"""
STUB_SCONTROL = r"""#!/bin/bash
case "$1 $2" in
  "show hostnames") printf 'gpu-a017\ngpu-a018\n' ;;
  "requeue "*) echo "requeue $2" >> "$STUB_LOG.scontrol" ;;
esac
"""
STUB_DPTRAIN = r"""#!/bin/bash
printf '%s\n' "$*" >> "$STUB_LOG.dptrain.$SLURM_NODEID"
sleep "${STUB_SLEEP:-0}"
exit "${STUB_EXIT:-0}"
"""


def _simulate(tmp_path: Path, *, exit_code: int, sleep: float = 0, term_batch_after: float | None = None):
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL), ("fake-dptrain", STUB_DPTRAIN)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dptrain",
            "manifest",
            "slurm",
            *join(TOY, ["train.micro_batch_size=1"]),
            "--nnodes",
            "2",
            "--nproc-per-node",
            "4",
            "--out",
            str(out),
            "--dptrain",
            str(stubs / "fake-dptrain"),
            "-o",
            str(tmp_path / "job.sh"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    log = tmp_path / "stub"
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "STUB_LOG": str(log),
        "STUB_EXIT": str(exit_code),
        "STUB_SLEEP": str(sleep),
        "SLURM_JOB_ID": "4321",
        "SLURM_JOB_NODELIST": "gpu-a[017-018]",
        "SLURM_JOB_NUM_NODES": "2",
    }
    proc = subprocess.Popen(
        ["bash", str(tmp_path / "job.sh")],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if term_batch_after is not None:
        time.sleep(term_batch_after)
        proc.send_signal(signal.SIGTERM)  # a preemption signals the batch shell too
    output = proc.communicate(timeout=60)[0]
    return proc.returncode, output, log, out


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_simulated_two_nodes_one_dptrain_per_node_rendezvous_on_the_first(tmp_path):
    rc, output, log, out = _simulate(tmp_path, exit_code=0)
    assert rc == 0, output
    for node in (0, 1):
        argv = (Path(f"{log}.dptrain.{node}")).read_text().split()
        assert argv[:4] == ["run", str(out / CONFIG_NAME), "--out", str(out)]
        assert f"launch.node_rank={node}" in argv and "launch.nnodes=2" in argv
        assert "launch.rdzv_endpoint=gpu-a017:29821" in argv  # the first node; 29500 + 4321 % 1000
        assert "launch.rdzv_id=slurm-4321" in argv and argv[argv.index("--nproc-per-node") + 1] == "4"
    assert Path(f"{log}.srun").read_text().split() == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    cfg = load_config(out / CONFIG_NAME)
    assert (cfg.launch.nnodes, cfg.launch.nproc_per_node, cfg.log.out_dir) == (2, 4, str(out))
    assert not Path(f"{log}.scontrol").exists(), "a finished job is not requeued"


@pytest.mark.fast
@pytest.mark.timeout(120)
@pytest.mark.parametrize("exit_code, requeued", [(143, True), (1, False), (2, False)])
def test_simulated_exit_143_requeues_other_failures_do_not(tmp_path, exit_code, requeued):
    rc, output, log, _ = _simulate(tmp_path, exit_code=exit_code)
    assert rc == exit_code, output
    assert Path(f"{log}.scontrol").exists() == requeued, output
    if requeued:
        assert Path(f"{log}.scontrol").read_text() == "requeue 4321\n"


@pytest.mark.timeout(120)
def test_simulated_preemption_batch_shell_waits_for_the_workers_to_save(tmp_path):
    """SIGTERM to the batch shell (a preemption signals every process of the job) while the
    workers are still saving: the shell keeps waiting for srun, then requeues."""
    start = time.monotonic()
    rc, output, log, _ = _simulate(tmp_path, exit_code=143, sleep=3, term_batch_after=1.0)
    assert rc == 143 and time.monotonic() - start >= 3, output
    assert "the batch shell got SIGTERM; waiting for the workers to save" in output
    assert Path(f"{log}.scontrol").read_text() == "requeue 4321\n"
