"""Built-in corpus: the Python standard library's own source, as byte-level tokens.

Every machine with Python has it, so examples and tests can train a real language model
without downloading anything.  Tokens are raw bytes (vocabulary of 256); files are
concatenated in sorted order, each followed by a NUL byte (token 0) as an end-of-document
marker -- NUL never occurs in Python source, so it is unambiguous.

The split into train/val is per *file*, decided by a stable hash of the relative path, so
the same file always lands in the same split on every machine and every run, and no file
contributes to both.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "EOD_TOKEN",
    "VOCAB_SIZE",
    "TokenChunks",
    "build_stdlib_lm",
    "default_cache_root",
    "list_stdlib_sources",
    "prepare_stdlib_corpus",
]

#: Number of distinct token ids (one per byte value).
VOCAB_SIZE = 256
#: Token appended after each file (a NUL byte, which never appears in Python source).
EOD_TOKEN = 0

# Directory names never descended into: installed third-party code, the stdlib's own
# (huge, repetitive) test suites, and bytecode caches.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_META = "meta.json"
_FORMAT_VERSION = 1


def default_cache_root() -> Path:
    """Root under which corpus directories are created when no ``cache_dir`` is given.

    ``$DPTRAIN_CACHE/corpus`` if the variable is set, else ``~/.cache/dptrain/corpus``.
    """
    env = os.environ.get("DPTRAIN_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "dptrain"
    return base / "corpus"


def list_stdlib_sources(stdlib: str | Path | None = None) -> list[tuple[str, int]]:
    """Return sorted ``(relative posix path, size in bytes)`` of the stdlib's ``*.py`` files.

    ``stdlib`` defaults to the running interpreter's ``sysconfig.get_paths()['stdlib']``.
    """
    root = Path(stdlib) if stdlib is not None else Path(sysconfig.get_paths()["stdlib"])
    out: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into excluded trees.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = Path(dirpath) / name
            try:
                if not full.is_file():
                    continue
                size = full.stat().st_size
            except OSError:
                continue  # broken symlink or unreadable entry: not part of the corpus
            out.append((full.relative_to(root).as_posix(), size))
    # Sort by the posix string so the order does not depend on the filesystem's listing order.
    out.sort()
    return out


def _is_val(rel_path: str, val_fraction: float) -> bool:
    # sha1 rather than hash(): Python's str hash is salted per process.
    h = int.from_bytes(hashlib.sha1(rel_path.encode("utf-8")).digest()[:8], "big")
    return h / 2.0**64 < val_fraction


def _source_hash(files: list[tuple[str, int]], val_fraction: float) -> str:
    h = hashlib.sha1()
    h.update(f"v{_FORMAT_VERSION};val_fraction={val_fraction!r};".encode())
    for rel, size in files:
        h.update(f"{rel}\0{size}\n".encode())
    return h.hexdigest()


def _atomic_write_bytes(dest: Path, chunks: list[bytes]) -> None:
    # Temp file in the same directory so os.replace is an atomic rename on one filesystem:
    # concurrent readers see either no file or a complete one, never a partial write.
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read_meta(d: Path) -> dict | None:
    try:
        meta = json.loads((d / _META).read_text())
    except (OSError, ValueError):
        return None
    # meta.json is written last, but double-check the token files match what it promises
    # (a cheap stat) so a cache damaged after the fact is rebuilt rather than trusted.
    try:
        for split in ("train", "val"):
            if (d / f"{split}.bin").stat().st_size != meta["n_tokens"][split]:
                return None
    except (OSError, KeyError, TypeError):
        return None
    return meta


def prepare_stdlib_corpus(*, cache_dir: str | None = None, val_fraction: float = 0.05) -> Path:
    """Build (or find cached) the stdlib corpus and return its directory.

    The directory is ``<root>/stdlib-<pyver>-<hash>`` where ``<root>`` is ``cache_dir`` or
    :func:`default_cache_root`, and ``<hash>`` covers the file list, file sizes and
    ``val_fraction`` (so a different interpreter or split never reuses a stale cache).
    It contains ``train.bin`` / ``val.bin`` (raw uint8 tokens) and ``meta.json``.

    Safe to call from several processes at once: each writes complete temp files and
    atomically renames them into place; ``meta.json`` is written last and its presence
    means the corpus is complete.  Idempotent and cheap (one directory walk) when cached.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = list_stdlib_sources(stdlib)
    if not files:
        raise RuntimeError(f"no *.py files found under the standard library at {stdlib}")
    src_hash = _source_hash(files, val_fraction)
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    out = root / f"stdlib-{pyver}-{src_hash[:12]}"

    if _read_meta(out) is not None:
        return out
    out.mkdir(parents=True, exist_ok=True)

    splits: dict[str, list[str]] = {"train": [], "val": []}
    for rel, _ in files:
        splits["val" if _is_val(rel, val_fraction) else "train"].append(rel)
    if val_fraction > 0 and not splits["val"]:
        # Tiny stdlib or tiny fraction: guarantee a non-empty val split deterministically
        # by moving the file whose hash is smallest.
        first = min(splits["train"], key=lambda r: hashlib.sha1(r.encode("utf-8")).digest())
        splits["train"].remove(first)
        splits["val"].append(first)

    eod = bytes([EOD_TOKEN])
    n_tokens: dict[str, int] = {}
    content_sha1: dict[str, str] = {}
    for split, rels in splits.items():
        chunks: list[bytes] = []
        h = hashlib.sha1()
        for rel in rels:
            data = (stdlib / rel).read_bytes()
            chunks.append(data)
            chunks.append(eod)
            h.update(data)
            h.update(eod)
        _atomic_write_bytes(out / f"{split}.bin", chunks)
        n_tokens[split] = sum(len(c) for c in chunks)
        content_sha1[split] = h.hexdigest()

    meta = {
        "format_version": _FORMAT_VERSION,
        "python_version": sys.version.split()[0],
        "stdlib": str(stdlib),
        "source_hash": src_hash,
        "val_fraction": val_fraction,
        "vocab_size": VOCAB_SIZE,
        "eod_token": EOD_TOKEN,
        "dtype": "uint8",
        "n_files": {k: len(v) for k, v in splits.items()},
        "n_tokens": n_tokens,
        "content_sha1": content_sha1,
        "val_files": splits["val"],
    }
    _atomic_write_bytes(out / _META, [json.dumps(meta, indent=1).encode("utf-8")])
    return out


