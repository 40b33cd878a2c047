"""Fine-tuning and classification rows with dynamic padding and length-grouped batches under a token budget
(`dptrain.data.finetune`, `dptrain.data.token_batches`): the budget holds, the global batches do not depend on
the world size (only their split does, balanced by padded tokens), every epoch is reshuffled from the seed,
the position resumes at another world size; labels score only the responses; `data.source` picks the factory;
and the token rule gives the same step at 2 ranks as in one process."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from dptrain.config import ConfigError
from dptrain.config.datasource import FINETUNE_FACTORY, PACKED_FACTORY
from dptrain.config.load import load_config
from dptrain.data.finetune import build_finetune, classification_loss, pad_collate
from dptrain.data.token_batches import TokenBudgetSampler, balanced_split, plan_epoch
from dptrain.data.tokenizers import load_tokenizer
from dptrain.models.llama import build_llama
from support.batch_log import read_steps, row_key
from support.checkpoints import losses
from support.corpora import prepared
from support.finetune import fit_finetune, write_classify, write_sft
from support.mp import run_ranks
from support.run_helpers import dptrain


def long_tail(n: int, seed: int = 0) -> np.ndarray:
    r = np.random.default_rng(seed)
    return np.minimum(1 + (r.pareto(1.2, n) * 20).astype(np.int64), 400)


def sampler(lengths, **kw) -> TokenBudgetSampler:
    base = {"max_tokens": 2000, "min_rows": 4, "sort_window": 64, "seed": 3}
    return TokenBudgetSampler(lengths, **{**base, **kw})


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_batches_respect_the_budget_cover_the_epoch_and_are_length_grouped():
    lengths = long_tail(1000)
    batches = plan_epoch(lengths, max_tokens=2000, min_rows=4, sort_window=64, seed=3, epoch=0)
    rows = np.concatenate(batches)
    assert len(set(rows.tolist())) == len(rows)  # no row twice
    assert len(rows) > len(lengths) - 4  # only a last batch under min_rows is dropped
    for b in batches:
        assert len(b) >= 4 and lengths[b].max() * len(b) <= 2000
        assert list(lengths[b]) == sorted(lengths[b], reverse=True)
    # grouping by length wastes far less than the same batch sizes drawn in random order
    pad = sum(int(lengths[b].max()) * len(b) - int(lengths[b].sum()) for b in batches)
    perm, at, rand_pad = np.random.default_rng(0).permutation(len(lengths)), 0, 0
    for b in batches:
        chunk = lengths[perm[at : at + len(b)]]
        rand_pad += int(chunk.max()) * len(chunk) - int(chunk.sum())
        at += len(b)
    assert pad < 0.5 * rand_pad


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_the_split_is_the_best_contiguous_one_by_exhaustive_search():
    r = np.random.default_rng(1)
    for _ in range(200):
        n, parts = int(r.integers(1, 9)), int(r.integers(1, 5))
        if parts > n:
            continue
        lens = sorted(r.integers(1, 50, n).tolist(), reverse=True)
        cuts = balanced_split(lens, parts)
        assert cuts[0] == 0 and cuts[-1] == n and len(cuts) == parts + 1
        assert all(a < b for a, b in itertools.pairwise(cuts))
        best = min(cost(lens, [0, *inner, n]) for inner in itertools.combinations(range(1, n), parts - 1))
        assert cost(lens, cuts) == best


def cost(lens: list[int], cuts: list[int]) -> int:
    """The largest padded cost of a contiguous split of rows sorted longest first."""
    return max(lens[a] * (b - a) for a, b in itertools.pairwise(cuts))


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_global_batches_do_not_depend_on_the_world_size_and_epochs_are_reshuffled():
    lengths = long_tail(600, seed=2)
    one = sampler(lengths)
    steps = one.epoch_batches(0) + one.epoch_batches(1) + 3  # into the third epoch
    for world, accum in ((2, 1), (2, 2), (4, 1)):
        ranks = [sampler(lengths, dp_rank=r, dp_world_size=world, grad_accum_steps=accum) for r in range(world)]
        loads = []
        for s in range(steps):
            micro = [ranks[r].micro_batches(s) for r in range(world)]
            assert all(len(m) == accum and all(len(mb) >= 1 for mb in m) for m in micro)
            got = sorted(i for m in micro for mb in m for i in mb)
            assert got == sorted(one.global_batch_indices(s))
            loads.append([sum(int(lengths[mb].max()) * len(mb) for mb in m) for m in micro])
        # balanced: the busiest rank pads no more than the whole step's padded tokens / world + one longest row x accum
        for s, load in enumerate(loads):
            rows = one.global_batch_indices(s)
            assert max(load) <= int(lengths[rows].max()) * len(rows) / world + int(lengths[rows].max()) * accum
    e0 = [b.tolist() for b in one.plan(0)]
    e1 = [b.tolist() for b in one.plan(1)]
    assert e0 != e1 and sorted(map(sorted, e0)) != sorted(map(sorted, e1))
    assert [b.tolist() for b in sampler(lengths).plan(1)] == e1  # from the seed alone
    assert [b.tolist() for b in sampler(lengths, seed=4).plan(1)] != e1


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_the_position_resumes_at_another_world_size_and_a_changed_budget_is_refused():
    lengths = long_tail(400, seed=5)
    run2 = [sampler(lengths, dp_rank=r, dp_world_size=2) for r in range(2)]
    for r in run2:
        it = iter(r)
        for _ in range(7):
            next(it)
    state = run2[0].state_dict(step=7)  # what the checkpoint saves: the trained step, global
    assert state == run2[1].state_dict(step=7)
    one = sampler(lengths, seed=99)  # the checkpoint's seed wins (warned)
    with pytest.warns(UserWarning, match="seed 99 overridden by checkpoint seed 3"):
        one.load_state_dict(state)
    ref = sampler(lengths)
    got = list(itertools.islice(iter(one), 12))
    assert got == [ref.micro_batches(s)[0] for s in range(7, 19)]
    for key, value in (("max_tokens", 3000), ("min_rows", 5), ("sort_window", 32)):
        with pytest.raises(ValueError, match=f"checkpoint has {key}="):
            sampler(lengths, **{key: value}).load_state_dict(state)
    with pytest.raises(ValueError, match="lengths_sha256"):
        sampler(np.r_[lengths[:-1], lengths[-1] + 1]).load_state_dict(state)  # one row changed


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_bad_budgets_are_config_errors_naming_the_value():
    lengths = long_tail(100)
    with pytest.raises(ConfigError, match="min_rows=4 is fewer than the micro-batches of one step .* = 8"):
        sampler(lengths, dp_world_size=4, grad_accum_steps=2)
    longest = int(lengths.max())
    with pytest.raises(ConfigError, match=f"max_tokens=100 holds fewer than min_rows=4 rows of the longest .{longest}"):
        sampler(lengths, max_tokens=100)


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_sft_rows_score_only_the_response_and_batches_pad_to_their_own_longest(tmp_path):
    src = write_sft(tmp_path / "sft.jsonl", 50)
    examples = [json.loads(line) for line in src.read_text().splitlines()]
    tok = load_tokenizer("bytes")
    for shift in (True, False):
        train, val = build_finetune(source=str(src), shift=shift, val_fraction=0.1)
        assert len(train) == 45 and len(val) == 5
        for i in (0, 7, 44):
            p, q = tok.encode_batch([examples[i]["prompt"], examples[i]["response"]])
            full = [*p, *q, tok.eos_id]
            row = train[i]
            if shift:  # labels[t] is the target after inputs[:t+1]
                assert row["input_ids"].tolist() == full[:-1]
                assert row["labels"].tolist() == [-100] * (len(p) - 1) + [*q, tok.eos_id]
            else:  # the model shifts: labels are the inputs, the prompt masked
                assert row["input_ids"].tolist() == full
                assert row["labels"].tolist() == [-100] * len(p) + [*q, tok.eos_id]
        assert train.lengths[3] == len(train[3]["input_ids"])
    rows = [train[i] for i in (2, 9, 30)]
    batch = pad_collate(rows, pad_id=0, attention_mask=True)
    longest = max(len(r["input_ids"]) for r in rows)
    assert batch["input_ids"].shape == (3, longest) and batch["labels"].shape == (3, longest)
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        assert batch["input_ids"][b, :n].tolist() == r["input_ids"].tolist()
        assert batch["labels"][b, n:].eq(-100).all() and batch["attention_mask"][b].sum() == n
        assert batch["input_ids"][b, n:].eq(0).all()
    assert len({v.untyped_storage().data_ptr() for v in batch.values()}) == 1  # one storage: one hand-over
    cut, _ = build_finetune(source=str(src), seq_len=20)
    assert max(len(cut[i]["input_ids"]) for i in range(len(cut))) <= 20
    fixed, _ = build_finetune(source=str(src), seq_len=64, padding="max")  # static shapes, the config's batches
    assert fixed.make_batch_sampler is None and fixed.collate(rows)["input_ids"].shape == (3, 64)
    with pytest.raises(ConfigError, match="data.kwargs.padding='max' pads every row to data.kwargs.seq_len"):
        build_finetune(source=str(src), padding="max")


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_classification_rows_and_their_loss_follow_the_token_rule(tmp_path):
    src = write_classify(tmp_path / "cls.jsonl", 40)
    train, _ = build_finetune(source=str(src))
    assert train.task == "classify" and train.num_labels == 3
    names = sorted({json.loads(line)["label"] for line in src.read_text().splitlines()})
    first = json.loads(src.read_text().splitlines()[0])
    assert int(train[0]["labels"]) == names.index(first["label"])
    batch = train.collate([train[i] for i in range(6)])
    assert batch["labels"].shape == (6,) and "attention_mask" in batch

    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = torch.nn.Embedding(256, 8), torch.nn.Linear(8, 3)

        def forward(self, input_ids, attention_mask):
            m = attention_mask.unsqueeze(-1).float()
            return self.out((self.emb(input_ids) * m).sum(1) / m.sum(1))

    torch.manual_seed(0)
    model = Pool()
    a, b = train.collate([train[i] for i in range(2)]), train.collate([train[i] for i in range(2, 6)])
    # two uneven micro-batches under the token rule sum to the mean over all six rows
    n = torch.tensor(6.0)
    split = classification_loss(model, a, num_items_in_batch=n) + classification_loss(model, b, num_items_in_batch=n)
    whole = torch.nn.functional.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
    torch.testing.assert_close(split, whole)


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_data_source_picks_the_factory_and_names_a_bad_value(tmp_path):
    src = write_sft(tmp_path / "sft.jsonl", 10)
    cfg = load_config(None, [f"data.source={src}", "data.kwargs={max_tokens: 999}"])
    assert cfg.data.factory == FINETUNE_FACTORY and cfg.data.source is None
    assert cfg.data.kwargs["max_tokens"] == 999 and cfg.data.kwargs["source"] == str(src)
    out, _, _ = prepared(tmp_path / "p", n_docs=20, shard_docs=10)
    assert load_config(None, [f"data.source={out}"]).data.factory == PACKED_FACTORY
    (tmp_path / "notes.csv").write_text("a,b\n")
    (tmp_path / "empty").mkdir()
    for bad, why in ((tmp_path / "nope", "no such file or folder"), (tmp_path / "notes.csv", "is a .csv file"),
                     (tmp_path / "empty", "a folder without manifest.json")):
        with pytest.raises(ConfigError, match=f"data.source='{bad}'.*{why}"):
            load_config(None, [f"data.source={bad}"])
    with pytest.raises(ConfigError, match="data.factory=dptrain.models.toy:build_regression_data is set too"):
        load_config(None, [f"data.source={src}", "data.factory=dptrain.models.toy:build_regression_data"])


@pytest.mark.timeout(60)
def test_two_ranks_take_the_same_steps_as_one_process_under_the_token_rule(tmp_path):
    """The same global batches split over 2 ranks (uneven rows and tokens per rank) give the same weights after
    3 SGD steps as one process; the per-rank token counts really differ (else the test could not fail)."""
    src = write_sft(tmp_path / "sft.jsonl", 120)
    over = ["optim.name=sgd", "optim.lr=0.5", "train.max_steps=3", "checkpoint.every_steps=0",
            "train.micro_batch_size=1", "train.grad_accum_steps=1"]  # one micro-batch per rank: 1 vs 2 pieces
    one = run_ranks(fit_finetune, 1, tmp_path / "one", src, [*over, "train.global_batch_size=1"])[0]
    two = run_ranks(fit_finetune, 2, tmp_path / "two", src, [*over, "train.global_batch_size=2"])[0]
    train, _ = build_finetune(source=str(src), seq_len=96, max_tokens=640, min_rows=4, sort_window=32)
    ranks = [train.make_batch_sampler(grad_accum_steps=1, dp_rank=r, dp_world_size=2, seed=1234, shuffle=True,
                                      start_step=0) for r in range(2)]
    counts = [[int((train.collate([train[i] for i in s.micro_batches(k)[0]])["labels"] != -100).sum())
               for s in ranks] for k in range(3)]
    assert any(a != b for a, b in counts), counts
    assert one.keys() == two.keys()
    moved = max(float((one[k] - fresh).abs().max()) for k, fresh in _init().items())
    assert moved > 1e-3
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-5, atol=1e-6)


def _init() -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    return build_llama(vocab_size=256, dim=16, n_layers=1, n_heads=2, max_seq_len=96).state_dict()


@pytest.mark.timeout(120)
def test_resume_at_world_2_1_2_with_workers_trains_every_step_on_its_global_batch(tmp_path):
    """2 steps at world 2, 2 at world 1, 2 at world 2, each resuming from the last checkpoint with 2 DataLoader
    workers per rank: every step trains on exactly its global batch (the world-1 plan), and the run continues at
    the right step."""
    src = write_sft(tmp_path / "sft.jsonl", 120)
    base = ["data.num_workers=2", "train.loss=support.finetune:recording_unpadded_loss", "checkpoint.every_steps=2"]
    steps = []
    for world, until in ((2, 2), (1, 4), (2, 6)):
        log = tmp_path / "log" / str(until)
        log.mkdir(parents=True)
        run_ranks(fit_finetune, world, tmp_path / "run", src, [*base, f"train.max_steps={until}"], log)
        steps += read_steps(log, world, accum=4 // world)
    train, _ = build_finetune(source=str(src), seq_len=96, max_tokens=640, min_rows=4, sort_window=32)
    order = train.make_batch_sampler(grad_accum_steps=1, dp_rank=0, dp_world_size=1, seed=1234, shuffle=True,
                                     start_step=0)
    want = [sorted(row_key(train[i]["input_ids"]) for i in order.global_batch_indices(s)) for s in range(6)]
    assert steps == want
    assert [s for s, _ in losses(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    # the log counts the rows each token-budget batch held (not global_batch_size per step), across the resumes
    records = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    seen = {r["step"]: r["samples_seen"] for r in records if "samples_seen" in r}
    assert seen == {s: sum(len(order.global_batch_indices(k)) for k in range(s)) for s in range(1, 7)}, seen
    assert len({len(order.global_batch_indices(k)) for k in range(6)}) > 1  # rows per step really vary


@pytest.mark.timeout(120)
def test_dptrain_run_refuses_a_bad_source_and_too_few_rows_per_step_before_any_worker(tmp_path):
    """Through the real command: a data.source that is no file, and min_rows under the step's micro-batches
    (grad_accum_steps 4 x 2 ranks), are exit code 2 naming the value, before any worker starts."""
    src = write_sft(tmp_path / "sft.jsonl", 40)
    missing = dptrain("run", f"data.source={tmp_path / 'nope.jsonl'}", "--out", str(tmp_path / "a"), timeout=100)
    assert missing.returncode == 2 and f"data.source='{tmp_path / 'nope.jsonl'}': no such file" in missing.stderr
    few = dptrain("run", f"data.source={src}", "data.kwargs.min_rows=2", "train.global_batch_size=8",
                  "train.micro_batch_size=1", "--nproc-per-node", "2", "--out", str(tmp_path / "b"), timeout=100)
    assert few.returncode == 2, few.stderr
    assert "data.kwargs.min_rows=2 is fewer than the micro-batches of one step" in few.stderr, few.stderr
    assert "Traceback" not in few.stderr + missing.stderr and not (tmp_path / "b" / "metrics.jsonl").exists()
