"""The `dptrain` command: parse, build the config, delegate. Exit code 2 means bad input."""

from __future__ import annotations

import argparse
import dataclasses
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from dptrain.cli.ckpt import add_ckpt_parser
from dptrain.cli.data import add_data_parser
from dptrain.cli.manifest import add_manifest_parser
from dptrain.cli.plan import add_plan_parser
from dptrain.cli.report import add_report_parser
from dptrain.cli.run import FLAG_NAMES, check_factories, cmd_run, flag_overrides
from dptrain.cli.script import cmd_launch
from dptrain.cli.top import add_top_parser
from dptrain.config import (
    Config,
    ConfigError,
    field_docs,
    local_world_size,
    resolve,
    to_dict,
    validate,
)
from dptrain.config.deepspeed import mapping_for_file
from dptrain.config.hosting import DEFAULTS_PRESETS, preset_overrides
from dptrain.config.load import dump_yaml, load_command_line
from dptrain.config.nodes import max_nodes
from dptrain.launch.checks import (
    FactoryFailed,
    check_dir_writable,
    check_file_writable,
)
from dptrain.launch.interrupts import EARLY
from dptrain.tools.bench import parse_options
from dptrain.tools.bench.run import run_bench

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    previous = signal.getsignal(signal.SIGINT)
    EARLY.install()  # a Ctrl-C before the run's own handler: remembered even where torch's import swallows it
    try:
        return _main(argv)
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    try:
        args = _parse(parser, sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT

    try:
        return args.func(args)
    except ConfigError as e:
        print(f"dptrain: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except FactoryFailed as e:
        print(e.report, end="", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C before any worker or signal handler of the run existed
        print("\ndptrain: interrupted (Ctrl-C) before training started: nothing to save", file=sys.stderr)
        return 130


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Options and `section.field=value` overrides in any order: `run CFG --out DIR train.max_steps=5`.
    argparse stops a `nargs="*"` positional at the first option; what it leaves over is appended."""
    args, extra = parser.parse_known_args(argv)
    if hasattr(args, "items"):
        args.items += [a for a in extra if not a.startswith("-")]
        extra = [a for a in extra if a.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


_OVERRIDE_LIKE = re.compile(r"^[A-Za-z_][\w-]*\.[\w.-]+=")


class OneValue(argparse.Action):
    """An option that takes one value, once: given twice with different values it is refused (the
    last one would silently win), and a value that is empty or looks like a `section.field=value`
    override (`--out train.max_steps=3`: the directory was forgotten) is refused with the reason."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        text = str(values)
        if not text.strip():
            parser.error(f"{option_string} is empty (an unset shell variable?); give it a value")
        if _OVERRIDE_LIKE.match(text):
            parser.error(
                f"{option_string} {text!r} looks like a section.field=value override, not the option's "
                f"value; give {option_string} its value first, e.g. {option_string} runs/my-run {text}"
            )
        before = getattr(namespace, self.dest, None)
        if before is not None and before != self.default and before != values:
            parser.error(f"{option_string} given twice: {before!r} and {values!r}; keep one")
        setattr(namespace, self.dest, values)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dptrain", description="Data-parallel training of PyTorch models.")
    sub = p.add_subparsers(metavar="COMMAND")

    run = sub.add_parser("run", help="train a recipe (default: a small LLaMA-style LM on the Python stdlib)")
    run.add_argument(
        "items",
        nargs="*",
        metavar="[CONFIG] [section.field=value ...]",
        help="a YAML recipe or DeepSpeed-style JSON file, then dotted overrides",
    )
    run.add_argument(
        "--nproc-per-node", action=OneValue, help="workers per node (default: every GPU, else 2 on the CPU)"
    )
    run.add_argument("--out", action=OneValue, help="run directory (default: runs/<recipe>-<timestamp>)")
    run.add_argument(
        "--max-restarts", action=OneValue, type=int, help="elastic restarts of the worker group (torchrun)"
    )
    run.add_argument(
        "--resume",
        action=OneValue,
        default="auto",
        metavar="auto|none|PATH",
        help="auto (default): continue from the newest valid checkpoint in the run directory, if any; "
        "none: start from scratch; PATH: a step folder, run directory or checkpoint directory",
    )
    run.add_argument("--defaults", action=OneValue, default="dptrain", metavar="dptrain|torch", help=DEFAULTS_HELP)
    run.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="allow --resume PATH to load a checkpoint that has no valid manifest (still weights-only)",
    )
    run.set_defaults(func=cmd_run)

    launch = sub.add_parser(
        "launch", help="run your own script under torchrun with dptrain's defaults", prefix_chars="\0"
    )  # everything goes to torchrun untouched
    launch.add_argument("argv", nargs=argparse.REMAINDER, metavar="[torchrun options] SCRIPT [ARGS]")
    launch.set_defaults(func=cmd_launch)

    cfg = sub.add_parser("config", help="inspect configs")
    cfg_sub = cfg.add_subparsers(metavar="ACTION")
    show = cfg_sub.add_parser("show", help="print the fully resolved config, derived values included")
    show.add_argument("items", nargs="*", metavar="[CONFIG] [section.field=value ...]")
    show.add_argument("--nproc-per-node")
    show.add_argument("--defaults", action=OneValue, default="dptrain", metavar="dptrain|torch", help=DEFAULTS_HELP)
    show.set_defaults(func=cmd_config_show)

    docs = cfg_sub.add_parser("docs", help="print the config reference (Markdown) from the fields' docstrings")
    docs.set_defaults(func=cmd_config_docs)

    doctor = sub.add_parser("doctor", help="check this machine for distributed training (versions, GPUs, network, env)")
    doctor.add_argument(
        "--comm", action="store_true", help="also run an all-reduce bandwidth/latency sweep across ranks"
    )
    doctor.add_argument("--nproc-per-node", type=int, help="ranks for --comm (default: every GPU, else 2 on the CPU)")
    doctor.add_argument(
        "--json", metavar="FILE", help="--comm: also write the sweep to FILE (JSON) for `dptrain plan --comm FILE`"
    )
    doctor.set_defaults(func=cmd_doctor)

    gen = sub.add_parser("generate", help="sample text from a trained language model")
    gen.add_argument("run_dir")
    gen.add_argument("--prompt", default="def ")
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=300,
        help="bytes (tokens with a --tokenizer) to sample (>= 1); past the model's context the last max_seq_len are "
        "the window",
    )
    gen.add_argument("--temperature", type=float, default=0.8, help="> 0 samples; 0 is greedy (argmax)")
    gen.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest bytes (0: all)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tokenizer", default=None,
                     help="'bytes', a tokenizer.json or a from_pretrained folder (default: the one the run's prepared "
                     "data names, else bytes)")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="time dptrain's strategies and compressions against a raw PyTorch DDP loop")
    bench.add_argument("items", nargs="*", metavar="[CONFIG] [section.field=value ...]")
    bench.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    bench.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    bench.add_argument("--variants", help="comma-separated variants (default: all; raw is always run)")
    bench.add_argument("--nproc", type=int, help="largest world size N (default: launch.nproc_per_node)")
    bench.add_argument("--scaling", default="both", help="none, strong, weak or both (default) over world 1..N")
    bench.add_argument("--out", help="output directory (default: runs/bench-<timestamp>)")
    bench.set_defaults(func=cmd_bench)


    add_ckpt_parser(sub)

    add_report_parser(sub)

    add_manifest_parser(sub)

    add_top_parser(sub)

    add_plan_parser(sub)

    add_data_parser(sub)
    return p


