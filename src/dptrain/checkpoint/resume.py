"""Which checkpoint a run resumes from, and making the run's metrics read as one run.

`--resume auto` (default) takes the newest committed checkpoint whose files match its
manifest, skipping (and naming, with the reason) every newer folder that is uncommitted or
corrupt. `--resume PATH` takes a step folder, or the newest valid one under a run directory
or checkpoint directory (none valid there: refused, naming every folder and why); a step folder
that fails verification is refused unless `--trust-checkpoint` is given. `--resume none` starts from scratch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dptrain.checkpoint import manifest as mf


@dataclass(frozen=True)
class Wording:
    """How a refusal names what its caller passed: `dptrain run`'s options by default (`API`: a
    `dptrain.Checkpointer`'s `resume=`; `dptrain ckpt` commands: their own argument)."""

    given: str = "--resume {}"
    """The argument as the caller wrote it; formatted with the value."""
    trust: str = (
        "Pass one step folder with --trust-checkpoint to load it without a valid manifest (files are still read "
        "with torch.load(weights_only=True)), or --resume none"
    )
    """What to do about a step folder that does not verify."""
    fresh: str = "--resume none"
    """How to start afresh instead."""


API = Wording(
    given="Checkpointer(resume={!r})",
    trust="Pass another step folder as resume=, or resume='auto' for the newest valid one",
    fresh="resume='overwrite' (the old checkpoints are moved aside)",
)
"""The words of `dptrain.Checkpointer(resume=...)`."""

EXPORT = Wording(given="ckpt export {}", trust="Pass one step folder with --trust-checkpoint to export it unverified",
                 fresh="another checkpoint")
"""The words of `dptrain ckpt export RUN_DIR_OR_CKPT`."""


@dataclass
class ResumeChoice:
    """The decision (made on rank 0, broadcast): a step folder or None, what to tell the user,
    or an error that stops the run."""

    path: str | None = None
    messages: list[str] = field(default_factory=list)
    error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    verified: bool = True  # False: the newest committed folder, its files not hashed (`newest_committed`)

    @property
    def step(self) -> int:
        """The chosen checkpoint's step (0: none)."""
        return int(self.meta["step"]) if self.path else 0


def newest_committed(root: Path) -> ResumeChoice:
    """The newest committed step folder under `root` with a readable manifest, its files NOT hashed: what a
    restart that resumes from memory needs to know of the disk (the step a snapshot must reach). Reading no
    checkpoint data keeps such a recovery off the disk; `_newest_valid` verifies when the disk is needed."""
    for d in reversed(mf.step_dirs(root)):
        info = mf.inspect_dir(d, check_hashes=False)
        if info.valid:
            return ResumeChoice(path=str(d), meta=info.meta, verified=False)
    return ResumeChoice()


def _newest_valid(root: Path) -> ResumeChoice:
    choice = ResumeChoice()
    for d in reversed(mf.step_dirs(root)):
        info = mf.inspect_dir(d)
        if info.valid:
            choice.path, choice.meta = str(d), info.meta
            return choice
        choice.messages.append(f"dptrain: skipping checkpoint {d}: {info.state}: {info.reason}")
    if choice.messages:
        choice.messages.append(f"dptrain: no valid checkpoint under {root}; starting from step 0")
    return choice


def _explicit(path: Path, *, trust: bool, words: Wording) -> ResumeChoice:
    info = mf.inspect_dir(path)
    if info.valid:
        return ResumeChoice(path=str(path), meta=info.meta)
    if not trust:
        return ResumeChoice(error=f"{words.given.format(str(path))}: {info.state}: {info.reason}. {words.trust}")
    try:
        meta = json.loads((path / mf.MANIFEST).read_text())["meta"]
    except (OSError, ValueError, KeyError):
        return ResumeChoice(error=f"cannot resume from {path}: {info.reason}, and without a readable manifest "
                                  "the step and data position are unknown")
    return ResumeChoice(
        path=str(path),
        meta=meta,
        messages=[f"dptrain: warning: loading UNVERIFIED checkpoint {path} (--trust-checkpoint): {info.reason}"],
    )


def choose_checkpoint(mode: str, *, root: Path, trust: bool = False, words: Wording = Wording()) -> ResumeChoice:
    """Apply `--resume MODE` (auto, none, or a path) with checkpoints under `root`; refusals name the
    argument in the caller's `words`."""
    if mode == "none":
        return ResumeChoice()
    if mode == "auto":
        return _newest_valid(root)
    path = Path(mode)
    given = words.given.format(mode)
    if not path.exists():
        return ResumeChoice(error=f"{given}: no such file or directory")
    if mf.step_of(path) is not None or (path / mf.MANIFEST).exists() or (path / mf.MARKER).exists():
        return _explicit(path, trust=trust, words=words)
    for sub in (path / "checkpoints", path):
        if mf.step_dirs(sub):
            choice = _newest_valid(sub)
            if choice.path is None:  # asked for by name: refused, not a silent fresh start
                why = "".join(
                    f"\n  {d}: {i.state}: {i.reason}"
                    for d, i in ((d, mf.inspect_dir(d)) for d in reversed(mf.step_dirs(sub)))
                )
                return ResumeChoice(error=f"{given}: no valid checkpoint under {sub}:{why}\n{words.trust}")
            return choice
    return ResumeChoice(error=f"{given}: holds no step_NNNNNN checkpoint folders")


def truncate_metrics(path: Path, *, step: int) -> float | None:
    """Cut metrics.jsonl after the last record of `step` (dropping later records and a torn last
    line), in place, so that the resumed run appends to a file that reads as one run and a sink
    already open on it keeps writing to the same file; return the initial validation loss."""
    if not path.is_file():
        return None
    keep_bytes, initial = 0, None
    with open(path, "rb") as f:
        for raw in f:
            try:
                rec = json.loads(raw)
            except ValueError:
                break  # a torn line can only be the last one
            if not raw.endswith(b"\n") or rec.get("step", 0) > step:
                break  # records are appended in step order: the rest is after the checkpoint
            keep_bytes += len(raw)
            if initial is None and rec.get("step") == 0 and "val_loss" in rec:
                initial = rec["val_loss"]
    with open(path, "r+b") as f:
        f.truncate(keep_bytes)
        f.flush()
        os.fsync(f.fileno())
    return initial
