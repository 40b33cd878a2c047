"""Small corpora and tokenizers made on the fly for the data tests (never downloaded): documents of
varied lengths, the same documents as text/JSONL/Parquet/Arrow/datasets inputs, a byte-level BPE trained
with `tokenizers` on them, and a prepared corpus directory."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dptrain.data.prepare import prepare

__all__ = ["EOS", "WORDS", "documents", "prepared", "train_bpe", "write_jsonl", "write_texts"]

EOS = "<|endoftext|>"
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs of liquid gold "
         "under bright stars 0123456789 ; ( ) ünïcödé").split()


def documents(n: int, *, seed: int = 0, max_words: int = 60) -> list[str]:
    """`n` documents of 1..max_words words (deterministic in `seed`)."""
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(1, max_words))) for _ in range(n)]


def train_bpe(path: Path, docs: list[str], *, vocab_size: int = 320) -> Path:
    """A byte-level BPE trained on `docs` with the end-of-document token `EOS`, saved as tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_texts(folder: Path, docs: list[str]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"doc{i:04d}.txt" for i in range(len(docs))]
    for p, d in zip(paths, docs, strict=True):
        p.write_text(d)
    return paths


def prepared(tmp: Path, *, n_docs: int = 120, shard_docs: int = 40, seed: int = 0) -> tuple[Path, Path, list[str]]:
    """(prepared corpus directory, its tokenizer.json, the documents): a BPE over JSONL documents."""
    docs = documents(n_docs, seed=seed)
    tok = train_bpe(tmp / "tok" / "tokenizer.json", docs)
    src = write_jsonl(tmp / "src" / "docs.jsonl", docs)
    out = tmp / "prepared"
    prepare([str(src)], tokenizer=str(tok), out=out, workers=0, shard_docs=shard_docs)
    return out, tok, docs
