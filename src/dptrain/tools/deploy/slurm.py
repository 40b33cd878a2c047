"""An sbatch script for a dptrain config: one `dptrain run` (one torchrun agent) per node.

What the script does, and why:

- `srun --ntasks-per-node=1` starts one `dptrain run` per node; each reads its node rank from
  `SLURM_NODEID` and meets the others at a c10d rendezvous on the first node of the allocation
  (`scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1`), port 29500 + job id mod 1000 unless
  `DPTRAIN_RDZV_PORT` is set.
- `--signal=TERM@S` (no `B:`): S seconds before the time limit Slurm sends SIGTERM to the job
  steps' processes, i.e. to each node's `dptrain run` and its workers, not to the batch shell.
  dptrain's workers agree on it at the next step boundary, checkpoint that step and exit 143
  (Slurm may send it up to a minute earlier than asked).
- Exit 143 from srun: the script runs `scontrol requeue $SLURM_JOB_ID`; `--requeue` allows it (and
  a scheduler preemption with PreemptMode=REQUEUE). The requeued job runs this script again with
  the same `--out`, and `dptrain run` continues from the newest committed checkpoint there
  (checkpoint/rundir.py: a finished run exits 0 untouched). The batch shell ignores a SIGTERM of
  its own (a preemption signals every process of the job) and keeps waiting for srun, so the
  workers' checkpoint is not cut short by the batch step ending; what Slurm grants after that first
  SIGTERM is its KillWait (preemption: GraceTime) before SIGKILL.
- srun is given `--cpus-per-task` itself: since Slurm 22.05 it no longer inherits sbatch's.
- `--open-mode=append`: the log of every attempt stays in one file.
- The run directory must be on a file system every node sees (each rank writes its own
  checkpoint shards; every node resumes from it). The config is written into it by the script.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from dptrain.config import ConfigError
from dptrain.tools.deploy.nodes import NodeLayout, check_at_least, check_layout

CONFIG_NAME = "slurm-config.yaml"
"""The config the script writes into the run directory and hands to every node's `dptrain run`."""
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$")


@dataclass(frozen=True)
class SlurmSpec(NodeLayout):
    """The allocation (the node layout and the rest) and the command; `sbatch` holds extra `#SBATCH`
    options (`--account=x`)."""

    job_name: str
    run_dir: str
    cpus_per_task: int | None = None
    time: str | None = None
    partition: str | None = None
    signal_s: int = 120
    dptrain: str = "dptrain"
    sbatch: list[str] = field(default_factory=list)


def check_spec(spec: SlurmSpec) -> None:
    """The numbers and words of the script, before it is written."""
    check_layout(spec)
    check_at_least(("--signal-seconds", spec.signal_s, 1), ("--cpus-per-task", spec.cpus_per_task, 1))
    if spec.time is not None and not _TIME.match(spec.time):
        raise ConfigError(f"--time={spec.time!r} is not valid; use Slurm's forms: minutes, HH:MM:SS, D-HH:MM:SS")
    if not re.match(r"^[A-Za-z0-9._-]+$", spec.job_name):
        raise ConfigError(f"--job-name={spec.job_name!r} is not valid; use letters, digits, '.', '_' and '-'")
    for opt in spec.sbatch:
        if not opt.startswith("--") or "\n" in opt:
            raise ConfigError(
                f"--sbatch {opt!r} is not valid; give one sbatch long option, e.g. --sbatch=--account=proj"
            )
    if not spec.dptrain.strip() or "'" in spec.dptrain:
        raise ConfigError(
            f"--dptrain={spec.dptrain!r} is not valid; give the command that runs dptrain on the nodes "
            "(no single quotes), e.g. dptrain or 'python -m dptrain'"
        )


def _directives(spec: SlurmSpec) -> list[str]:
    opts = [f"--job-name={spec.job_name}", f"--nodes={spec.nnodes}", "--ntasks-per-node=1"]
    if spec.cpus_per_task:
        opts.append(f"--cpus-per-task={spec.cpus_per_task}")
    if spec.gpus_per_node:
        opts.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.time:
        opts.append(f"--time={spec.time}")
    if spec.partition:
        opts.append(f"--partition={spec.partition}")
    opts += [f"--signal=TERM@{spec.signal_s}", "--requeue", "--open-mode=append", "--output=%x-%j.out", *spec.sbatch]
    return [f"#SBATCH {o}" for o in opts]


_BODY = r"""
set -uo pipefail
RUN_DIR={run_dir}
CONFIG="$RUN_DIR/{config_name}"
mkdir -p "$RUN_DIR"
# the run's config (written whole every attempt: a requeued job reads the same file)
cat > "$CONFIG.tmp" <<'DPTRAIN_CONFIG_EOF'
{config}DPTRAIN_CONFIG_EOF
mv -f "$CONFIG.tmp" "$CONFIG"

HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=${{DPTRAIN_RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}}
echo "dptrain: job $SLURM_JOB_ID (attempt $(( ${{SLURM_RESTART_COUNT:-0}} + 1 ))) on $SLURM_JOB_NODELIST: {nnodes} node(s) x {nproc} worker(s), rendezvous $HEAD_NODE:$RDZV_PORT, run directory $RUN_DIR"

# A preemption signals the batch shell too: keep waiting for srun while the workers checkpoint.
trap 'echo "dptrain: the batch shell got SIGTERM; waiting for the workers to save" >&2' TERM
srun --nodes={nnodes} --ntasks-per-node=1{srun_cpus} --kill-on-bad-exit=1 bash -c \
  'exec {dptrain} run "$0" --out "$1" --nproc-per-node {nproc} launch.nnodes="$SLURM_JOB_NUM_NODES" launch.node_rank="$SLURM_NODEID" launch.rdzv_endpoint="$2" launch.rdzv_id="slurm-$SLURM_JOB_ID"' \
  "$CONFIG" "$RUN_DIR" "$HEAD_NODE:$RDZV_PORT" &
wait $!
rc=$?
while [ $rc -gt 128 ] && kill -0 $! 2>/dev/null; do wait $!; rc=$?; done  # a trapped signal ended `wait` early
if [ $rc -eq 143 ]; then
  echo "dptrain: preempted (exit 143): the last finished step is checkpointed in $RUN_DIR; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID" || echo "dptrain: scontrol requeue failed; resubmit this script to resume" >&2
fi
exit $rc
"""  # noqa: E501 (the sbatch script as written: one shell command a line)


def sbatch_script(spec: SlurmSpec, *, config_yaml: str) -> str:
    """The script's text; `config_yaml` is embedded verbatim (a quoted here-document: no expansion)."""
    if "\nDPTRAIN_CONFIG_EOF" in "\n" + config_yaml:
        raise ConfigError("the config contains the line DPTRAIN_CONFIG_EOF, which ends the script's here-document")
    if not config_yaml.endswith("\n"):
        config_yaml += "\n"
    head = ["#!/bin/bash", "# Written by `dptrain manifest slurm`; submit with: sbatch THIS_FILE", *_directives(spec)]
    body = _BODY.format(
        run_dir=shlex.quote(spec.run_dir),
        config_name=CONFIG_NAME,
        config=config_yaml,
        nnodes=spec.nnodes,
        nproc=spec.nproc_per_node,
        dptrain=spec.dptrain,
        srun_cpus=f" --cpus-per-task={spec.cpus_per_task}" if spec.cpus_per_task else "",
    )
    return "\n".join(head) + "\n" + body
