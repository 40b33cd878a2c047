"""Packed LM rows from a prepared corpus (`dptrain.data.packed`): the rows are the corpus's token stream
with labels masked across documents and positions restarting per document; a packed row's logits and loss
equal each document's run alone through the built-in LLaMA; reading stays memory-mapped (memory does
not grow with the corpus); a changed shard, a different tokenizer and a too-small model vocabulary are
refused before training."""

from __future__ import annotations

import json
import os
import pickle
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch.utils.data import default_collate

from dptrain.cli.generate import generate, run_tokenizer
from dptrain.config import ConfigError, validate
from dptrain.config.load import load_config
from dptrain.data.packed import PackedTokens, build_packed
from dptrain.data.prepare import prepare
from dptrain.data.sampler import GlobalBatchSampler
from dptrain.launch.checks import check_vocabulary
from dptrain.models.llama import build_llama
from dptrain.train.trainer import Trainer
from support import overrides
from support.batch_log import ENV, read_steps, row_key
from support.checkpoints import TOY, losses
from support.corpora import documents, prepared, train_bpe, write_jsonl
from support.mp import run_ranks
from support.run_helpers import dptrain


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    return prepared(tmp_path_factory.mktemp("packed"), n_docs=120, shard_docs=40)


def stream(out: Path) -> tuple[np.ndarray, np.ndarray]:
    """The whole token stream and document starts, read from the files without the dataset."""
    m = json.loads((out / "manifest.json").read_text())
    toks, starts, base = [], [], 0
    for s in m["shards"]:
        toks.append(np.fromfile(out / s["bin"], dtype=m["dtype"]).astype(np.int64))
        starts.append(np.fromfile(out / s["idx"], dtype=np.int64)[:-1] + base)
        base += s["n_tokens"]
    return np.concatenate(toks), np.concatenate(starts)


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_rows_are_the_stream_with_labels_masked_across_documents_and_positions_per_document(corpus):
    out, _, docs = corpus
    tokens, starts = stream(out)
    seq = 24
    train, val = build_packed(source=str(out), seq_len=seq, val_fraction=0.1)
    assert val is not None and train.doc_stop == val.doc_start == len(docs) - 12
    assert len(train) == (starts[len(docs) - 12] - 1) // seq
    assert len(val) == (len(tokens) - starts[len(docs) - 12] - 1) // seq
    is_start = np.zeros(len(tokens) + 1, dtype=bool)
    is_start[starts] = True
    for ds, base in ((train, 0), (val, starts[len(docs) - 12])):
        for i in range(len(ds)):
            row = ds[i]
            lo = base + i * seq
            window = tokens[lo : lo + seq + 1]
            np.testing.assert_array_equal(row["input_ids"].numpy(), window[:-1])
            new_doc = is_start[lo + 1 : lo + seq + 1]  # the target starts another document than its input
            np.testing.assert_array_equal(row["labels"].numpy(), np.where(new_doc, -100, window[1:]))
            pos, p = [], 0
            for t in range(seq):
                p = 0 if t == 0 or is_start[lo + t] else p + 1
                pos.append(p)
            np.testing.assert_array_equal(row["position_ids"].numpy(), pos)
    assert train.vocab_size == json.loads((out / "manifest.json").read_text())["tokenizer"]["vocab_size"]


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_a_packed_row_gives_each_document_the_logits_and_loss_it_gets_alone(corpus):
    """The packing-boundary test: a row holding several documents, through the built-in LLaMA with
    position ids, against each document run alone (plain causal attention, positions from 0)."""
    out, _, _ = corpus
    ds = PackedTokens(out, seq_len=96)
    torch.manual_seed(0)
    model = build_llama(vocab_size=ds.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96).eval()
    rows = [ds[i] for i in range(4)]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    with torch.no_grad():
        packed = model.logits(batch["input_ids"], batch["position_ids"])
        plain = model.logits(batch["input_ids"])
        n_docs = 0
        for b in range(len(rows)):
            pos = batch["position_ids"][b]
            cuts = [*torch.nonzero(pos == 0).flatten().tolist(), len(pos)]
            for a, z in zip(cuts[:-1], cuts[1:], strict=True):
                alone = model.logits(batch["input_ids"][b : b + 1, a:z])[0]
                torch.testing.assert_close(packed[b, a:z], alone, rtol=1e-5, atol=1e-5)
                n_docs += 1
        assert n_docs >= len(rows) + 2  # rows really hold several documents
        assert not torch.allclose(packed, plain, atol=1e-3)  # without the mask, documents would see each other
        # the loss: the packed rows' token mean is the mean over every document's own targets
        loss = model(**batch)
        per_doc_sum, count = 0.0, 0
        for b in range(len(rows)):
            valid = batch["labels"][b] != -100
            per_doc_sum += F.cross_entropy(packed[b][valid], batch["labels"][b][valid], reduction="sum")
            count += int(valid.sum())
        torch.testing.assert_close(loss, per_doc_sum / count)


