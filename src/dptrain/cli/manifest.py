"""`dptrain manifest kubeflow|slurm`: a config (+ overrides) -> a PyTorchJob or an sbatch script.

The config is validated for the whole world (nnodes x nproc-per-node) before anything is written,
so a job that cannot start is refused here (exit 2), not on the cluster. The factories are not
imported (the cluster's image or environment may differ from this machine's)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

from dptrain.cli.arg_types import nonnegative_int, positive_int
from dptrain.config import Config, ConfigError, default_out_dir, resolve, validate
from dptrain.config.load import dump_yaml, load_command_line
from dptrain.tools.deploy import kubeflow, slurm


def add_manifest_parser(sub: Any) -> None:
    """Register `dptrain manifest` on the main parser's subcommands."""
    man = sub.add_parser("manifest", help="write a Kubeflow PyTorchJob or a Slurm sbatch script for a config")
    kinds = man.add_subparsers(metavar="KIND")

    kf = kinds.add_parser("kubeflow", help="a Kubeflow Training Operator PyTorchJob (with its ConfigMap), YAML")
    _common(kf)
    kf.add_argument("--image", required=True, help="container image with dptrain installed (see the Dockerfile)")
    kf.add_argument("--name", help="job name (default: log.name; lowercase, digits, '-')")
    kf.add_argument("--namespace")
    kf.add_argument("--pvc", help="PersistentVolumeClaim for the run directories, mounted on every pod at /runs "
                                  "(default: <name>-runs)")
    kf.add_argument("--pvc-size", help="also create that claim (ReadWriteMany) with this size, e.g. 100Gi")
    kf.add_argument("--storage-class", help="storage class of the created claim")
    kf.add_argument("--shm-size", help="size limit of the memory-backed /dev/shm (e.g. 16Gi; default: none)")
    kf.add_argument("--no-validate", action="store_true", help="skip the check against the PyTorchJob schema")
    kf.set_defaults(func=cmd_kubeflow)

    sl = kinds.add_parser("slurm", help="an sbatch script: srun, one torchrun per node, requeue on preemption")
    _common(sl)
    sl.add_argument("--out", help="run directory, on a file system every node sees (default: log.out_dir, else "
                                  "runs/<recipe>-<timestamp> fixed now, so a requeued job resumes it)")
    sl.add_argument("--job-name", help="default: log.name")
    sl.add_argument("--time", help="time limit (Slurm's forms: minutes, HH:MM:SS, D-HH:MM:SS)")
    sl.add_argument("--partition")
    sl.add_argument("--cpus-per-task", type=int, help="CPUs for each node's task (all of that node's workers)")
    sl.add_argument(
        "--signal-seconds",
        type=int,
        default=120,
        help="send SIGTERM this many seconds before the time limit (dptrain checkpoints, exits 143, requeues)",
    )
    sl.add_argument("--dptrain", default="dptrain", help="the command that runs dptrain on the nodes")
    sl.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="an extra #SBATCH long option, e.g. --sbatch=--account=proj (repeatable)",
    )
    sl.set_defaults(func=cmd_slurm)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("items", nargs="*", metavar="[CONFIG] [section.field=value ...]")
    p.add_argument("--nnodes", type=positive_int, required=True, help="nodes (pods) in the job")
    p.add_argument(
        "--nproc-per-node", type=positive_int, required=True, help="workers per node (usually its GPU count)"
    )
    p.add_argument(
        "--gpus-per-node", type=nonnegative_int, help="GPUs to request per node (default: --nproc-per-node; 0: none)"
    )
    p.add_argument(
        "--max-restarts",
        type=nonnegative_int,
        help="torchrun restarts of the worker group (Kubeflow: an elasticPolicy)",
    )
    p.add_argument("-o", "--output", help="write to this file instead of stdout")


def _job_config(args: argparse.Namespace, *, out_dir: str | None) -> Config:
    """The config every node runs: file + overrides + the job's layout, validated for its world size."""

    extra = [f"launch.nnodes={args.nnodes}", f"launch.nproc_per_node={args.nproc_per_node}"]
    if args.max_restarts is not None:
        extra.append(f"launch.max_restarts={args.max_restarts}")
    cfg = load_command_line(args.items, extra=extra)
    if out_dir is not None:
        cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, out_dir=out_dir))
    # the rendezvous endpoint is the cluster's (the first node); a stand-in lets the rest be checked now
    probe = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, rdzv_endpoint="first-node:29500"))
    validate(probe)
    resolve(probe, world_size=args.nnodes * args.nproc_per_node)
    return cfg


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the embedded config) as literal blocks: the ConfigMap stays readable."""


_BlockDumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def _write(text: str, output: str | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot write -o {output}: {e}") from None
    print(f"dptrain: wrote {output}", file=sys.stderr)


def _gpus(args: argparse.Namespace) -> int:
    return args.nproc_per_node if args.gpus_per_node is None else args.gpus_per_node


def cmd_kubeflow(args: argparse.Namespace) -> int:
    base = _job_config(args, out_dir=None)
    name = args.name or base.log.name.lower().replace("_", "-")
    spec = kubeflow.JobSpec(
        name=name,
        image=args.image,
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        gpus_per_node=_gpus(args),
        pvc=args.pvc or f"{name}-runs",
        pvc_size=args.pvc_size,
        storage_class=args.storage_class,
        max_restarts=args.max_restarts,
        shm_size=args.shm_size,
        namespace=args.namespace,
    )
    kubeflow.check_spec(spec)
    cfg = dataclasses.replace(base, log=dataclasses.replace(base.log, out_dir=spec.run_dir))
    docs = kubeflow.manifests(spec, config_yaml=dump_yaml(cfg))
    if not args.no_validate:
        problems = kubeflow.schema_problems(docs[-1])
        if problems:
            raise ConfigError("the PyTorchJob does not match the schema:\n  " + "\n  ".join(problems))
    _write(yaml.dump_all(docs, Dumper=_BlockDumper, sort_keys=False), args.output)
    return 0


def cmd_slurm(args: argparse.Namespace) -> int:
    base = _job_config(args, out_dir=args.out)
    run_dir = default_out_dir(base)  # fixed now: every attempt of the job uses the same directory
    cfg = dataclasses.replace(base, log=dataclasses.replace(base.log, out_dir=run_dir))
    spec = slurm.SlurmSpec(
        job_name=args.job_name or cfg.log.name,
        run_dir=run_dir,
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        gpus_per_node=_gpus(args),
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        partition=args.partition,
        signal_s=args.signal_seconds,
        dptrain=args.dptrain,
        sbatch=args.sbatch,
    )
    slurm.check_spec(spec)
    _write(slurm.sbatch_script(spec, config_yaml=dump_yaml(cfg)), args.output)
    return 0
