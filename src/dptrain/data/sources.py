"""Where `dptrain data prepare` reads documents from, cut into pieces of about `shard_docs` documents.

A source is a file, a directory (walked for the files below) or a glob:

| suffix | one document is |
|---|---|
| ``.txt``, ``.text``, ``.md``, ``.rst`` | the whole file (UTF-8; undecodable bytes replaced) |
| ``.jsonl``, ``.ndjson``, ``.json`` (JSON lines) | the ``text_key`` field of one line's object |
| ``.parquet`` | the ``text_key`` column of one row (pyarrow) |
| ``.arrow`` | the ``text_key`` column of one row of an Arrow IPC file or stream (pyarrow) |

A directory written by ``datasets``' ``save_to_disk`` (it holds ``dataset_info.json``/``state.json``, or
``dataset_dict.json`` for several splits) is read with ``load_from_disk`` (its ``split``, default ``train``).

Planning (:func:`plan_pieces`) only counts: lines with their byte offsets, Parquet row groups, rows. Each
:class:`Piece` then reads its own documents in whatever process runs it (:func:`read_piece`), in the
same order every time, so a piece is also the unit that an interrupted prepare resumes by.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dptrain.config import ConfigError

__all__ = ["SUFFIXES", "Piece", "expand_sources", "plan_pieces", "read_piece"]

SUFFIXES = {
    ".txt": "text", ".text": "text", ".md": "text", ".rst": "text",
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
_DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Piece:
    """Documents ``[start, stop)`` of one input: lines' byte range (jsonl), row range (parquet: row groups,
    arrow, datasets) or a run of whole files (text)."""

    kind: str
    path: str
    start: int = 0
    stop: int = 0
    n_docs: int = 0
    files: tuple[str, ...] = ()
    text_key: str = "text"
    split: str = "train"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["files"] = list(self.files)
        return d


def _is_datasets_dir(p: Path) -> bool:
    return p.is_dir() and any((p / m).is_file() for m in _DATASETS_MARKERS)


def expand_sources(sources: list[str]) -> list[tuple[str, Path]]:
    """(kind, path) of every input, in the order given; directories and globs in sorted order."""
    out: list[tuple[str, Path]] = []
    for src in sources:
        matches = sorted(glob.glob(src, recursive=True)) if glob.has_magic(src) else [src]
        if not matches:
            raise ConfigError(f"source {src!r} matches no file")
        for m in matches:
            p = Path(m)
            if _is_datasets_dir(p):
                out.append(("datasets", p))
            elif p.is_dir():
                found = [f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix.lower() in SUFFIXES
                         and not any(part.startswith(".") for part in f.relative_to(p).parts)]
                if not found:
                    raise ConfigError(
                        f"source directory {str(p)!r} holds no file with a known suffix ({', '.join(sorted(SUFFIXES))})"
                        " and is not a datasets save_to_disk directory"
                    )
                out += [(SUFFIXES[f.suffix.lower()], f) for f in found]
            elif p.is_file():
                kind = SUFFIXES.get(p.suffix.lower())
                if kind is None:
                    raise ConfigError(
                        f"source {str(p)!r}: unknown suffix {p.suffix!r}; known: {', '.join(sorted(SUFFIXES))}, or a "
                        "datasets save_to_disk directory"
                    )
                out.append((kind, p))
            else:
                raise ConfigError(f"source {src!r}: no such file or directory")
    return out


def _pyarrow() -> Any:
    # lazy: pyarrow is an optional extra (data)
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ConfigError("Parquet and Arrow sources need pyarrow: pip install 'dptrain[data]'") from None
    return pyarrow


def _load_datasets_dir(path: str, split: str) -> Any:
    # lazy: datasets is an optional extra (data)
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{path!r} is a datasets save_to_disk directory: reading it needs datasets (pip install 'dptrain[data]')"
        ) from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(
                f"datasets directory {path!r} has no split {split!r} (splits: {sorted(ds)}); pass --split"
            )
        ds = ds[split]
    return ds


def _arrow_table(path: str) -> Any:
    pa = _pyarrow()
    source = pa.memory_map(path, "r")  # zero-copy: the table's buffers point into the map
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()  # what datasets' save_to_disk writes


def _check_column(names: list[str], key: str, where: str) -> None:
    if key not in names:
        raise ConfigError(f"{where} has no column {key!r} (columns: {', '.join(names)}); pass --text-key")


def _ranges(total: int, size: int) -> Iterator[tuple[int, int]]:
    for a in range(0, total, size):
        yield a, min(a + size, total)


def plan_pieces(sources: list[str], *, shard_docs: int, text_key: str = "text", split: str = "train") -> list[Piece]:
    """Every input cut into pieces of about `shard_docs` documents (counting only; see the module)."""
    if shard_docs < 1:
        raise ConfigError(f"--shard-docs must be >= 1, got {shard_docs}")
    pieces: list[Piece] = []
    texts: list[str] = []

    def flush_texts() -> None:
        for a, b in _ranges(len(texts), shard_docs):
            pieces.append(Piece("text", texts[a], n_docs=b - a, files=tuple(texts[a:b])))
        texts.clear()

    for kind, p in expand_sources(sources):
        path = str(p)
        if kind == "text":
            texts.append(path)
            continue
        flush_texts()  # keep the given order of inputs
        if kind == "jsonl":
            pieces += _plan_jsonl(path, shard_docs, text_key)
        elif kind == "parquet":
            pf = _pyarrow().parquet.ParquetFile(path)
            _check_column(pf.schema_arrow.names, text_key, f"Parquet file {path!r}")
            group, rows = 0, 0
            for g in range(pf.num_row_groups):  # pieces of whole row groups (read_row_groups)
                rows += pf.metadata.row_group(g).num_rows
                if rows >= shard_docs or g == pf.num_row_groups - 1:
                    pieces.append(Piece("parquet", path, group, g + 1, rows, text_key=text_key))
                    group, rows = g + 1, 0
        elif kind == "arrow":
            table = _arrow_table(path)
            _check_column(table.column_names, text_key, f"Arrow file {path!r}")
            pieces += [Piece("arrow", path, a, b, b - a, text_key=text_key)
                       for a, b in _ranges(table.num_rows, shard_docs)]
        else:
            ds = _load_datasets_dir(path, split)
            _check_column(list(ds.column_names), text_key, f"datasets directory {path!r}")
            pieces += [Piece("datasets", path, a, b, b - a, text_key=text_key, split=split)
                       for a, b in _ranges(len(ds), shard_docs)]
    flush_texts()
    return [p for p in pieces if p.n_docs > 0]


def _plan_jsonl(path: str, shard_docs: int, text_key: str) -> list[Piece]:
    pieces, start, n, pos = [], 0, 0, 0
    with open(path, "rb") as f:
        for line in f:
            end = pos + len(line)
            if line.strip():
                n += 1
                if n == shard_docs:
                    pieces.append(Piece("jsonl", path, start, end, n, text_key=text_key))
                    start, n = end, 0
            pos = end
    if n:
        pieces.append(Piece("jsonl", path, start, pos, n, text_key=text_key))
    return pieces


def _jsonl_text(line: bytes, key: str, where: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ConfigError(f"{where}: not a JSON line ({e})") from None
    if not isinstance(record, dict) or key not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"{where}: no {key!r} field (has: {keys}); pass --text-key")
    text = record[key]
    if not isinstance(text, str):
        raise ConfigError(f"{where}: field {key!r} is a {type(text).__name__}, not a string")
    return text


def read_piece(piece: Piece) -> list[str]:
    """The piece's documents, in order."""
    if piece.kind == "text":
        return [Path(f).read_bytes().decode("utf-8", errors="replace") for f in piece.files]
    if piece.kind == "jsonl":
        with open(piece.path, "rb") as f:
            f.seek(piece.start)
            data = f.read(piece.stop - piece.start)
        offset = piece.start
        docs = []
        for line in data.splitlines(keepends=True):
            if line.strip():
                docs.append(_jsonl_text(line, piece.text_key, f"{piece.path} (byte {offset})"))
            offset += len(line)
        return docs
    if piece.kind == "parquet":
        pf = _pyarrow().parquet.ParquetFile(piece.path)
        table = pf.read_row_groups(list(range(piece.start, piece.stop)), columns=[piece.text_key])
        column = table.column(piece.text_key)
    elif piece.kind == "arrow":
        column = _arrow_table(piece.path).column(piece.text_key).slice(piece.start, piece.stop - piece.start)
    elif piece.kind == "datasets":
        ds = _load_datasets_dir(piece.path, piece.split)
        column = ds.with_format("arrow")[piece.start : piece.stop].column(piece.text_key)  # memory-mapped rows
    else:
        raise ValueError(f"unknown piece kind {piece.kind!r}")
    texts = column.to_pylist()
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise ConfigError(f"{piece.path}: row {bad} of column {piece.text_key!r} is {texts[bad]!r}, not a string")
    return texts