@pytest.mark.fast
@pytest.mark.fast
@pytest.mark.timeout(60)
def test_rows_are_read_a_window_at_a_time_and_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak Python allocations while opening the dataset and reading rows stay the same for a corpus 64x
    larger: nothing loads the token files, and a pickled dataset (what DataLoader workers get) carries
    no tokens."""
    docs = documents(40, seed=3)
    src_small = write_jsonl(tmp_path / "s.jsonl", docs)
    src_big = write_jsonl(tmp_path / "b.jsonl", docs * 64)
    peaks = []
    for name, src in (("small", src_small), ("big", src_big)):
        prepare([str(src)], tokenizer="bytes", out=tmp_path / name, workers=0, shard_docs=256)
        tracemalloc.start()
        ds, _ = build_packed(source=str(tmp_path / name), seq_len=64, verify="size")
        for i in range(0, len(ds), max(1, len(ds) // 20)):
            ds[i]
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert ds._maps and all(isinstance(i, np.memmap) for i in ds._maps.values())  # only boundaries are mapped
        assert len(pickle.dumps(ds)) < 4096
    n_tokens = [json.loads((tmp_path / n / "manifest.json").read_text())["n_tokens"] for n in ("small", "big")]
    assert n_tokens[1] == 64 * n_tokens[0] and n_tokens[1] * 2 > 10 * peaks[1]  # loading the tokens would show
    assert peaks[1] < 1.5 * peaks[0] + 32_768, peaks


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_changed_shards_another_tokenizer_and_a_small_vocabulary_are_refused(tmp_path):
    out, tok, docs = prepared(tmp_path, n_docs=40, shard_docs=20)
    train, _ = build_packed(source=str(out), seq_len=16, tokenizer=str(tok))
    small = build_llama(vocab_size=train.vocab_size - 1, dim=16, n_layers=1, n_heads=2)
    with pytest.raises(ConfigError, match=f"model vocab_size={train.vocab_size - 1} is smaller"):
        check_vocabulary(small, train)
    check_vocabulary(build_llama(vocab_size=train.vocab_size, dim=16, n_layers=1, n_heads=2), train)

    other = train_bpe(tmp_path / "other" / "tokenizer.json", docs[:10], vocab_size=280)
    with pytest.raises(ConfigError, match="is not the tokenizer .* was prepared with"):
        build_packed(source=str(out), seq_len=16, tokenizer=str(other))

    shard = out / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 1  # same size, other content
    shard.write_bytes(bytes(data))
    build_packed(source=str(out), seq_len=16, verify="size")  # sizes alone cannot see it
    with pytest.raises(ConfigError, match="SHA-256 of shard_00001.bin no longer matches the manifest"):
        build_packed(source=str(out), seq_len=16)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ConfigError, match="shard_00001.bin has .* bytes, the manifest says"):
        build_packed(source=str(out), seq_len=16, verify="size")
    (out / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="has no manifest.json; its prepare did not finish"):
        build_packed(source=str(out), seq_len=16)
    again = prepared(tmp_path / "again", n_docs=40, shard_docs=20)[0]
    with pytest.raises(ConfigError, match="val_fraction=0.01 of the 40 documents .* is no document"):
        build_packed(source=str(again), seq_len=16, val_fraction=0.01)
    with pytest.raises(ConfigError, match="val_fraction=0.02: the last 1 document.s. make no row"):
        build_packed(source=str(again), seq_len=512, val_fraction=0.02)


def fit_packed(rank: int, out: Path, source: Path, vocab: int, log: Path, over: list[str]) -> dict:
    os.environ[ENV] = str(log)
    recipe = [
        "model.factory=dptrain.models.llama:build_llama",
        f"model.kwargs={{vocab_size: {vocab}, dim: 16, n_layers: 1, n_heads: 2, max_seq_len: 32}}",
        "data.factory=dptrain.data.packed:build_packed", f"data.kwargs={{source: '{source}', seq_len: 32}}",
        "data.num_workers=2", "train.loss=support.batch_log:recording_loss", "parallel.strategy=ddp",
        "train.global_batch_size=4", "train.micro_batch_size=2", "optim.warmup_steps=0", "optim.schedule=constant",
        "checkpoint.every_steps=2",
    ]
    cfg = load_config(None, overrides(TOY, recipe, over))
    return Trainer(cfg, out_dir=out, resume="auto").fit()


@pytest.mark.timeout(90)
def test_rank_split_interleaved_gives_each_rank_distributed_samplers_share_through_the_trainer(tmp_path, corpus):
    """`data.rank_split=interleaved` reaches `dptrain run`'s sampler: each rank's rows in each step are every 2nd row
    of the global batch from its rank on (DistributedSampler's share; the sampler's own tests hold that equality),
    not its contiguous half (the default)."""
    source = corpus[0]
    vocab = json.loads((source / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    train, _ = build_packed(source=str(source), seq_len=32)
    order = GlobalBatchSampler(dataset_len=len(train), global_batch_size=4, micro_batch_size=4, grad_accum_steps=1,
                               dp_rank=0, dp_world_size=1, seed=load_config(None, []).train.seed)
    for split in ("interleaved", "contiguous"):
        log = tmp_path / split
        log.mkdir()
        run_ranks(fit_packed, 2, tmp_path / f"run-{split}", source, vocab, log,
                  ["train.max_steps=3", "checkpoint.every_steps=0", f"data.rank_split={split}"])
        for rank in range(2):
            got = [json.loads(line) for line in (log / f"rank{rank}.jsonl").read_text().splitlines()]
            share = [order.global_batch_indices(s)[rank::2] for s in range(3)]
            want = [[row_key(train[i]["input_ids"]) for i in rows] for rows in share]
            assert (got == want) == (split == "interleaved"), (split, rank)
    with pytest.raises(ConfigError, match="data.rank_split='strided' is not valid; choose one of: contiguous, interl"):
        validate(load_config(None, ["data.rank_split=strided"]))
    finetune = ["data.rank_split=interleaved", "data.factory=dptrain.data.finetune:build_finetune"]
    with pytest.raises(ConfigError, match="rank_split='interleaved' applies to fixed-size global batches; fine-tun"):
        validate(load_config(None, finetune))


@pytest.mark.timeout(90)
def test_resume_at_world_2_1_2_with_workers_trains_every_step_on_its_global_batch(tmp_path, corpus):
    """Packed rows in the world-size-invariant order through the Trainer: 2 steps at world 2, 2 more at
    world 1 and 2 more at world 2, each resuming from the last checkpoint with 2 DataLoader workers per
    rank: every step trains on exactly the rows of its global batch in the world-1 order (the sampler's
    `global_batch_indices` on the same dataset and seed), the run continues at the right step, and its final weights
    are bit-identical to an uninterrupted 2-rank run's."""
    source, _, _ = corpus
    vocab = json.loads((source / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    steps = []
    for world, until in ((2, 2), (1, 4), (2, 6)):
        log = tmp_path / "log" / f"{until}"
        log.mkdir(parents=True)
        run_ranks(fit_packed, world, tmp_path / "run", source, vocab, log, [f"train.max_steps={until}"])
        steps += read_steps(log, world, accum=2 // world)
    train, _ = build_packed(source=str(source), seq_len=32)
    order = GlobalBatchSampler(dataset_len=len(train), global_batch_size=4, micro_batch_size=4, grad_accum_steps=1,
                               dp_rank=0, dp_world_size=1, seed=load_config(None, []).train.seed)
    want = [sorted(row_key(train[i]["input_ids"]) for i in order.global_batch_indices(s)) for s in range(6)]
    assert steps == want
    assert len({k for s in steps for k in s}) == 24  # distinct rows: the order really moves through the data
    assert [s for s, _ in losses(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    # and the resumed run is the uninterrupted 2-rank one: final weights bit for bit (at world 1 the two
    # micro-batches of 2 rows add up as two ranks' gradients do: a + b either way), and every step's loss; the loss
    # the world-1 steps log is averaged over micro-batches instead of ranks and may differ in its last bit
    ref_log = tmp_path / "log" / "ref"
    ref_log.mkdir()
    run_ranks(fit_packed, 2, tmp_path / "ref", source, vocab, ref_log, ["train.max_steps=6"])
    assert (tmp_path / "run" / "final" / "model.safetensors").read_bytes() == (
        tmp_path / "ref" / "final" / "model.safetensors").read_bytes()
    got, ref = dict(losses(tmp_path / "run")), dict(losses(tmp_path / "ref"))
    assert got.keys() == ref.keys() and all(got[s] == ref[s] for s in (1, 2, 5, 6)), (got, ref)
    for step in (3, 4):
        assert float.fromhex(got[step]) == pytest.approx(float.fromhex(ref[step]), rel=1e-6), step


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_generate_samples_the_prepared_corpus_tokenizer_named_by_the_run(tmp_path, corpus):
    """`dptrain generate` of a run on a prepared corpus: the tokenizer comes from the run's config and the
    corpus's manifest; greedy sampling equals an argmax loop over the model's logits, decoded by the
    tokenizers library itself."""
    source, tok_path, _ = corpus
    (tmp_path / "config.yaml").write_text(
        f"data:\n  factory: dptrain.data.packed:build_packed\n  kwargs: {{source: '{source}'}}\n")
    tok = run_tokenizer(tmp_path)
    assert tok is not None and tok.kind == "tokenizers" and run_tokenizer(tmp_path, spec="bytes").kind == "bytes"
    torch.manual_seed(0)
    model = build_llama(vocab_size=tok.vocab_size + 7, dim=16, n_layers=1, n_heads=2, max_seq_len=16)
    text = generate(model, "the quick", max_new_tokens=12, temperature=0.0, tokenizer=tok)
    ref = Tokenizer.from_file(str(tok_path))
    ids = ref.encode("the quick", add_special_tokens=False).ids
    new = []
    with torch.no_grad():
        for _ in range(12):
            nxt = int(model.logits(torch.tensor([ids + new])[:, -16:])[0, -1, : ref.get_vocab_size()].argmax())
            new.append(nxt)
    assert text == ref.decode(new)
    (tmp_path / "config.yaml").write_text("data:\n  factory: dptrain.data.corpus:build_stdlib_lm\n")
    assert run_tokenizer(tmp_path) is None  # any other run samples bytes


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_the_packed_collate_equals_default_collate_in_one_storage(corpus):
    ds = PackedTokens(corpus[0], seq_len=32)
    rows = [ds[i] for i in (3, 0, 7)]
    batch, ref = ds.collate(rows), default_collate(rows)
    assert batch.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(batch[k], ref[k], rtol=0, atol=0)
    assert len({v.untyped_storage().data_ptr() for v in batch.values()}) == 1


@pytest.mark.timeout(120)
def test_dptrain_run_refuses_a_small_vocabulary_before_any_worker(tmp_path):
    """Through the real command (a changed shard is refused by the same path: build_packed's ConfigError, see
    test_changed_shards_another_tokenizer_and_a_small_vocabulary_are_refused)."""
    out, _, _ = prepared(tmp_path, n_docs=40, shard_docs=20)
    vocab = json.loads((out / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    small = dptrain("run", "data.factory=dptrain.data.packed:build_packed", f"data.kwargs.source={out}",
                    "data.kwargs.seq_len=16", "--nproc-per-node", "2", "--out", str(tmp_path / "run"),
                    f"model.kwargs.vocab_size={vocab - 1}", timeout=100)
    assert small.returncode == 2 and f"model vocab_size={vocab - 1} is smaller" in small.stderr, small.stderr
    assert "Traceback" not in small.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