DEFAULTS_HELP = (
    "torch: plain PyTorch semantics under the config file and overrides (no weight decay, no warm-up, a constant "
    "lr, no clipping, betas (0.9, 0.999)); `dptrain config show --defaults torch` lists the fields it sets"
)


def cmd_bench(args: argparse.Namespace) -> int:
    import time


    cfg = load_command_line(args.items)
    validate(cfg)
    nproc = args.nproc if args.nproc is not None else local_world_size(cfg.launch)
    opts = parse_options(
        steps=args.steps, warmup=args.warmup, nproc=nproc, scaling=args.scaling, variants=args.variants
    )
    out = args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}"

    check_dir_writable(out, what="--out")
    # check: imports, kwargs, the model on the meta device, the data once (warms the corpus cache)
    return run_bench(cfg, opts=opts, out_dir=out, check=check_factories)


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node={args.nproc_per_node} is not valid; use a positive integer")
    if args.json and not args.comm:
        raise ConfigError(f"--json {args.json} writes the --comm sweep; add --comm")
    if args.json:
        check_file_writable(args.json, what="--json")
    return _doctor().run_doctor(comm=args.comm, nproc=args.nproc_per_node, json_path=args.json)


def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = load_command_line(args.items, extra=flag_overrides(args), flags=FLAG_NAMES,
                            defaults=preset_overrides(args.defaults))
    res = resolve(cfg, world_size=local_world_size(cfg.launch) * max_nodes(cfg.launch))
    print(dump_yaml(cfg, extra=dataclasses.asdict(res)), end="")
    d = res.dims
    print(
        f"# layout: data-parallel {d.dp_size} (replicate {d.dp_replicate} x shard {d.dp_shard}) x context {d.cp} x "
        f"pipeline {d.pp} x tensor {d.tp} = world {d.world_size}\n"
        f"# batch: global {res.global_batch_size} = micro {res.micro_batch_size} x accum {res.grad_accum_steps} "
        f"x dp {res.dp_world_size}"
    )
    if args.defaults != "dptrain":
        print(f"# --defaults {args.defaults} set (where the file and overrides do not): "
              + ", ".join(preset_overrides(args.defaults)))
    if args.items and "=" not in args.items[0]:
        mapping = mapping_for_file(args.items[0])
        if mapping is not None:
            print(mapping.report(), end="")
    return 0


