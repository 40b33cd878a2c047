"""Tokenizers for `dptrain data prepare`, all local: nothing is downloaded.

A tokenizer is named by a spec string:

- ``bytes``: the built-in byte tokenizer (UTF-8 bytes, vocabulary 256, end of document = 0: the
  stdlib corpus's own encoding, see :mod:`dptrain.data.corpus`);
- a ``tokenizer.json`` file (Hugging Face ``tokenizers``);
- a directory holding what ``transformers.AutoTokenizer.from_pretrained`` reads, opened with
  ``local_files_only=True``.

Every tokenizer says its identity (kind, SHA-256 of its files, vocabulary size, end-of-document id),
which the manifest of a prepared corpus records and training compares against.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptrain.config import ConfigError

from .corpus import EOD_TOKEN, VOCAB_SIZE

__all__ = ["BYTES", "EOS_CANDIDATES", "LocalTokenizer", "TokenizerIdentity", "load_tokenizer"]

BYTES = "bytes"
"""The spec of the built-in byte tokenizer."""
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]", "<|im_end|>")
"""Special tokens taken as the end-of-document token of a ``tokenizer.json``, in this order, when none is named."""
# Files a from_pretrained directory may hold that are not the tokenizer (never hashed: weights can be huge).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".gguf", ".onnx")


@dataclass(frozen=True)
class TokenizerIdentity:
    """What makes two tokenizations the same: kind, hash of the files, vocabulary size, end-of-document id."""

    kind: str
    sha256: str
    vocab_size: int
    eos_id: int
    spec: str

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "spec": self.spec}

    def same_tokens(self, other: dict[str, Any]) -> bool:
        """Whether `other` (a manifest's `tokenizer`) produces the same token ids (the spec may differ)."""
        return all(other.get(k) == v for k, v in self.as_dict().items() if k != "spec")


def _sha256_files(paths: list[Path], root: Path | None = None) -> str:
    h = hashlib.sha256()
    for p in paths:
        name = p.relative_to(root).as_posix() if root is not None else p.name
        h.update(f"{name}\0".encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


class LocalTokenizer:
    """One of the three kinds, with ``encode_batch(texts) -> list[list[int]]`` (no special tokens added)."""

    def __init__(self, spec: str, *, eos_token: str | None = None) -> None:
        self.spec = str(spec)
        self.eos_token = eos_token
        self._hf: Any = None
        self._tok: Any = None
        if self.spec == BYTES:
            if eos_token is not None:
                raise ConfigError("--eos-token does not apply to the bytes tokenizer (its end of document is byte 0)")
            self.kind = BYTES
            self.vocab_size, self.eos_id = VOCAB_SIZE, EOD_TOKEN
            self.sha256 = hashlib.sha256(b"dptrain-bytes-utf8-v1").hexdigest()
            return
        path = Path(spec).expanduser()
        if path.is_file():
            self._load_tokenizer_json(path)
        elif path.is_dir():
            self._load_pretrained_dir(path)
        else:
            raise ConfigError(
                f"--tokenizer {spec!r}: no such file or directory; give 'bytes', a tokenizer.json file, or a local "
                "directory that transformers' from_pretrained reads (nothing is downloaded)"
            )

    def _load_tokenizer_json(self, path: Path) -> None:
        # lazy: tokenizers comes with the optional hf extra (transformers depends on it)
        try:
            import tokenizers
        except ImportError:
            raise ConfigError(
                f"--tokenizer {str(path)!r} is a tokenizer.json file, read with the tokenizers package: install the "
                "hf extra (pip install 'dptrain[hf]')"
            ) from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a plain Exception on a bad file
            raise ConfigError(f"--tokenizer {str(path)!r} is not a tokenizers JSON file: {e}") from None
        self.kind = "tokenizers"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        names = [self.eos_token] if self.eos_token is not None else list(EOS_CANDIDATES)
        ids = [(n, self._tok.token_to_id(n)) for n in names]
        found = [(n, i) for n, i in ids if i is not None]
        if not found:
            raise ConfigError(
                f"--tokenizer {str(path)!r} has no end-of-document token "
                + (f"{self.eos_token!r}" if self.eos_token is not None else f"(looked for {', '.join(EOS_CANDIDATES)})")
                + "; name one of its tokens with --eos-token"
            )
        self.eos_id = int(found[0][1])
        self.sha256 = _sha256_files([path])

    def _load_pretrained_dir(self, path: Path) -> None:
        # lazy: transformers is an optional extra (hf)
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError(
                f"--tokenizer {str(path)!r} is a directory, read with transformers' AutoTokenizer: install the hf "
                "extra (pip install 'dptrain[hf]'), or pass its tokenizer.json file"
            ) from None
        try:
            self._hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers raises OSError/ValueError/... for a directory it cannot read
            raise ConfigError(f"--tokenizer {str(path)!r}: transformers cannot load a tokenizer from it: {e}") from None
        self.kind = "transformers"
        self.vocab_size = len(self._hf)
        eos_id = self._hf.convert_tokens_to_ids(self.eos_token) if self.eos_token else self._hf.eos_token_id
        if eos_id is None or (self.eos_token and eos_id == self._hf.unk_token_id):
            raise ConfigError(
                f"--tokenizer {str(path)!r} has no end-of-document token"
                + (f" {self.eos_token!r}" if self.eos_token else " (its eos_token is unset)")
                + "; name one of its tokens with --eos-token"
            )
        self.eos_id = int(eos_id)
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES)
                       and ".cache" not in p.relative_to(path).parts)
        self.sha256 = _sha256_files(files, root=path)

    def identity(self) -> TokenizerIdentity:
        return TokenizerIdentity(self.kind, self.sha256, int(self.vocab_size), int(self.eos_id), self.spec)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (the end of document is appended by the caller)."""
        if self.kind == BYTES:
            return [list(t.encode("utf-8")) for t in texts]
        if self._tok is not None:
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        return [list(ids) for ids in self._hf(texts, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        if self.kind == BYTES:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        if self._tok is not None:
            return self._tok.decode(ids)
        return str(self._hf.decode(ids))


def load_tokenizer(spec: str, *, eos_token: str | None = None) -> LocalTokenizer:
    """The tokenizer named by `spec` (see the module's docstring); ConfigError when it cannot be read."""
    return LocalTokenizer(spec, eos_token=eos_token)


def quiet_tokenizers_threads() -> None:
    """In a worker process of a pool: one thread per process (the pool is the parallelism)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
