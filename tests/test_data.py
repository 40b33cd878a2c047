"""Tests for dptrain.data: stdlib corpus, TokenChunks, GlobalBatchSampler, loaders."""

from __future__ import annotations

import json
import multiprocessing as mp
import pickle
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from dptrain.data import (
    GlobalBatchSampler,
    TokenChunks,
    build_dataloader,
    build_stdlib_lm,
    prepare_stdlib_corpus,
    split_train_val,
)

# ---------------------------------------------------------------------------------- corpus


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_stdlib_corpus(cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_corpus_builds_with_meta(corpus_dir: Path) -> None:
    meta = json.loads((corpus_dir / "meta.json").read_text())
    for split in ("train", "val"):
        assert (corpus_dir / f"{split}.bin").stat().st_size == meta["n_tokens"][split]
        assert meta["n_files"][split] > 0
    assert meta["n_tokens"]["val"] > 0
    assert meta["n_tokens"]["train"] > 10 * meta["n_tokens"]["val"]
    assert corpus_dir.name.startswith("stdlib-")
    assert not list(corpus_dir.glob("*.tmp")), "temp files left behind"


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_corpus_deterministic(corpus_dir: Path, tmp_path: Path) -> None:
    other = prepare_stdlib_corpus(cache_dir=str(tmp_path))
    assert other != corpus_dir and other.name == corpus_dir.name
    for name in ("train.bin", "val.bin"):
        assert (other / name).read_bytes() == (corpus_dir / name).read_bytes()


@pytest.mark.timeout(120)
def test_corpus_split_disjoint_by_file(corpus_dir: Path) -> None:
    from dptrain.data import list_stdlib_sources

    meta = json.loads((corpus_dir / "meta.json").read_text())
    all_files = [rel for rel, _ in list_stdlib_sources()]
    val = set(meta["val_files"])
    assert val and val <= set(all_files)
    train = [f for f in all_files if f not in val]
    assert len(train) == meta["n_files"]["train"] and len(val) == meta["n_files"]["val"]
    # Exclusions: no test suites or third-party packages in the corpus.
    for rel in all_files:
        parts = rel.split("/")
        assert not {"site-packages", "test", "tests", "idle_test", "__pycache__"} & set(parts[:-1]), rel
    # Each file's bytes land wholly in its own split: a train file's full text is not in val.bin.
    val_bytes = (corpus_dir / "val.bin").read_bytes()
    train_bytes = (corpus_dir / "train.bin").read_bytes()
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel in sorted(val)[:5]:
        data = (stdlib / rel).read_bytes()
        if len(data) > 2000:
            assert data in val_bytes
            assert data not in train_bytes


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_corpus_cached_second_call_fast(corpus_dir: Path) -> None:
    before = (corpus_dir / "train.bin").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = prepare_stdlib_corpus(cache_dir=str(corpus_dir.parent))
    assert time.perf_counter() - t0 < 2.0
    assert again == corpus_dir
    assert (corpus_dir / "train.bin").stat().st_mtime_ns == before  # not rebuilt


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_corpus_rebuilds_damaged_cache(tmp_path: Path) -> None:
    d = prepare_stdlib_corpus(cache_dir=str(tmp_path))
    good = (d / "val.bin").read_bytes()
    (d / "val.bin").write_bytes(good[:100])
    assert prepare_stdlib_corpus(cache_dir=str(tmp_path)) == d
    assert (d / "val.bin").read_bytes() == good


def _prepare_worker(cache: str, q: mp.Queue) -> None:
    try:
        q.put(str(prepare_stdlib_corpus(cache_dir=cache)))
    except BaseException as e:  # report rather than die silently
        q.put(f"ERROR {e!r}")


@pytest.mark.timeout(120)
def test_corpus_concurrent_prepare(corpus_dir: Path, tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_prepare_worker, args=(str(tmp_path), q)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=100) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert results[0] == results[1] and not results[0].startswith("ERROR"), results
    d = Path(results[0])
    meta = json.loads((d / "meta.json").read_text())
    for name in ("train.bin", "val.bin"):
        assert (d / name).read_bytes() == (corpus_dir / name).read_bytes()
    assert meta["n_tokens"]["train"] == (d / "train.bin").stat().st_size
    assert not list(d.glob("*.tmp"))


# ------------------------------------------------------------------------------ TokenChunks


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_token_chunks_items(corpus_dir: Path) -> None:
    seq = 64
    ds = TokenChunks(corpus_dir / "train.bin", seq)
    n_tokens = (corpus_dir / "train.bin").stat().st_size
    assert len(ds) == (n_tokens - 1) // seq
    raw = (corpus_dir / "train.bin").read_bytes()
    for i in (0, 1, 17, len(ds) - 2):
        a, b = ds[i], ds[i + 1]
        assert a.shape == (seq + 1,) and a.dtype == torch.int64
        assert a.min() >= 0 and a.max() < 256
        # Non-overlapping inputs, overlapping by one target token: item i+1 starts where
        # item i's inputs end.
        assert torch.equal(a[-1], b[0])
        assert bytes(a.tolist()) == raw[i * seq : i * seq + seq + 1]
    last = ds[len(ds) - 1]
    assert last.shape == (seq + 1,)
    assert torch.equal(ds[-1], last)
    with pytest.raises(IndexError):
        ds[len(ds)]


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_token_chunks_pickles_lazily(corpus_dir: Path) -> None:
    ds = TokenChunks(corpus_dir / "val.bin", 32)
    assert ds._data is None  # not opened until first access
    first = ds[3]
    assert ds._data is not None
    blob = pickle.dumps(ds)
    assert len(blob) < 2000  # the mapping is not shipped
    clone = pickle.loads(blob)
    assert clone._data is None and len(clone) == len(ds)
    assert torch.equal(clone[3], first)


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_token_chunks_tiny_file(tmp_path: Path) -> None:
    p = tmp_path / "t.bin"
    p.write_bytes(bytes(range(10)))
    ds = TokenChunks(p, 4)
    assert len(ds) == 2  # tokens 0..4 and 4..8; 8,9 partial chunk dropped
    assert ds[1].tolist() == [4, 5, 6, 7, 8]
    assert len(TokenChunks(p, 9)) == 1 and len(TokenChunks(p, 10)) == 0


@pytest.mark.timeout(120)
def test_build_stdlib_lm(corpus_dir: Path) -> None:
    train, val = build_stdlib_lm(seq_len=32, cache_dir=str(corpus_dir.parent))
    assert isinstance(train, TokenChunks) and isinstance(val, TokenChunks)
    assert Path(train.path).parent == corpus_dir
    assert len(train) > len(val) > 0
    assert train[0].shape == (33,)


# ---------------------------------------------------------------------------------- sampler


def _sampler(**kw) -> GlobalBatchSampler:
    base = dict(
        dataset_len=100,
        global_batch_size=12,
        micro_batch_size=12,
        grad_accum_steps=1,
        dp_rank=0,
        dp_world_size=1,
        seed=3,
    )
    base.update(kw)
    return GlobalBatchSampler(**base)


@pytest.mark.fast
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("accum", [1, 2])
def test_sampler_world_size_invariant(world: int, accum: int) -> None:
    g = 24  # divisible by every world * accum combination tested
    ref = _sampler(dataset_len=101, global_batch_size=g, micro_batch_size=g)
    samplers = [
        _sampler(
            dataset_len=101,
            global_batch_size=g,
            micro_batch_size=g // (world * accum),
            grad_accum_steps=accum,
            dp_rank=r,
            dp_world_size=world,
        )
        for r in range(world)
    ]
    for step in range(10):  # crosses epoch boundaries (4 steps per epoch)
        union: list[int] = []
        for s in samplers:
            mbs = s.micro_batches(step)
            assert len(mbs) == accum and all(len(m) == g // (world * accum) for m in mbs)
            union += [i for m in mbs for i in m]
        assert union == ref.global_batch_indices(step)
        assert sorted(union) == sorted(ref.micro_batches(step)[0])


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_sampler_iter_matches_micro_batches() -> None:
    s = _sampler(global_batch_size=12, micro_batch_size=3, grad_accum_steps=2, dp_rank=1, dp_world_size=2)
    it = iter(s)
    for step in range(20):
        assert [next(it) for _ in range(2)] == s.micro_batches(step)


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_sampler_epochs_reshuffle_without_repeats() -> None:
    s = _sampler(dataset_len=100, global_batch_size=10, micro_batch_size=10)
    assert s.steps_per_epoch == 10
    epochs = []
    for e in range(3):
        idx = [i for step in range(e * 10, (e + 1) * 10) for i in s.global_batch_indices(step)]
        assert len(idx) == len(set(idx)) == 100
        epochs.append(idx)
        assert s.epoch_of(e * 10) == e and s.epoch_of(e * 10 + 9) == e
    assert epochs[0] != epochs[1] != epochs[2]
    # Remainder dropped: 105 samples, 10 steps, 5 unseen each epoch (different ones).
    s2 = _sampler(dataset_len=105, global_batch_size=10, micro_batch_size=10)
    seen0 = {i for step in range(10) for i in s2.global_batch_indices(step)}
    seen1 = {i for step in range(10, 20) for i in s2.global_batch_indices(step)}
    assert len(seen0) == len(seen1) == 100 and seen0 != seen1
    # No shuffle: plain order every epoch.
    s3 = _sampler(dataset_len=20, global_batch_size=10, micro_batch_size=10, shuffle=False)
    assert s3.global_batch_indices(0) == list(range(10))
    assert s3.global_batch_indices(3) == list(range(10, 20))


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_sampler_resume_equals_skip() -> None:
    kw = dict(global_batch_size=12, micro_batch_size=2, grad_accum_steps=3, dp_rank=1, dp_world_size=2)
    full = iter(_sampler(**kw))
    for _ in range(7 * 3):
        next(full)
    resumed = iter(_sampler(start_step=7, **kw))
    for _ in range(40):
        assert next(resumed) == next(full)
    s = _sampler(**kw)
    s.set_start_step(7)
    assert next(iter(s)) == _sampler(start_step=7, **kw).micro_batches(7)[0]


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_sampler_state_dict_across_world_sizes() -> None:
    g = 12
    w2 = [_sampler(global_batch_size=g, micro_batch_size=6, dp_rank=r, dp_world_size=2) for r in range(2)]
    its = [iter(s) for s in w2]
    for _ in range(5):  # five global steps at W=2
        for it in its:
            next(it)
    sd = w2[0].state_dict()
    assert sd == {"step": 5, "seed": 3, "dataset_len": 100, "global_batch_size": g}
    assert w2[0].state_dict(step=4)["step"] == 4
    sd = pickle.loads(pickle.dumps(sd))

    ref = _sampler(global_batch_size=g, micro_batch_size=g)
    w1 = _sampler(global_batch_size=g, micro_batch_size=4, grad_accum_steps=3)
    w1.load_state_dict(sd)
    it = iter(w1)
    for step in range(5, 15):
        got = [i for _ in range(3) for i in next(it)]
        assert got == ref.global_batch_indices(step)
    assert w1.state_dict()["step"] == 15

    w3 = [_sampler(global_batch_size=g, micro_batch_size=4, dp_rank=r, dp_world_size=3) for r in range(3)]
    for s in w3:
        s.load_state_dict(sd)
    assert [i for s in w3 for i in next(iter(s))] == ref.global_batch_indices(5)

    other_seed = _sampler(global_batch_size=g, micro_batch_size=g, seed=99)
    with pytest.warns(UserWarning, match="seed"):
        other_seed.load_state_dict(sd)
    assert other_seed.global_batch_indices(5) == ref.global_batch_indices(5)

    with pytest.raises(ValueError, match="dataset_len"):
        _sampler(dataset_len=99, global_batch_size=g, micro_batch_size=g).load_state_dict(sd)
    with pytest.raises(ValueError, match="global_batch_size"):
        _sampler(global_batch_size=6, micro_batch_size=6).load_state_dict(sd)


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_sampler_errors() -> None:
    with pytest.raises(ValueError, match=r"dataset has 10 samples, fewer than one global batch of 16"):
        _sampler(dataset_len=10, global_batch_size=16, micro_batch_size=16)
    with pytest.raises(ValueError, match=r"global_batch_size \(16\).*micro_batch_size \(4\).*= 24"):
        _sampler(global_batch_size=16, micro_batch_size=4, grad_accum_steps=2, dp_world_size=3)
    with pytest.raises(ValueError, match="dp_rank"):
        _sampler(global_batch_size=12, micro_batch_size=6, dp_rank=2, dp_world_size=2)


# ----------------------------------------------------------------------------------- loader


class _IndexDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class _RandDataset(_IndexDataset):
    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(())


@pytest.mark.fast
@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_build_dataloader_yields_sampler_batches(num_workers: int) -> None:
    kw = dict(dataset_len=50, global_batch_size=8, micro_batch_size=2, grad_accum_steps=2, dp_rank=1, dp_world_size=2)
    s, ref = _sampler(start_step=3, **kw), _sampler(**kw)
    dl = build_dataloader(_IndexDataset(50), sampler=s, num_workers=num_workers, pin_memory=True, seed=1)
    assert not dl.pin_memory or torch.cuda.is_available()
    it = iter(dl)
    for step in range(3, 13):
        for mb in ref.micro_batches(step):
            assert next(it).tolist() == mb
    del it


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_build_dataloader_worker_seeding_deterministic() -> None:
    def draw(seed: int) -> list[float]:
        s = _sampler(dataset_len=40, global_batch_size=4, micro_batch_size=4)
        it = iter(build_dataloader(_RandDataset(40), sampler=s, num_workers=2, seed=seed))
        return [x for _ in range(6) for x in next(it).tolist()]

    a, b, c = draw(0), draw(0), draw(1)
    assert a == b and a != c


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_split_train_val() -> None:
    tr, va = _IndexDataset(3), _IndexDataset(2)
    assert split_train_val(tr) == (tr, None)
    assert split_train_val((tr, va)) == (tr, va)
    assert split_train_val([tr, None]) == (tr, None)
    assert split_train_val({"train": tr, "val": va}) == (tr, va)
    assert split_train_val({"train": tr}) == (tr, None)
    with pytest.raises(TypeError, match="int"):
        split_train_val(5)
    with pytest.raises(TypeError, match="length 3"):
        split_train_val((tr, va, va))
    with pytest.raises(TypeError, match="train"):
        split_train_val({"val": va})
    with pytest.raises(TypeError, match="train split"):
        split_train_val((5, va))
