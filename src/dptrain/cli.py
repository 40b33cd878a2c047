"""The `dptrain` command: parse, build the config, delegate. Exit code 2 means bad input."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from dptrain.config import Config, ConfigError, default_out_dir, local_world_size, resolve
from dptrain.config.layout import strategy_mode
from dptrain.config.load import dump_yaml, load_config

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"dptrain: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dptrain", description="Data-parallel training of PyTorch models.")
    sub = p.add_subparsers(metavar="COMMAND")

    run = sub.add_parser("run", help="train a recipe (default: a small LLaMA-style LM on the Python stdlib)")
    run.add_argument("items", nargs="*", metavar="[CONFIG] [section.field=value ...]",
                     help="a YAML recipe or DeepSpeed-style JSON file, then dotted overrides")
    run.add_argument("--nproc-per-node", help="workers per node (default: every GPU, else 2 on the CPU)")
    run.add_argument("--out", help="run directory (default: runs/<recipe>-<timestamp>)")
    run.add_argument("--max-restarts", type=int, help="elastic restarts of the worker group (torchrun)")
    run.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                     help="auto (default): continue from the newest valid checkpoint in the run directory, if any; "
                          "none: start from scratch; PATH: a step folder, run directory or checkpoint directory")
    run.add_argument("--trust-checkpoint", action="store_true",
                     help="allow --resume PATH to load a checkpoint that has no valid manifest (still weights-only)")
    run.set_defaults(func=cmd_run)

    launch = sub.add_parser("launch", help="run your own script under torchrun with dptrain's defaults",
                            prefix_chars="\0")  # everything goes to torchrun untouched
    launch.add_argument("argv", nargs=argparse.REMAINDER, metavar="[torchrun options] SCRIPT [ARGS]")
    launch.set_defaults(func=cmd_launch)

    cfg = sub.add_parser("config", help="inspect configs")
    cfg_sub = cfg.add_subparsers(metavar="ACTION")
    show = cfg_sub.add_parser("show", help="print the fully resolved config, derived values included")
    show.add_argument("items", nargs="*", metavar="[CONFIG] [section.field=value ...]")
    show.add_argument("--nproc-per-node")
    show.set_defaults(func=cmd_config_show)

    docs = cfg_sub.add_parser("docs", help="print the config reference (Markdown) from the fields' docstrings")
    docs.set_defaults(func=cmd_config_docs)

    doctor = sub.add_parser("doctor", help="check this machine for distributed training (versions, GPUs, network, env)")
    doctor.add_argument("--comm", action="store_true", help="also run an all-reduce bandwidth/latency sweep across ranks")
    doctor.add_argument("--nproc-per-node", type=int, help="ranks for --comm (default: every GPU, else 2 on the CPU)")
    doctor.set_defaults(func=lambda a: _doctor().run_doctor(comm=a.comm, nproc=a.nproc_per_node))

    gen = sub.add_parser("generate", help="sample text from a trained language model")
    gen.add_argument("run_dir")
    gen.add_argument("--prompt", default="def ")
    gen.add_argument("--max-new-tokens", type=int, default=300)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=40)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=cmd_generate)

    from dptrain.checkpoint.cli import add_ckpt_parser

    add_ckpt_parser(sub)
    return p


def _load(items: list[str], *, extra: list[str], run_dir: str | None = None) -> Config:
    """CONFIG is the first item without '=' (if any); the rest are overrides. Without CONFIG, an
    existing `run_dir`'s config.yaml is the base (continuing that run)."""
    path = None
    overrides = []
    for i, item in enumerate(items):
        if "=" not in item and i == 0:
            path = item
        elif "=" not in item:
            raise ConfigError(f"{item!r} is not an override of the form section.field=value (only one CONFIG file may be given)")
        else:
            overrides.append(item)
    if path is None and run_dir is not None and (Path(run_dir) / "config.yaml").is_file():
        path = str(Path(run_dir) / "config.yaml")
    cfg = load_config(path, [*overrides, *extra])
    if cfg.launch.nproc_per_node == "auto" and strategy_mode(cfg.parallel).single_process:
        # one-process strategies: `auto` means one worker (dp drives every GPU from it)
        cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, nproc_per_node=1))
    return cfg


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    extra = []
    if getattr(args, "nproc_per_node", None) is not None:
        extra.append(f"launch.nproc_per_node={args.nproc_per_node}")
    if getattr(args, "out", None):
        extra.append(f"log.out_dir={args.out}")
    if getattr(args, "max_restarts", None) is not None:
        extra.append(f"launch.max_restarts={args.max_restarts}")
    return extra


