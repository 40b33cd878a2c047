"""`dptrain data prepare`: every input kind and tokenizer kind gives the tokenizer's own ids (each document
followed by its end-of-document id), the manifest's counts and hashes are the files', worker processes
write the same shards as one process, an interrupted or damaged prepare resumes keeping only verified
shards, and bad input is refused with a ConfigError."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from dptrain.cli.main import main
from dptrain.config import ConfigError
from dptrain.data.prepare import prepare
from support.corpora import EOS, documents, train_bpe, write_jsonl, write_texts

pytestmark = pytest.mark.fast


def shard_tokens(out: Path) -> tuple[np.ndarray, list[int]]:
    """All token ids of a prepared corpus, read straight from its files, and the document lengths."""
    m = json.loads((out / "manifest.json").read_text())
    tokens = [np.fromfile(out / s["bin"], dtype=m["dtype"]) for s in m["shards"]]
    lengths = [int(n) for s in m["shards"] for n in np.diff(np.fromfile(out / s["idx"], dtype=np.int64))]
    return np.concatenate(tokens).astype(np.int64), lengths


def reference(tok: Tokenizer, docs: list[str]) -> tuple[np.ndarray, list[int]]:
    """What prepare must write, from the tokenizers library itself."""
    eos = tok.token_to_id(EOS)
    ids = [tok.encode(d, add_special_tokens=False).ids + [eos] for d in docs]
    return np.array([i for d in ids for i in d], dtype=np.int64), [len(d) for d in ids]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> tuple[Path, list[str]]:
    docs = documents(90, seed=1)
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json", docs), docs


@pytest.mark.timeout(60)
def test_text_and_jsonl_give_the_tokenizers_own_ids_and_the_manifest_is_the_files(tmp_path, bpe):
    tok_path, docs = bpe
    texts = write_texts(tmp_path / "txt", docs[:7])
    jsonl = write_jsonl(tmp_path / "more.jsonl", docs[7:], key="body")
    out = tmp_path / "out"
    stats = prepare([str(tmp_path / "txt" / "*.txt"), str(jsonl)], tokenizer=str(tok_path), out=out, workers=0,
                    text_key="body", shard_docs=20)
    ref_tokens, ref_lengths = reference(Tokenizer.from_file(str(tok_path)), docs)
    tokens, lengths = shard_tokens(out)
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert lengths == ref_lengths and len(texts) == 7
    m = json.loads((out / "manifest.json").read_text())
    assert (m["n_tokens"], m["n_docs"]) == (len(ref_tokens), len(docs)) == (stats.n_tokens, stats.n_docs)
    assert m["tokenizer"]["sha256"] == hashlib.sha256(b"tokenizer.json\0" + tok_path.read_bytes() + b"\0").hexdigest()
    assert m["tokenizer"]["vocab_size"] == Tokenizer.from_file(str(tok_path)).get_vocab_size()
    assert m["tokenizer"]["eos_id"] == Tokenizer.from_file(str(tok_path)).token_to_id(EOS)
    for s in m["shards"]:
        assert s["sha256"] == hashlib.sha256((out / s["bin"]).read_bytes()).hexdigest()
        assert s["idx_sha256"] == hashlib.sha256((out / s["idx"]).read_bytes()).hexdigest()
    assert len(m["shards"]) == 1 + 5  # the 7 text files in one shard, then 83 lines in shards of 20


@pytest.mark.timeout(60)
def test_parquet_arrow_and_datasets_directory_read_the_same_documents(tmp_path, bpe):
    pa = pytest.importorskip("pyarrow", reason="Parquet/Arrow need the data extra (pyarrow)")
    import pyarrow.ipc
    import pyarrow.parquet

    datasets = pytest.importorskip("datasets", reason="a save_to_disk directory needs the data extra (datasets)")
    tok_path, docs = bpe
    table = pa.table({"text": docs, "n": list(range(len(docs)))})
    pyarrow.parquet.write_table(table, tmp_path / "d.parquet", row_group_size=16)
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pyarrow.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hfds"))
    ref = reference(Tokenizer.from_file(str(tok_path)), docs)
    for name in ("d.parquet", "d.arrow", "hfds"):
        out = tmp_path / f"out-{name}"
        prepare([str(tmp_path / name)], tokenizer=str(tok_path), out=out, workers=0, shard_docs=30)
        tokens, lengths = shard_tokens(out)
        np.testing.assert_array_equal(tokens, ref[0], err_msg=name)
        assert lengths == ref[1], name


@pytest.mark.timeout(60)
def test_transformers_directory_and_bytes_tokenizers(tmp_path, bpe):
    transformers = pytest.importorskip("transformers", reason="a from_pretrained directory needs the hf extra")
    tok_path, docs = bpe
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_path), eos_token=EOS)
    fast.save_pretrained(tmp_path / "hf")
    src = write_jsonl(tmp_path / "d.jsonl", docs)
    prepare([str(src)], tokenizer=str(tmp_path / "hf"), out=tmp_path / "o-hf", workers=0)
    np.testing.assert_array_equal(shard_tokens(tmp_path / "o-hf")[0],
                                  reference(Tokenizer.from_file(str(tok_path)), docs)[0])
    m = json.loads((tmp_path / "o-hf" / "manifest.json").read_text())["tokenizer"]
    assert (m["kind"], m["vocab_size"], m["eos_id"]) == ("transformers", len(fast), fast.eos_token_id)

    prepare([str(src)], tokenizer="bytes", out=tmp_path / "o-bytes", workers=0)
    want = [b for d in docs for b in [*d.encode("utf-8"), 0]]
    np.testing.assert_array_equal(shard_tokens(tmp_path / "o-bytes")[0], np.array(want))


@pytest.mark.timeout(60)
def test_worker_processes_write_the_same_shards_as_one_process(tmp_path, bpe):
    tok_path, docs = bpe
    src = write_jsonl(tmp_path / "d.jsonl", docs)
    one = prepare([str(src)], tokenizer=str(tok_path), out=tmp_path / "one", workers=0, shard_docs=10)
    two = prepare([str(src)], tokenizer=str(tok_path), out=tmp_path / "two", workers=2, shard_docs=10)
    assert two.n_shards == one.n_shards == 9
    manifest = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("one", "two")]
    assert manifest[0]["shards"] == manifest[1]["shards"]  # names, counts and SHA-256 of every shard


@pytest.mark.timeout(60)
def test_an_interrupted_or_damaged_prepare_resumes_keeping_only_verified_shards(tmp_path, bpe):
    tok_path, docs = bpe
    src = write_jsonl(tmp_path / "d.jsonl", docs)
    out = tmp_path / "out"
    first = prepare([str(src)], tokenizer=str(tok_path), out=out, workers=0, shard_docs=10)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # an interruption: no manifest yet, one shard's record not written, one shard's tokens half-written
    (out / "manifest.json").unlink()
    (out / "shard_00003.json").unlink()
    data = (out / "shard_00005.bin").read_bytes()
    (out / "shard_00005.bin").write_bytes(data[: len(data) // 2])
    (out / "shard_00006.bin.tmp").write_bytes(b"partial")
    again = prepare([str(src)], tokenizer=str(tok_path), out=out, workers=0, shard_docs=10)
    assert (again.done_now, again.kept) == (2, first.n_shards - 2)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the same corpus, no leftover


@pytest.mark.timeout(60)
def test_another_tokenizer_into_the_same_output_is_refused_once_it_has_shards(tmp_path, bpe):
    tok_path, docs = bpe
    src = write_jsonl(tmp_path / "d.jsonl", docs)
    prepare([str(src)], tokenizer=str(tok_path), out=tmp_path / "out", workers=0)
    with pytest.raises(ConfigError, match="holds another prepare .differs in: tokenizer"):
        prepare([str(src)], tokenizer="bytes", out=tmp_path / "out", workers=0)
    # a prepare that finished no shard (a wrong --text-key) is no obstacle to the corrected one
    with pytest.raises(ConfigError, match="no 'body' field"):
        prepare([str(src)], tokenizer="bytes", out=tmp_path / "fixed", workers=0, text_key="body")
    assert prepare([str(src)], tokenizer="bytes", out=tmp_path / "fixed", workers=0).n_docs == len(docs)


@pytest.mark.timeout(60)
def test_cli_prepares_with_a_throughput_line_and_refuses_bad_input(tmp_path, bpe, capsys):
    tok_path, docs = bpe
    src = write_jsonl(tmp_path / "d.jsonl", docs)
    rc = main(["data", "prepare", str(src), "--tokenizer", str(tok_path), "--out", str(tmp_path / "o"),
               "--workers", "2", "--shard-docs", "30", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and f"{len(docs)} documents in 3 shards" in out and "tokens/s with 2 worker(s)" in out
    cases = [
        ([str(tmp_path / "nothing*.jsonl")], str(tok_path), "matches no file"),
        ([str(src)], str(tmp_path / "missing.json"), "no such file or directory"),
        ([str(src)], str(src), "is not a tokenizers JSON file"),
        ([str(shutil.copy(src, tmp_path / "d.csv"))], str(tok_path), "unknown suffix '.csv'"),
        ([str(write_jsonl(tmp_path / "k.jsonl", docs, key="body"))], str(tok_path), "no 'text' field"),
    ]
    for sources, tok, message in cases:
        rc = main(["data", "prepare", *sources, "--tokenizer", tok, "--out", str(tmp_path / "bad"), "--workers", "0",
                   "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and "Traceback" not in err, (message, err)
    with pytest.raises(ConfigError, match="has no end-of-document token 'NOPE'"):
        prepare([str(src)], tokenizer=str(tok_path), out=tmp_path / "e", eos_token="NOPE")
