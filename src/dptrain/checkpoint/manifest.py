"""The commit protocol: data files, then a manifest of their sizes and SHA-256, then a marker.

A checkpoint folder is trusted only when all three hold:

1. `COMMITTED` exists (written last, by write-temp + fsync + rename + fsync of the folder) and
   names the SHA-256 of `manifest.json`;
2. `manifest.json` has exactly that hash;
3. every data file listed in the manifest exists with the listed size and SHA-256, and no other
   data file is present.

`verify` checks all of that by reading bytes only: nothing is unpickled before it passes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dptrain.metrics import strict_json

MANIFEST = "manifest.json"
MARKER = "COMMITTED"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, uncommitted or corrupt; the message names the file and the hashes."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A step folder and what `inspect` found: state is committed, uncommitted or corrupt."""

    path: Path
    step: int
    state: str
    reason: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        """True when the folder is committed and every file matches the manifest."""
        return self.state == "committed"


def step_dir_name(step: int) -> str:
    """`step_000120` for step 120 (zero-padded so that names sort by step)."""
    return f"step_{step:06d}"


def step_of(path: Path) -> int | None:
    """The step a `step_NNNNNN` folder holds, or None for any other name."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either nothing or all of it."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def data_files(ckpt_dir: Path) -> list[str]:
    """Every regular file of a checkpoint folder except the manifest, the marker and temp files,
    as sorted POSIX paths relative to the folder."""
    out = []
    for p in ckpt_dir.rglob("*"):
        rel = p.relative_to(ckpt_dir).as_posix()
        if p.is_file() and rel not in (MANIFEST, MARKER) and ".tmp" not in p.name:
            out.append(rel)
    return sorted(out)


def file_entry(path: Path) -> dict[str, Any]:
    """The manifest entry of one file: its size and SHA-256."""
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def uncommit(ckpt_dir: Path) -> None:
    """Remove the marker (first step of overwriting a folder): a crash from here on leaves an
    uncommitted folder that loaders ignore, never a committed one with mixed contents."""
    marker = ckpt_dir / MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(ckpt_dir)


def write_manifest(ckpt_dir: Path, *, files: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """Write `manifest.json` (atomically) and return its SHA-256."""
    body = {"format": FORMAT_VERSION, "files": dict(sorted(files.items())), "meta": meta}
    data = (strict_json.dumps(body, indent=1, sort_keys=True) + "\n").encode()
    atomic_write(ckpt_dir / MANIFEST, data)
    return hashlib.sha256(data).hexdigest()


def commit(ckpt_dir: Path, *, manifest_sha256: str) -> None:
    """Write the marker last; from now on the folder is a committed checkpoint."""
    atomic_write(ckpt_dir / MARKER, (json.dumps({"manifest_sha256": manifest_sha256}) + "\n").encode())


def read_manifest(ckpt_dir: Path, *, require_commit: bool = True) -> dict[str, Any]:
    """The manifest, checked against the marker (when `require_commit`). Raises CheckpointError."""
    manifest = ckpt_dir / MANIFEST
    marker = ckpt_dir / MARKER
    if require_commit and not marker.is_file():
        raise CheckpointError(
            f"{ckpt_dir}: not committed (no {MARKER} marker): it was being written when the run stopped"
        )
    if not manifest.is_file():
        raise CheckpointError(f"{ckpt_dir}: no {MANIFEST}")
    raw = manifest.read_bytes()
    if require_commit:
        try:
            expected = json.loads(marker.read_text())["manifest_sha256"]
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{marker}: unreadable commit marker") from None
        actual = hashlib.sha256(raw).hexdigest()
        if actual != expected:
            raise CheckpointError(f"{manifest}: SHA-256 mismatch: expected {expected} (from {MARKER}), actual {actual}")
    try:
        body = json.loads(raw)
        files = body["files"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{manifest}: not a valid manifest") from None
    if body.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest}: manifest format {body.get('format')!r}, this dptrain reads {FORMAT_VERSION}"
        )
    if not isinstance(files, dict):
        raise CheckpointError(f"{manifest}: 'files' is not a mapping")
    return body


def verify_files(ckpt_dir: Path, files: dict[str, dict[str, Any]], *, names: list[str] | None = None) -> None:
    """Check sizes (all first: truncation is found without hashing), then hashes of `names`
    (default: every listed file). Raises CheckpointError naming the file and both values."""
    present = set(data_files(ckpt_dir))
    missing = sorted(set(files) - present)
    if missing:
        raise CheckpointError(
            f"{ckpt_dir / missing[0]}: missing (listed in {MANIFEST} with SHA-256 {files[missing[0]]['sha256']})"
        )
    extra = sorted(present - set(files))
    if extra:
        raise CheckpointError(f"{ckpt_dir / extra[0]}: file not listed in {MANIFEST}")
    for rel, entry in files.items():
        size = (ckpt_dir / rel).stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"{ckpt_dir / rel}: size {size} bytes, expected {entry['size']} (truncated or overwritten); "
                f"expected SHA-256 {entry['sha256']}, actual {sha256_file(ckpt_dir / rel)}"
            )
    for rel in sorted(files) if names is None else names:
        actual = sha256_file(ckpt_dir / rel)
        if actual != files[rel]["sha256"]:
            raise CheckpointError(
                f"{ckpt_dir / rel}: SHA-256 mismatch: expected {files[rel]['sha256']}, actual {actual}"
            )


def verify(ckpt_dir: Path) -> dict[str, Any]:
    """Full check of a committed checkpoint; returns the manifest's `meta`. Raises CheckpointError."""
    body = read_manifest(ckpt_dir)
    verify_files(ckpt_dir, body["files"])
    return body["meta"]