def cmd_run(args: argparse.Namespace) -> int:
    from dptrain import launch
    from dptrain.build import build_datasets, import_object
    from dptrain.checkpoint.cli import prepare_resume

    cfg = _load(args.items, extra=_flag_overrides(args), run_dir=args.out if args.resume != "none" else None)
    nproc = local_world_size(cfg.launch)
    run_dir = Path(default_out_dir(cfg))
    # An existing run: same model, same global batch; accumulation follows a new world size.
    cfg = prepare_resume(cfg, run_dir=run_dir, resume=args.resume, trust=args.trust_checkpoint,
                         world_size=nproc * cfg.launch.nnodes)
    res = resolve(cfg, world_size=nproc * cfg.launch.nnodes)  # refuses bad batch arithmetic before any process starts
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, out_dir=str(run_dir)),
                              launch=dataclasses.replace(cfg.launch, nproc_per_node=nproc))
    # Build the data once here: it warms caches (the corpus) before ranks race for them, and a
    # dataset smaller than one global batch is refused before any worker starts.
    for spec in (cfg.model.factory, cfg.train.loss, cfg.data.collate):
        if spec:
            import_object(spec)  # a typo in an import path fails here, not in every worker
    train, _ = build_datasets(cfg.data)
    if len(train) < res.global_batch_size:
        raise ConfigError(
            f"the training set has {len(train)} samples, fewer than one global batch of {res.global_batch_size}; "
            "lower train.global_batch_size or use more data"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    ckpt_args = ["--resume", args.resume] + (["--trust-checkpoint"] if args.trust_checkpoint else [])
    if res.world_size == 1:
        from dptrain.worker import main as worker_main

        return worker_main([str(run_dir), *ckpt_args])
    argv = launch.torchrun_args(cfg.launch, nproc_per_node=nproc, module="dptrain.worker",
                                module_args=[str(run_dir), *ckpt_args])
    print(launch.describe_rendezvous(cfg.launch), flush=True)
    return launch.run_torchrun(argv, restarts=cfg.launch.max_restarts > 0)


def cmd_launch(args: argparse.Namespace) -> int:
    from dptrain import launch
    from dptrain.config import LaunchConfig

    if not args.argv:
        raise ConfigError("dptrain launch needs a script: dptrain launch [torchrun options] SCRIPT [ARGS]")
    argv = launch.user_script_args(args.argv, default_nproc=local_world_size(LaunchConfig()))
    restarts = any(a.split("=")[0] in ("--max-restarts", "--max_restarts") for a in argv)
    return launch.run_torchrun(argv, restarts=restarts)


def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = _load(args.items, extra=_flag_overrides(args))
    res = resolve(cfg, world_size=local_world_size(cfg.launch) * cfg.launch.nnodes)
    print(dump_yaml(cfg, extra=dataclasses.asdict(res)), end="")
    if args.items and "=" not in args.items[0]:
        from dptrain.config.deepspeed import mapping_for_file

        mapping = mapping_for_file(args.items[0])
        if mapping is not None:
            print(mapping.report(), end="")
    return 0


def cmd_config_docs(args: argparse.Namespace) -> int:
    print(config_reference(), end="")
    return 0


def config_reference() -> str:
    """Markdown tables of every config field: default and docstring."""
    from dptrain.config import field_docs, to_dict

    defaults = to_dict(Config())
    lines = []
    for section in dataclasses.fields(Config):
        lines += [f"**`{section.name}`**", "", "| field | default | meaning |", "|---|---|---|"]
        docs = field_docs(type(getattr(Config(), section.name)))
        for name, doc in docs.items():
            default = defaults[section.name][name]
            lines.append(f"| `{section.name}.{name}` | `{default}` | {doc} |")
        lines.append("")
    return "\n".join(lines)


def _doctor():
    from dptrain.diagnostics import doctor

    return doctor


def cmd_generate(args: argparse.Namespace) -> int:
    from dptrain.generate import generate, load_model_from_run

    if not (Path(args.run_dir) / "final" / "model.safetensors").is_file():
        raise ConfigError(f"{args.run_dir!r} holds no final/model.safetensors; pass the directory of a finished run")
    model = load_model_from_run(args.run_dir)
    text = generate(model, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_k=args.top_k, seed=args.seed)
    print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
