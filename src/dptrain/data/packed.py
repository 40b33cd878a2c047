"""Language-model training rows packed from a prepared corpus (`dptrain data prepare`), memory-mapped.

The corpus's documents, each ending in the end-of-document token, form one token stream over the
shards. Row ``i`` is the window ``stream[i*seq_len : i*seq_len + seq_len + 1]``, as in
:class:`~dptrain.data.corpus.TokenChunks`, returned as a mapping:

- ``input_ids``: ``window[:-1]``;
- ``labels``: ``window[1:]``, except ``-100`` where the target belongs to another document than the
  input (the token after a document's end-of-document token), so no row learns across documents;
- ``position_ids``: restarting at 0 where a document starts (and at the row's start), so a model that
  takes them (the built-in LLaMA) attends within each document only (its block-diagonal causal mask
  is derived from them) and sees every document as if it were alone.

The rows are a map-style Dataset: the world-size-invariant order (:class:`GlobalBatchSampler`) and
exact resume work unchanged. Each row reads its window's tokens from the shard file (one positioned
read) and its document boundaries through an ``np.memmap`` of the ``.idx`` file, so nothing loads the
corpus and memory does not grow with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dptrain.config import ConfigError

from .prepare import FORMAT, MANIFEST, sha256_file
from .tokenizers import load_tokenizer

__all__ = ["PackedTokens", "build_packed", "load_manifest", "verify_shards"]

IGNORE_INDEX = -100


def load_manifest(source: str | Path) -> dict[str, Any]:
    """The manifest of a prepared corpus directory; ConfigError naming what is wrong."""
    path = Path(source) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        plan = Path(source) / "plan.json"
        hint = ("its prepare did not finish: run the same dptrain data prepare again to complete it"
                if plan.is_file() else "prepare it with dptrain data prepare SOURCE --tokenizer T --out DIR")
        raise ConfigError(f"data source {str(source)!r} has no {MANIFEST}; {hint}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"data source {str(source)!r}: cannot read {MANIFEST}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a dptrain data prepare manifest (format {FORMAT!r})")
    return manifest


def verify_shards(source: str | Path, manifest: dict[str, Any], *, hashes: bool = True) -> None:
    """Every shard's files have the size (and, with `hashes`, the SHA-256) the manifest says."""
    root = Path(source)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for shard in manifest["shards"]:
        for key, size, digest in (("bin", shard["n_tokens"] * itemsize, "sha256"),
                                  ("idx", (shard["n_docs"] + 1) * 8, "idx_sha256")):
            f = root / shard[key]
            try:
                actual = f.stat().st_size
            except OSError as e:
                raise ConfigError(f"data source {str(root)!r}: shard file {shard[key]} is missing ({e})") from None
            if actual != size:
                raise ConfigError(
                    f"data source {str(root)!r}: {shard[key]} has {actual} bytes, the manifest says {size}; the shards "
                    "changed after dptrain data prepare: prepare again"
                )
            if hashes and sha256_file(f) != shard[digest]:
                raise ConfigError(
                    f"data source {str(root)!r}: the SHA-256 of {shard[key]} no longer matches the manifest (the file "
                    "changed after dptrain data prepare): prepare again"
                )