def inspect_dir(ckpt_dir: Path, *, check_hashes: bool = True) -> CheckpointInfo:
    """Classify one step folder without raising."""
    step = step_of(ckpt_dir)
    step = -1 if step is None else step
    if not (ckpt_dir / MARKER).is_file():
        return CheckpointInfo(ckpt_dir, step, "uncommitted", f"no {MARKER} marker (the save did not finish)")
    try:
        body = read_manifest(ckpt_dir)
        if check_hashes:
            verify_files(ckpt_dir, body["files"])
    except CheckpointError as e:
        return CheckpointInfo(ckpt_dir, step, "corrupt", str(e))
    return CheckpointInfo(ckpt_dir, step, "committed", "", body["meta"])


def step_dirs(root: Path) -> list[Path]:
    """The `step_NNNNNN` folders under `root`, oldest first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(dirs, key=lambda p: step_of(p) or 0)


def list_checkpoints(root: Path, *, check_hashes: bool = True) -> list[CheckpointInfo]:
    """Every step folder under `root` with its state, oldest first."""
    return [inspect_dir(p, check_hashes=check_hashes) for p in step_dirs(root)]


def prune(root: Path, *, keep_last: int | None) -> list[Path]:
    """Delete committed checkpoints older than the newest `keep_last` committed ones (only those:
    an uncommitted folder may be in the middle of being written). Returns the deleted folders."""
    import shutil

    if keep_last is None:
        return []
    committed = [p for p in step_dirs(root) if (p / MARKER).is_file()]
    doomed = committed[: max(0, len(committed) - keep_last)]
    for p in doomed:
        uncommit(p)  # a crash half-way through rmtree leaves an uncommitted folder, not a corrupt committed one
        shutil.rmtree(p)
    return doomed


def checkpoint_root(cfg: Any, run_dir: Path) -> Path:
    """`checkpoint.dir` (a CheckpointConfig's), or `checkpoints/` inside the run directory."""
    return Path(cfg.dir) if cfg.dir else run_dir / "checkpoints"
