"""`dptrain ckpt ls|verify|export`, and the pre-flight checks `dptrain run` does before resuming."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint.extra import describe as describe_extra
from dptrain.checkpoint.manifest import checkpoint_root
from dptrain.checkpoint.resume import choose_checkpoint
from dptrain.cli.ckpt_merge import chosen_for_export, export_merged
from dptrain.config import BatchSizeError, Config, ConfigError, resolve, to_dict
from dptrain.config.load import load_config
from dptrain.launch.checks import check_dir_writable, check_file_writable

BUILTIN_LLAMA = "dptrain.models.llama:build_llama"


def _root_of(target: Path) -> Path:
    """The folder holding step folders for a run directory (of `dptrain run`: its config names it; of a
    `dptrain.Checkpointer`: its checkpoints/), a checkpoint directory or a step folder."""
    if mf.step_of(target) is not None:
        return target.parent
    if (target / "config.yaml").is_file():
        return checkpoint_root(load_config(target / "config.yaml").checkpoint, target)
    if (target / "checkpoints").is_dir() and not mf.step_dirs(target):
        return target / "checkpoints"
    return target


def _nothing_there(target: str) -> str:
    root = _root_of(Path(target))
    where = f"{root}" if root == Path(target) else f"{root} (the checkpoint folder of {target})"
    return (
        f"dptrain: error: no checkpoints under {where}: no step_NNNNNN folder. Pass a run directory of `dptrain "
        "run` or of a dptrain.Checkpointer (its out_dir), its checkpoints/ folder, or a step_NNNNNN folder"
    )


def _step_folders(target: Path) -> list[Path]:
    return [target] if mf.step_of(target) is not None else mf.step_dirs(_root_of(target))


# ---------------------------------------------------------------------- run pre-flight
def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{prefix}.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def _newest_meta(cfg: Config, *, run_dir: Path, resume: str, trust: bool) -> dict[str, Any] | None:
    if resume != "auto":
        choice = choose_checkpoint(resume, root=run_dir, trust=trust)
        if choice.error:
            raise ConfigError(choice.error)
        return choice.meta
    # auto: the workers verify the hashes; here only the newest committed manifest is read.
    for info in reversed(mf.list_checkpoints(checkpoint_root(cfg.checkpoint, run_dir), check_hashes=False)):
        if info.valid:
            return info.meta
    return None


def prepare_resume(cfg: Config, *, run_dir: Path, resume: str, trust: bool, world_size: int) -> Config:
    """Check that `cfg` can continue the run in `run_dir` (same model, same global batch) and
    re-derive gradient accumulation for a new world size. Raises ConfigError (exit 2)."""
    if resume == "none":
        root = checkpoint_root(cfg.checkpoint, run_dir)
        usable = next((d for d in reversed(mf.step_dirs(root)) if mf.inspect_dir(d).valid), None)
        if usable is not None:  # unusable folders only: check_run_dir moves them aside with the records
            raise ConfigError(
                f"--resume none, but {root} holds checkpoints of an earlier run (newest valid: {usable.name}; a later "
                "--resume auto or an elastic restart would pick them up); use a new --out, or move that directory away"
            )
        return cfg
    old_cfg = run_dir / "config.yaml"
    if old_cfg.is_file():
        changed = _diff(to_dict(load_config(old_cfg).model), to_dict(cfg.model), "model")
        if changed:
            raise ConfigError(
                f"{run_dir} holds a run of another model ({'; '.join(changed)}); a resumed run must keep the model "
                "config. Use a new --out, or --resume none to start over in this directory"
            )
    meta = _newest_meta(cfg, run_dir=run_dir, resume=resume, trust=trust)
    if not meta:
        return cfg
    # lazy: torch: loaded only when a checkpoint is read
    from dptrain.checkpoint.restore import check_format_version

    try:
        check_format_version(run_dir if resume == "auto" else Path(resume), meta)
    except mf.CheckpointError as e:
        raise ConfigError(str(e)) from None
    g = int(meta["global_batch_size"])
    if cfg.train.global_batch_size not in (None, g):
        raise ConfigError(
            f"the checkpoint was trained with train.global_batch_size={g}, this run asks for "
            f"{cfg.train.global_batch_size}; keep it at {g} (the data order and the optimizer depend on it)"
        )
    try:
        if resolve(cfg, world_size=world_size).global_batch_size == g:
            return cfg
    except BatchSizeError:
        pass  # the batch does not fit this world size: accumulation is re-derived below (any other error is real)
    train = dataclasses.replace(cfg.train, global_batch_size=g, grad_accum_steps=None)
    new = dataclasses.replace(cfg, train=train)
    try:
        res = resolve(new, world_size=world_size)
    except BatchSizeError as e:
        raise BatchSizeError(
            f"cannot keep the checkpoint's global batch of {g} at world size {world_size}: {e}"
        ) from None
    print(
        f"dptrain: resuming at world size {world_size} (checkpoint: {meta['world_size']}): global batch {g} = "
        f"micro {res.micro_batch_size} x accum {res.grad_accum_steps} x dp {res.dp_world_size}",
        file=sys.stderr,
    )
    return new


# ---------------------------------------------------------------------- dptrain ckpt
def add_ckpt_parser(sub: Any) -> None:
    """Register `dptrain ckpt` on the main parser's subcommands."""
    ckpt = sub.add_parser("ckpt", help="list, verify and export checkpoints")
    acts = ckpt.add_subparsers(metavar="ACTION")
    ls = acts.add_parser("ls", help="list a run's checkpoints with their state (committed, uncommitted, corrupt)")
    ls.add_argument("target", metavar="RUN_DIR_OR_CKPT")
    ls.set_defaults(func=cmd_ls)
    ver = acts.add_parser("verify", help="check every file against the manifest; exit 1 if any is not valid")
    ver.add_argument("target", metavar="RUN_DIR_OR_CKPT")
    ver.set_defaults(func=cmd_verify)
    exp = acts.add_parser("export", help="write the consolidated model.safetensors of a checkpoint (any strategy)")
    exp.add_argument(
        "target", metavar="RUN_DIR_OR_CKPT", help="a step folder, or a run dir (its newest valid checkpoint)"
    )
    exp.add_argument(
        "--format", choices=("safetensors", "hf"), default="safetensors",
        help="safetensors: one file of plain parameter names; hf: a Hugging Face Llama folder (config.json, "
        "model.safetensors) that LlamaForCausalLM.from_pretrained loads, for a run of the built-in LLaMA",
    )
    exp.add_argument("--out", help="the file to write (default model.safetensors); with --format hf, the folder")
    exp.add_argument("--trust-checkpoint", action="store_true", help="export a step folder without a valid manifest")
    exp.add_argument("--merge", action="store_true", help="LoRA runs: merge the adapters into the base and write the "
                     "full model into the folder --out (save_pretrained layout for Hugging Face models)")
    exp.set_defaults(func=cmd_export)


