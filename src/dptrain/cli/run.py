"""`dptrain run`: check everything before any process starts, then launch the workers (or train in this process)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from dptrain.checkpoint.manifest import checkpoint_root
from dptrain.checkpoint.rundir import PENDING_CONFIG, RunDirLock, check_run_dir, write_atomically
from dptrain.cli.ckpt import prepare_resume
from dptrain.config import (
    Config,
    ConfigError,
    default_out_dir,
    local_world_size,
    resolve,
    validate,
)
from dptrain.config.hosting import preset_overrides
from dptrain.config.imports import import_object
from dptrain.config.load import dump_yaml, load_command_line
from dptrain.config.nodes import is_elastic, max_nodes
from dptrain.config.nvme import check_nvme_dir
from dptrain.launch import torchrun as launch
from dptrain.launch.checks import (
    call_factory,
    check_dir_writable,
    check_model,
    check_rdzv_endpoint,
    check_signature,
    check_tensor_parallel,
    check_vocabulary,
    check_workers_fit,
)
from dptrain.launch.cluster_env import cluster_launch
from dptrain.launch.elastic import pin_global_batch
from dptrain.launch.hosted_checks import check_hosted, check_unnamed_recipe
from dptrain.launch.interrupts import EARLY
from dptrain.launch.rendezvous_wait import check_rdzv_port
from dptrain.launch.warm import warm_workers_on
from dptrain.launch.worker import main as worker_main
from dptrain.metrics.console_log import console_log
from dptrain.metrics.monitor import check_monitoring

FLAG_FIELDS = {
    "nproc_per_node": ("--nproc-per-node", "launch.nproc_per_node"),
    "out": ("--out", "log.out_dir"),
    "max_restarts": ("--max-restarts", "launch.max_restarts"),
}
"""Options that set a config field: option dest -> (the flag, the field)."""
FLAG_NAMES = {field: flag for flag, field in FLAG_FIELDS.values()}


def flag_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The config fields the command's options set, as {field: 'field=value' override, ...}."""
    extra = {}
    for dest, (_, field) in FLAG_FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None and value != "":
            extra[field] = f"{field}={value}"
    return extra


def cmd_run(args: argparse.Namespace) -> int:
    cluster = cluster_launch()  # a Kubeflow pod's PET_* layout: after the file, before the command line's overrides
    if cluster is not None:
        print(cluster.describe(), file=sys.stderr)
        args.items = [*cluster.overrides, *args.items]
    cfg = load_command_line(
        args.items, extra=flag_overrides(args), flags=FLAG_NAMES, run_dir=args.out if args.resume != "none" else None,
        defaults=preset_overrides(args.defaults),
    )
    check_workers_fit(local_world_size(cfg.launch))  # `--nproc-per-node 4096`: said before the batch arithmetic
    validate(cfg)  # before anything imports torch: a refusal is instant
    check_rdzv_endpoint(cfg.launch.rdzv_endpoint)  # an unknown host: said now, not after torchrun's retries
    check_rdzv_port(cfg.launch.rdzv_endpoint)  # a port another program holds: said now, not after join_timeout
    run_dir = Path(default_out_dir(cfg))
    check_dir_writable(run_dir, what="--out" if args.out else "log.out_dir")
    if cfg.checkpoint.dir is not None:
        check_dir_writable(cfg.checkpoint.dir, what="checkpoint.dir")  # relative to the working directory
    if cfg.parallel.nvme_offload_dir is not None:
        check_nvme_dir(cfg.parallel.nvme_offload_dir)  # an existing directory on the drive, before any worker starts
    # One job per run directory: refused here, naming the holder, while another job (or its orphaned
    # workers, saving before they exit) still owns it. Held until this launcher exits.
    lock = RunDirLock(run_dir, per_host=max_nodes(cfg.launch) > 1)
    lock.acquire()
    try:
        # records but no config.yaml (a start-up that never trained): never train a recipe it did not name
        check_unnamed_recipe(run_dir, items=args.items, resume=args.resume)
        return _run_locked(args, cfg, run_dir=run_dir, lock=lock)
    finally:
        lock.release()