def cmd_config_docs(args: argparse.Namespace) -> int:
    print(config_reference(), end="")
    return 0


def config_reference() -> str:
    """Markdown tables of every config field: default and docstring."""

    defaults = to_dict(Config())
    lines = []
    for section in dataclasses.fields(Config):
        lines += [f"**`{section.name}`**", "", "| field | default | meaning |", "|---|---|---|"]
        lines += _reference_rows(section.name, getattr(Config(), section.name), defaults[section.name])
        lines.append("")
    for preset, fields in DEFAULTS_PRESETS.items():
        if fields:  # `dptrain run --defaults NAME`: what it sets under the config file
            lines += [f"**`--defaults {preset}`** sets, where the config file and the overrides do not:", "",
                      "| field | dptrain default | with the preset |", "|---|---|---|"]
            flat = {f"{k}.{n}": v for k, sec in defaults.items() for n, v in sec.items()}
            lines += [f"| `{k}` | `{flat[k]}` | `{v}` |" for k, v in fields.items()] + [""]
    return "\n".join(lines)


def _reference_rows(prefix: str, obj: Any, defaults: dict[str, Any]) -> list[str]:
    """One table row per field of the config section `obj`; a sub-section (model.lora) gives a row per field."""
    rows = []
    for name, doc in field_docs(type(obj)).items():
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value):
            rows.append(f"| `{prefix}.{name}` | section | {doc} |")
            rows += _reference_rows(f"{prefix}.{name}", value, defaults[name])
        else:
            rows.append(f"| `{prefix}.{name}` | `{defaults[name]}` | {doc} |")
    return rows


def _doctor():
    # lazy: torch: loaded when the command runs, never for --help
    from dptrain.tools import doctor

    return doctor


def cmd_generate(args: argparse.Namespace) -> int:
    import math

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} is not valid; use a positive integer")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(
            f"--temperature={args.temperature} is not valid; use a finite number >= 0 (0: greedy, > 0: sampling)"
        )
    if args.top_k < 0:
        raise ConfigError(f"--top-k={args.top_k} is not valid; use an integer >= 0 (0: no top-k filtering)")
    if not (Path(args.run_dir) / "final" / "model.safetensors").is_file():
        raise ConfigError(f"{args.run_dir!r} holds no final/model.safetensors; pass the directory of a finished run")
    # lazy: torch: loaded when the command runs, never for --help
    from dptrain.cli.generate import generate, load_model_from_run, run_tokenizer

    tokenizer = run_tokenizer(args.run_dir, spec=args.tokenizer)
    model = load_model_from_run(args.run_dir)
    text = generate(
        model,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        progress=sys.stderr,
        tokenizer=tokenizer,
    )
    print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