def _size(path: Path) -> str:
    n = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _check_target(target: str) -> None:
    """A path `ckpt ls/verify/export` can look in: an existing directory (a run, its checkpoints/, a step)."""
    p = Path(target)
    if not p.exists():
        raise ConfigError(f"{target!r} does not exist; pass a run directory, its checkpoints/ or a step_* folder")
    if not p.is_dir():
        raise ConfigError(f"{target!r} is a file; pass a run directory, its checkpoints/ or a step_* folder")


def cmd_ls(args: argparse.Namespace) -> int:
    _check_target(args.target)
    folders = _step_folders(Path(args.target))
    if not folders:
        print(_nothing_there(args.target), file=sys.stderr)
        return 1
    print(f"{'step':>8}  {'state':<11}  {'size':>10}  {'world':>5}  {'strategy':<8}  path / reason")
    for d in folders:
        info = mf.inspect_dir(d)
        meta = info.meta
        print(
            f"{info.step:>8}  {info.state:<11}  {_size(d):>10}  {meta.get('world_size', '-'):>5}  "
            f"{meta.get('strategy', '-'):<8}  {d}" + (f"\n{'':>10}{info.reason}" if info.reason else "")
        )
        if meta.get("extra"):  # a dptrain.Checkpointer's save(extra=...)
            print(f"{'':>10}extra: {describe_extra(meta['extra'])}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    _check_target(args.target)
    folders = _step_folders(Path(args.target))
    if not folders:
        print(_nothing_there(args.target), file=sys.stderr)
        return 1
    bad = 0
    for d in folders:
        info = mf.inspect_dir(d)
        if info.valid:
            print(f"OK       {d} ({len(mf.read_manifest(d)['files'])} files match the manifest)")
        else:
            bad += 1
            print(f"{info.state.upper():<8} {d}: {info.reason}")
    return 1 if bad else 0


def cmd_export(args: argparse.Namespace) -> int:
    # lazy: torch: loaded only when a checkpoint is read
    from dptrain.checkpoint import storage

    target = Path(args.target)
    fmt = getattr(args, "format", "safetensors")  # a Namespace built in Python may leave out the newer options
    if getattr(args, "merge", False):
        if fmt == "hf":
            raise ConfigError("ckpt export: --merge and --format hf do not go together; --merge writes the merged "
                              "model in the base's own layout (save_pretrained for a Hugging Face base)")
        if args.out is None:
            raise ConfigError("ckpt export --merge needs --out DIR: the folder to write the merged model into")
        _check_target(args.target)
        return export_merged(args, root=_root_of(target))
    if fmt == "hf":
        return _export_hf(args)
    args.out = args.out or "model.safetensors"
    if Path(args.out).is_dir():
        raise ConfigError(
            f"ckpt export --out {args.out!r} is a directory; name the file to write, e.g. "
            f"{str(Path(args.out) / 'model.safetensors')!r}"
        )

    _check_target(args.target)
    check_file_writable(args.out, what="ckpt export --out")
    path, meta = chosen_for_export(target, root=_root_of(target), trust=args.trust_checkpoint)
    try:
        state = storage.load_full_model_state(path, fmt=meta["format"])
    except mf.CheckpointError as e:
        print(f"dptrain: error: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    storage.save_safetensors(state, out)
    print(f"exported {len(state)} tensors of {path} (step {meta['step']}) to {out}")
    return 0


def _run_config(target: Path) -> Config:
    """The config.yaml of the run a checkpoint target belongs to (the run dir, or up to two folders above)."""
    for folder in (target, *list(target.resolve().parents)[:2]):
        if (folder / "config.yaml").is_file():
            return load_config(folder / "config.yaml")
    raise ConfigError(
        f"ckpt export --format hf: no config.yaml in {str(target)!r} or the two folders above it; it says the "
        "model's dimensions: pass the run directory of `dptrain run`, or a step folder inside it"
    )


def _export_hf(args: argparse.Namespace) -> int:
    """`ckpt export --format hf`: the built-in LLaMA's checkpoint as a Hugging Face Llama folder."""
    # lazy: torch: loaded only when a checkpoint is read
    from dptrain.checkpoint.hf import export_llama_hf

    if not args.out:
        raise ConfigError("ckpt export --format hf needs --out DIR: the folder to write (created if missing)")
    out, target = Path(args.out), Path(args.target)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"ckpt export --format hf --out {args.out!r} is a file; pass a folder (created if missing)")
    _check_target(args.target)
    model = _run_config(target).model
    if model.factory != BUILTIN_LLAMA:
        raise ConfigError(
            f"ckpt export --format hf writes the built-in LLaMA ({BUILTIN_LLAMA}); this run's model.factory is "
            f"{model.factory!r} (a transformers model's final/ is already a save_pretrained folder)"
        )
    check_dir_writable(out, what="ckpt export --out")
    path, meta = chosen_for_export(target, root=_root_of(target), trust=args.trust_checkpoint)
    try:
        written = export_llama_hf(path, fmt=meta["format"], model_kwargs=model.kwargs, out_dir=out)
    except mf.CheckpointError as e:
        print(f"dptrain: error: {e}", file=sys.stderr)
        return 1
    print(f"exported {path} (step {meta['step']}) as a Hugging Face Llama folder {out}: "
          f"{', '.join(written)}")
    return 0