def _run_locked(args: argparse.Namespace, cfg: Config, *, run_dir: Path, lock: Any) -> int:
    nproc = local_world_size(cfg.launch)

    check_monitoring(cfg.log, nproc_per_node=nproc)  # packages installed, Prometheus ports free
    # An existing run: same model, same global batch; accumulation follows a new world size.
    cfg = prepare_resume(
        cfg, run_dir=run_dir, resume=args.resume, trust=args.trust_checkpoint, world_size=nproc * max_nodes(cfg.launch)
    )
    res = resolve(
        cfg, world_size=nproc * max_nodes(cfg.launch)
    )  # refuses bad batch arithmetic before any process starts
    cfg = dataclasses.replace(
        cfg,
        log=dataclasses.replace(cfg.log, out_dir=str(run_dir)),
        launch=dataclasses.replace(cfg.launch, nproc_per_node=nproc),
    )
    if is_elastic(cfg.launch):
        cfg = pin_global_batch(cfg, res=res)  # workers at another world size keep it (accumulation re-derived)
        if cfg.launch.max_restarts == 0:
            print(
                f"dptrain: warning: launch.nnodes={cfg.launch.nnodes} with launch.max_restarts=0: the first node that "
                "leaves ends the run (each node loss costs the survivors one restart; joins cost none)",
                file=sys.stderr,
            )
    train = check_factories(cfg, tp=res.dims.tp, cp=res.dims.cp)
    own_batches = getattr(train, "make_batch_sampler", None)
    if own_batches is not None:  # its own batches (a token budget): their checks, before any worker
        own_batches(grad_accum_steps=res.grad_accum_steps, dp_rank=0, dp_world_size=res.dp_world_size,
                    seed=cfg.train.seed, shuffle=cfg.data.shuffle, start_step=0)
    elif len(train) < res.global_batch_size:
        raise ConfigError(
            f"the training set has {len(train)} samples, fewer than one global batch of {res.global_batch_size}; "
            "lower train.global_batch_size or use more data"
        )
    finished = check_run_dir(cfg, run_dir=run_dir, resume=args.resume)  # never reset or rewrite a run silently
    if finished is not None:
        print(finished.message(run_dir=run_dir, max_steps=cfg.train.max_steps), file=sys.stderr)
        return 0
    # The workers read this file; RUN_DIR/config.yaml is written only once they have started (a failed start
    # leaves nothing a corrected command would inherit). Written whole or not at all (a full disk).
    run_dir.mkdir(parents=True, exist_ok=True)
    pending = run_dir / PENDING_CONFIG
    try:
        write_atomically(pending, dump_yaml(cfg))
    except OSError as e:
        raise ConfigError(f"cannot write the run's config to {pending}: {e}") from None
    lock.share(sys.argv)  # the workers take their own shared holds
    worker_args = [str(run_dir), "--config", str(pending), "--resume", args.resume]
    worker_args += ["--trust-checkpoint"] if args.trust_checkpoint else []

    with console_log(run_dir):  # the launcher's lines; rank 0 adds its own (worker.py)
        return _launch(cfg, res=res, nproc=nproc, run_dir=run_dir, pending=pending, worker_args=worker_args)


def _launch(cfg: Config, *, res: Any, nproc: int, run_dir: Path, pending: Path, worker_args: list[str]) -> int:
    try:
        EARLY.check()  # a Ctrl-C during the checks that torch's import swallowed: nothing starts
        if res.world_size == 1:
            return worker_main(worker_args)
        argv = launch.torchrun_args(
            cfg.launch, nproc_per_node=nproc, module="dptrain.launch.worker", module_args=worker_args
        )
        print(launch.describe_rendezvous(cfg.launch), flush=True)
        return launch.run_torchrun(
            argv,
            restarts=cfg.launch.max_restarts > 0,
            launch_cfg=cfg.launch,
            ckpt_root=checkpoint_root(cfg.checkpoint, run_dir),
            abandon=lambda: pending.unlink(missing_ok=True),
            warm=warm_workers_on(cfg.launch),
        )
    finally:
        pending.unlink(missing_ok=True)


def check_factories(cfg: Config, *, tp: int = 1, cp: int = 1) -> Any:
    """Import every factory, bind its kwargs, build the model once on the meta device and the data
    once (which warms caches, e.g. the corpus, before ranks race for them); with tp > 1 check the
    model can be split (at each cp rank's share of a row). Returns the train set."""
    # lazy: torch: loaded when the command runs, never for --help
    from dptrain.data.loader import split_train_val

    if cfg.train.loss:
        import_object(cfg.train.loss)  # a typo in an import path fails here, not in every worker
    check_hosted(cfg)  # optim.factory, scheduler_factory, eval_fn, collate (+ kwargs): import and bind
    model = check_model(cfg.model)
    # lazy: it loads the distributed stack (DTensor, FSDP2), which a refusal of the model above must not wait for
    from dptrain.train.build import align_labels

    data = align_labels(cfg.data, model)  # the labels the model expects; a `shift` against it is refused now
    data_fn = import_object(data.factory)
    check_signature(data_fn, data.kwargs, key="data.factory", spec=data.factory)
    train, _ = split_train_val(call_factory(data_fn, data.kwargs, key="data.factory", spec=data.factory))
    check_vocabulary(model, train)
    check_tensor_parallel(model, parallel=cfg.parallel, tp=tp, sample=train[0] if len(train) else None, cp=cp)
    return train