class TokenChunks(Dataset):
    """Non-overlapping ``seq_len + 1`` token windows over a raw uint8 token file.

    Item ``i`` is an int64 tensor ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` (inputs are
    ``item[:-1]``, targets ``item[1:]``), so consecutive items tile the stream; the last
    partial chunk is dropped.  The file is memory-mapped lazily on first access, so the
    dataset pickles cheaply to DataLoader worker processes (each maps it itself).
    """

    vocab_size = VOCAB_SIZE
    """Token ids are bytes: a model's vocabulary must hold at least these many (launch/checks.py)."""

    def __init__(self, path: str | Path, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.path = Path(path)
        self.seq_len = int(seq_len)
        self.n_tokens = os.path.getsize(self.path)
        self._data: np.memmap | None = None

    def __len__(self) -> int:
        return max(0, (self.n_tokens - 1) // self.seq_len)

    def _tokens(self) -> np.ndarray:
        if self._data is None:
            if self.n_tokens == 0:
                # np.memmap refuses empty files.
                self._data = np.zeros(0, dtype=np.uint8)  # type: ignore[assignment]
            else:
                self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._data  # type: ignore[return-value]

    def __getitem__(self, i: int) -> torch.Tensor:
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {n} chunks")
        start = i * self.seq_len
        window = self._tokens()[start : start + self.seq_len + 1]
        # np.array copies out of the map (writable, owned memory) before widening to int64.
        return torch.from_numpy(np.array(window, dtype=np.int64))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_data"] = None  # never ship the mapping itself; reopen in the receiver
        return state

    def __repr__(self) -> str:
        return f"TokenChunks({str(self.path)!r}, seq_len={self.seq_len}, n_chunks={len(self)})"


def build_stdlib_lm(
    *, seq_len: int = 128, val_fraction: float = 0.05, cache_dir: str | None = None
) -> tuple[Dataset, Dataset]:
    """Default data factory: ``(train, val)`` :class:`TokenChunks` over the stdlib corpus."""
    d = prepare_stdlib_corpus(cache_dir=cache_dir, val_fraction=val_fraction)
    return TokenChunks(d / "train.bin", seq_len), TokenChunks(d / "val.bin", seq_len)