class PackedTokens(Dataset):
    """Packed ``seq_len`` rows over documents ``[doc_start, doc_stop)`` of a prepared corpus (see the module)."""

    def __init__(self, source: str | Path, seq_len: int, *, doc_start: int = 0, doc_stop: int | None = None,
                 manifest: dict[str, Any] | None = None) -> None:
        if int(seq_len) < 1:
            raise ConfigError(f"data.kwargs.seq_len must be >= 1, got {seq_len}")
        self.source = Path(source)
        self.seq_len = int(seq_len)
        m = manifest if manifest is not None else load_manifest(source)
        self.dtype = np.dtype(m["dtype"])
        self.vocab_size = int(m["tokenizer"]["vocab_size"])
        """A model's vocabulary must hold at least these many ids (launch/checks.py)."""
        self.eos_id = int(m["tokenizer"]["eos_id"])
        self.bytes_per_token = 1 if m["tokenizer"]["kind"] == "bytes" else 0
        """1 for the bytes tokenizer (the run reports bits per byte), else 0 (a token is no fixed number of bytes)."""
        self._files = [(s["bin"], s["idx"]) for s in m["shards"]]
        n_tok = np.array([s["n_tokens"] for s in m["shards"]], dtype=np.int64)
        n_doc = np.array([s["n_docs"] for s in m["shards"]], dtype=np.int64)
        self._tok_base = np.concatenate([[0], np.cumsum(n_tok)])
        self._doc_base = np.concatenate([[0], np.cumsum(n_doc)])
        self._maps: dict[int, np.ndarray] = {}
        n_docs = int(self._doc_base[-1])
        doc_stop = n_docs if doc_stop is None else int(doc_stop)
        if not 0 <= doc_start <= doc_stop <= n_docs:
            raise ValueError(f"document range [{doc_start}, {doc_stop}) is outside the corpus's {n_docs} documents")
        self.doc_start, self.doc_stop = int(doc_start), doc_stop
        self.tok_start, self.tok_stop = self._doc_offset(self.doc_start), self._doc_offset(doc_stop)

    def _bounds(self, s: int) -> np.ndarray:
        """Shard `s`'s document boundaries (n_docs + 1 offsets), memory-mapped."""
        if s not in self._maps:
            self._maps[s] = np.memmap(self.source / self._files[s][1], dtype=np.int64, mode="r")
        return self._maps[s]

    def _tokens(self, s: int, a: int, b: int) -> np.ndarray:
        """Tokens ``[a, b)`` of shard `s`, read from the file (one positioned read): only the row's bytes
        are ever in this process's memory. (A memory map of the tokens would show the OS's cached pages of
        the file in the process's RSS, tens of KiB around every row read, growing with the corpus.)"""
        return np.fromfile(self.source / self._files[s][0], dtype=self.dtype, count=b - a,
                           offset=a * self.dtype.itemsize)

    def _doc_offset(self, d: int) -> int:
        """Position in the token stream where document `d` starts (the stream's end for the last + 1)."""
        if d >= self._doc_base[-1]:
            return int(self._tok_base[-1])
        s = int(np.searchsorted(self._doc_base, d, side="right") - 1)
        return int(self._tok_base[s] + self._bounds(s)[d - self._doc_base[s]])

    def __len__(self) -> int:
        return max(0, (self.tok_stop - self.tok_start - 1) // self.seq_len)

    def window(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``stream[lo:hi]`` (int64) and whether each one starts a document."""
        tokens = np.empty(hi - lo, dtype=np.int64)
        starts = np.zeros(hi - lo, dtype=bool)
        s = int(np.searchsorted(self._tok_base, lo, side="right") - 1)
        while lo < hi:
            base, end = int(self._tok_base[s]), int(self._tok_base[s + 1])
            a, b = lo - base, min(hi, end) - base
            if b > a:
                idx = self._bounds(s)
                at = lo - (hi - len(tokens))  # where this shard's part goes in the window
                tokens[at : at + b - a] = self._tokens(s, a, b)
                offs = idx[np.searchsorted(idx, a, side="left") : np.searchsorted(idx, b, side="left")]
                starts[at + (offs - a)] = True
                lo = base + b
            s += 1
        return tokens, starts

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {n} packed rows")
        lo = self.tok_start + i * self.seq_len
        tokens, starts = self.window(lo, lo + self.seq_len + 1)
        starts[0] = True  # the row's first token starts its first (maybe partial) document
        seg = np.cumsum(starts)
        ar = np.arange(self.seq_len + 1)
        pos = ar - np.maximum.accumulate(np.where(starts, ar, 0))
        labels = np.where(seg[1:] == seg[:-1], tokens[1:], IGNORE_INDEX)
        return {
            "input_ids": torch.from_numpy(tokens[:-1].copy()),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(pos[:-1].copy()),
        }

    @staticmethod
    def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """A batch of rows as views of ONE int64 tensor (what the Trainer uses for this dataset): a DataLoader
        worker then hands the batch over in one shared-memory storage instead of one per key, which
        halves the training process's wait for it. The values equal torch's ``default_collate``."""
        keys = list(rows[0])
        buf = torch.stack([torch.stack([r[k] for k in keys]) for r in rows], dim=1)  # [keys, B, T]
        return {k: buf[i] for i, k in enumerate(keys)}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = {}  # never ship the maps; each DataLoader worker maps the files itself
        return state

    def __repr__(self) -> str:
        return (f"PackedTokens({str(self.source)!r}, seq_len={self.seq_len}, docs=[{self.doc_start}, "
                f"{self.doc_stop}), rows={len(self)})")


def build_packed(
    *, source: str, seq_len: int = 128, val_fraction: float = 0.0, verify: str = "hash", tokenizer: str | None = None
) -> tuple[PackedTokens, PackedTokens | None]:
    """Data factory for a prepared corpus: ``(train, val)`` packed rows (see the module).

    ``val_fraction``: the last fraction of the documents (in the corpus's order) is the validation split
    (0: none). ``verify``: ``hash`` checks every shard's SHA-256 against the manifest, ``size`` only the
    sizes (for corpora too large to hash at every start). ``tokenizer``: the tokenizer the model will be
    used with (same spec as for prepare); refused if its identity differs from the corpus's.
    """
    if verify not in ("hash", "size"):
        raise ConfigError(f"data.kwargs.verify={verify!r}; valid: 'hash' (SHA-256 of every shard) or 'size'")
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ConfigError(f"data.kwargs.val_fraction={val_fraction} is outside [0, 1)")
    manifest = load_manifest(source)
    verify_shards(source, manifest, hashes=verify == "hash")
    if tokenizer is not None:
        ident = load_tokenizer(tokenizer).identity()
        if not ident.same_tokens(manifest["tokenizer"]):
            raise ConfigError(
                f"data.kwargs.tokenizer={tokenizer!r} (vocab {ident.vocab_size}, eos {ident.eos_id}, sha256 "
                f"{ident.sha256[:12]}) is not the tokenizer {source!r} was prepared with "
                f"({manifest['tokenizer']['spec']!r}: vocab {manifest['tokenizer']['vocab_size']}, eos "
                f"{manifest['tokenizer']['eos_id']}, sha256 {manifest['tokenizer']['sha256'][:12]}); prepare again "
                "with this tokenizer"
            )
    n_docs = int(manifest["n_docs"])
    n_val = int(round(n_docs * float(val_fraction)))
    if val_fraction > 0 and n_val == 0:
        raise ConfigError(f"data.kwargs.val_fraction={val_fraction} of the {n_docs} documents of {source!r} is no "
                          "document; raise it or set it to 0 (no validation)")
    train = PackedTokens(source, seq_len, doc_stop=n_docs - n_val, manifest=manifest)
    if len(train) == 0:
        raise ConfigError(f"data source {source!r}: its {train.tok_stop - train.tok_start} training tokens make no "
                          f"row of seq_len={seq_len} + 1 tokens")
    if n_val == 0:
        return train, None
    val = PackedTokens(source, seq_len, doc_start=n_docs - n_val, manifest=manifest)
    if len(val) == 0:
        raise ConfigError(f"data.kwargs.val_fraction={val_fraction}: the last {n_val} document(s) make no row of "
                          f"seq_len={seq_len} + 1 tokens; raise val_fraction or set it to 0")
    return train, val
