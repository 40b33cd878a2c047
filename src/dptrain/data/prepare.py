"""`dptrain data prepare`: documents -> sharded, memory-mappable token files and a manifest.

The output directory::

    plan.json              the tokenizer's identity, the inputs and their pieces (written first)
    shard_00000.bin        token ids (uint16, or uint32 for vocabularies over 65,536), each document
                           followed by the tokenizer's end-of-document id
    shard_00000.idx        int64 document boundaries: n_docs + 1 offsets into the shard's tokens
    shard_00000.json       the shard's counts and the SHA-256 of both files (written after them)
    manifest.json          counts, per-shard hashes, the tokenizer's identity (written last: the corpus is complete)

One shard per piece of the inputs (:mod:`dptrain.data.sources`), tokenised by a pool of worker
processes. Run again on the same output after an interruption, it keeps every shard whose
``.json`` matches its piece and whose files still hash to what it says, and redoes the rest.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dptrain.config import ConfigError

from .sources import Piece, plan_pieces, read_piece
from .tokenizers import LocalTokenizer, load_tokenizer, quiet_tokenizers_threads

__all__ = ["FORMAT", "MANIFEST", "PrepareStats", "prepare", "sha256_file", "token_dtype"]

FORMAT = "dptrain-tokens"
VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
_ENCODE_BATCH = 512  # documents per encode_batch call


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class PrepareStats:
    """What a prepare did: tokens and documents in the corpus, shards tokenised now and kept, seconds, and the
    processes that tokenised (1: this one)."""

    out: Path
    n_tokens: int
    n_docs: int
    n_shards: int
    done_now: int
    kept: int
    tokens_now: int
    seconds: float
    workers: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_now / self.seconds if self.seconds > 0 else 0.0


# One tokenizer per worker process, loaded on its first piece.
_TOKENIZER: dict[tuple[str, str | None], LocalTokenizer] = {}


def _tokenizer(spec: str, eos_token: str | None) -> LocalTokenizer:
    key = (spec, eos_token)
    if key not in _TOKENIZER:
        _TOKENIZER[key] = load_tokenizer(spec, eos_token=eos_token)
    return _TOKENIZER[key]


def _shard_ok(out: Path, name: str, piece: dict[str, Any]) -> dict[str, Any] | None:
    """The shard's record if it was finished for this piece and its files still hash to it."""
    try:
        rec = json.loads((out / f"{name}.json").read_text())
        if rec.get("piece") != piece:
            return None
        if sha256_file(out / rec["bin"]) != rec["sha256"] or sha256_file(out / rec["idx"]) != rec["idx_sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rec


def _tokenize_piece(job: tuple[int, dict[str, Any], str, str | None, str, str]) -> tuple[int, dict[str, Any], bool]:
    """Worker: shard `index` from its piece (or the finished shard as it is). -> (index, record, tokenised now)."""
    index, piece_d, spec, eos_token, out_s, dtype = job
    out, name = Path(out_s), f"shard_{index:05d}"
    kept = _shard_ok(out, name, piece_d)
    if kept is not None:
        return index, kept, False
    tok = _tokenizer(spec, eos_token)
    piece = Piece(**{**piece_d, "files": tuple(piece_d["files"])})
    docs = read_piece(piece)
    bin_path, idx_path = out / f"{name}.bin", out / f"{name}.idx"
    tmp = bin_path.with_name(bin_path.name + ".tmp")
    offsets = [0]
    h = hashlib.sha256()
    eos = np.array([tok.eos_id], dtype=dtype)
    with open(tmp, "wb") as f:
        for a in range(0, len(docs), _ENCODE_BATCH):
            for ids in tok.encode_batch(docs[a : a + _ENCODE_BATCH]):
                arr = np.concatenate([np.asarray(ids, dtype=dtype), eos]).tobytes()
                f.write(arr)
                h.update(arr)
                offsets.append(offsets[-1] + len(ids) + 1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, bin_path)
    idx_bytes = np.asarray(offsets, dtype=np.int64).tobytes()
    idx_tmp = idx_path.with_name(idx_path.name + ".tmp")
    idx_tmp.write_bytes(idx_bytes)
    os.replace(idx_tmp, idx_path)
    rec = {"bin": bin_path.name, "idx": idx_path.name, "n_tokens": offsets[-1], "n_docs": len(docs),
           "sha256": h.hexdigest(), "idx_sha256": hashlib.sha256(idx_bytes).hexdigest(), "piece": piece_d}
    _write_json(out / f"{name}.json", rec)
    return index, rec, True


def _worker_init() -> None:
    quiet_tokenizers_threads()


def _check_plan(out: Path, plan: dict[str, Any]) -> None:
    """An output directory holding another prepare (other tokenizer or inputs) with finished shards is refused,
    never mixed."""
    try:
        old = json.loads((out / PLAN).read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        old = None
    if old == plan or not any(out.glob("shard_*.json")):
        return  # the same prepare, or one that finished no shard (e.g. stopped by a wrong --text-key): nothing to mix
    what = "a damaged plan.json"
    if isinstance(old, dict):
        diff = [k for k in plan if old.get(k) != plan[k]]
        what = f"another prepare (differs in: {', '.join(diff)})"
    raise ConfigError(f"--out {str(out)!r} holds {what}; give another --out, or delete it to start over")


def prepare(
    sources: list[str],
    *,
    tokenizer: str,
    out: str | Path,
    workers: int | None = None,
    text_key: str = "text",
    split: str = "train",
    shard_docs: int = 20_000,
    eos_token: str | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> PrepareStats:
    """Tokenise `sources` with `tokenizer` into `out` (see the module); resumable. `progress(docs_done,
    docs_total, tokens_done)` is called as shards finish. Returns the counts and the time taken."""
    if workers is None:
        workers = os.cpu_count() or 1
    if workers < 0:
        raise ConfigError(f"--workers must be >= 0, got {workers}")
    tok = load_tokenizer(tokenizer, eos_token=eos_token)
    ident = tok.identity()
    pieces = plan_pieces(sources, shard_docs=shard_docs, text_key=text_key, split=split)
    if not pieces:
        raise ConfigError(f"sources {sources} hold no document")
    dtype = token_dtype(ident.vocab_size)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = {"format": FORMAT, "version": VERSION, "tokenizer": ident.as_dict(), "dtype": dtype,
            "pieces": [p.as_dict() for p in pieces]}
    _check_plan(out, plan)
    _write_json(out / PLAN, plan)
    for stale in out.glob("*.tmp"):
        stale.unlink()
    (out / MANIFEST).unlink(missing_ok=True)  # complete again only when every shard is

    jobs = [(i, p.as_dict(), tokenizer, eos_token, str(out), dtype) for i, p in enumerate(pieces)]
    total_docs = sum(p.n_docs for p in pieces)
    records: list[dict[str, Any] | None] = [None] * len(jobs)
    done_docs = done_tokens = tokens_now = now = 0
    t0 = time.perf_counter()

    def finished(index: int, rec: dict[str, Any], fresh: bool) -> None:
        nonlocal done_docs, done_tokens, tokens_now, now
        records[index] = rec
        done_docs += rec["n_docs"]
        done_tokens += rec["n_tokens"]
        if fresh:
            now += 1
            tokens_now += rec["n_tokens"]
        if progress is not None:
            progress(done_docs, total_docs, done_tokens)

    used = 1 if workers <= 1 or len(jobs) == 1 else min(workers, len(jobs))
    if used == 1:
        for job in jobs:
            finished(*_tokenize_piece(job))
    else:
        # spawn, not fork: a forked worker inherits the locks of whatever threads the caller runs (torch's pools,
        # tokenizers' own) and can hang on one of them
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(used, initializer=_worker_init) as pool:
            for result in pool.imap_unordered(_tokenize_piece, jobs):
                finished(*result)
    seconds = time.perf_counter() - t0

    shards = [{k: r[k] for k in ("bin", "idx", "n_tokens", "n_docs", "sha256", "idx_sha256")}
              for r in records if r is not None]
    manifest = {
        "format": FORMAT, "version": VERSION, "dtype": dtype, "tokenizer": ident.as_dict(),
        "n_tokens": sum(s["n_tokens"] for s in shards), "n_docs": sum(s["n_docs"] for s in shards),
        "shards": shards, "sources": list(sources), "text_key": text_key,
    }
    _write_json(out / MANIFEST, manifest)
    return PrepareStats(out, manifest["n_tokens"], manifest["n_docs"], len(shards), now, len(shards) - now,
                        tokens_now, seconds, used)
