"""Token-level loss normalisation (dptrain/train/loss.py) and mapping batches.

With ignored labels (-100) the global batch's loss is the mean over its valid tokens, not the mean
of micro-batch means. The parity test pads every sample to a different length and masks a prompt,
so micro-batches and ranks carry different token counts; candidate and reference are compared
exactly as in tests/test_parity.py (plain SGD, same tolerance), and a guard test shows that the old
mean-of-means rule misses that tolerance by far.
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from dptrain import to_device
from dptrain.data import GlobalBatchSampler
from dptrain.models.llama import build_llama
from dptrain.train.loss import count_targets, forward_loss, items_per_rank, takes_num_items
from support.parity import (
    ATOL,
    GLOBAL_BATCH,
    LLAMA_KWARGS,
    LR,
    SEED,
    STEPS,
    TOKENS_KWARGS,
    assert_weights_close,
    max_abs_diff,
    overrides,
    train,
)

PADDED_FACTORY = "test_loss_normalisation:padded_tokens"


class PaddedRows(Dataset):
    """Hugging Face-style samples: ``{"input_ids": [T], "labels": [T]}``, labels aligned with the
    predictions (LlamaLM's convention), -100 on a masked prompt and on the right padding."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        self.input_ids, self.labels = input_ids, labels

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def padded_tokens(*, n: int = 64, seq_len: int = 17, vocab_size: int = 256, seed: int = 0) -> PaddedRows:
    """Random sequences of random length 1..seq_len-1 (padded with token 0), the first 0..length-1
    labels masked as a prompt: between 1 and seq_len-1 valid targets per sample."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (n, seq_len), generator=g)
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for i in range(n):
        length = int(torch.randint(1, seq_len, (), generator=g))
        prompt = int(torch.randint(0, length, (), generator=g))
        input_ids[i, length:] = 0
        labels[i, length:] = -100
        labels[i, :prompt] = -100
    return PaddedRows(input_ids, labels)


def micro_batch_indices(step: int, *, global_batch: int, world_size: int, accum: int) -> list[list[int]]:
    """Every rank's micro-batches of `step`, in the order the Trainer's sampler assigns them."""
    out = []
    for rank in range(world_size):
        sampler = GlobalBatchSampler(
            dataset_len=TOKENS_KWARGS["n"], global_batch_size=global_batch,
            micro_batch_size=global_batch // (world_size * accum), grad_accum_steps=accum,
            dp_rank=rank, dp_world_size=world_size, seed=SEED, shuffle=True,
        )
        out += sampler.micro_batches(step)
    return out


def padded_reference(
    *, rule: str = "token", global_batch: int = GLOBAL_BATCH[2], world_size: int = 2, accum: int = 2,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain single-process PyTorch, plain SGD: (final weights, loss per step). `token`: the mean CE
    over every valid token of the global batch (the truth). `mean_of_means`: the old rule, the mean
    of the world_size * accum micro-batch means."""
    ds = padded_tokens(**TOKENS_KWARGS)
    torch.manual_seed(SEED)
    net = build_llama(**LLAMA_KWARGS)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        micros = micro_batch_indices(step, global_batch=global_batch, world_size=world_size, accum=accum)
        if rule == "token":
            loss = net(**default_collate([ds[i] for m in micros for i in m]))
        else:
            loss = torch.stack([net(**default_collate([ds[i] for i in m])) for m in micros]).mean()
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, losses


def padded_overrides(strategy: str, *, world_size: int = 2, accum: int = 2) -> list[str]:
    return overrides(strategy=strategy, world_size=world_size, accum=accum, model="llama") + [
        f"data.factory={PADDED_FACTORY}"
    ]


# ------------------------------------------------------------------ parity with padded labels
@pytest.mark.fast
def test_padded_data_really_varies_per_micro_batch_and_rank():
    """Precondition of the parity tests: token counts differ between micro-batches and ranks."""
    ds = padded_tokens(**TOKENS_KWARGS)
    for step in range(STEPS):
        micros = micro_batch_indices(step, global_batch=GLOBAL_BATCH[2], world_size=2, accum=2)
        counts = [int(count_targets(default_collate([ds[i] for i in m]))) for m in micros]
        assert len(set(counts)) > 1, counts
        assert counts[0] + counts[1] != counts[2] + counts[3], f"rank totals equal at step {step}: {counts}"


@pytest.mark.timeout(60)
def test_padded_labels_single_process_accum_matches_reference(tmp_path):
    got, records = train(padded_overrides("single", world_size=1, accum=2), 1, tmp_path)
    want, losses = padded_reference(world_size=1, accum=2)
    assert_weights_close(got, want)
    assert [r["loss"] for r in records if "loss" in r] == pytest.approx(losses, rel=1e-5)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_padded_labels_match_reference(strategy, tmp_path):
    """World size 2, accumulation 2: the final weights match the token-mean reference, and the logged
    loss is the global batch's token mean at every step."""
    got, records = train(padded_overrides(strategy), 2, tmp_path)
    want, losses = padded_reference()
    assert_weights_close(got, want)
    assert [r["loss"] for r in records if "loss" in r] == pytest.approx(losses, rel=1e-5)


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_mean_of_means_fails_the_parity_tolerance():
    """Guard: the old rule (each micro-step's mean / accum, averaged over ranks) is far outside the
    tolerance the parity tests use, so they would catch it."""
    want, losses = padded_reference(rule="token")
    old, old_losses = padded_reference(rule="mean_of_means")
    assert max_abs_diff(old, want) > 100 * ATOL
    with pytest.raises(AssertionError):
        assert_weights_close(old, want)
    assert old_losses != pytest.approx(losses, rel=1e-3)


# ------------------------------------------------------------------ the rules themselves
class KeywordModel(nn.Module):
    """A Hugging Face-like module: keyword inputs, an output object with `.loss`, `**kwargs`."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 1)
        self.seen: dict[str, object] = {}

    def forward(self, input_ids, labels=None, attention_mask=None, **kwargs):
        self.seen = {"attention_mask": attention_mask, **kwargs}
        per_token = self.emb(input_ids).squeeze(-1) * (labels != -100)
        n = kwargs.get("num_items_in_batch")
        loss = per_token.sum() / n if n is not None else per_token.sum() / (labels != -100).sum()
        return namedtuple("Out", "loss")(loss)


class MeanModel(nn.Module):
    """A plain model: one tensor in, a per-sample mean out, no token information."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, batch):
        return (self.w * batch).mean()


@pytest.mark.fast
def test_forward_loss_calls_mapping_batches_with_keywords():
    model = KeywordModel()
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, -100, 3]]),
             "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    loss = forward_loss(model, batch)
    assert loss.ndim == 0 and model.seen["attention_mask"] is batch["attention_mask"]
    n = torch.tensor(4.0)
    torch.testing.assert_close(forward_loss(model, batch, num_items_in_batch=n), loss * 2 / 4)
    assert model.seen["num_items_in_batch"] is n
    # Anything that is not a mapping is one positional argument, as before.
    assert float(forward_loss(MeanModel(), torch.tensor([1.0, 3.0])).detach()) == 2.0


@pytest.mark.fast
def test_which_rule_applies():
    assert takes_num_items(forward_loss, KeywordModel())  # **kwargs, as Hugging Face models
    assert takes_num_items(forward_loss, build_llama(**LLAMA_KWARGS))  # a num_items_in_batch parameter
    assert not takes_num_items(forward_loss, MeanModel())  # sample rule: divided by accum, as before
    declined = KeywordModel()
    declined.accepts_loss_kwargs = False  # Hugging Face's own opt-out attribute
    assert not takes_num_items(forward_loss, declined)
    assert not takes_num_items(forward_loss, nn.DataParallel(build_llama(**LLAMA_KWARGS)))

    def summed(model, batch, *, num_items_in_batch=None):
        return model(**batch, num_items_in_batch=num_items_in_batch)

    def mean(model, batch):
        return model(**batch)

    assert takes_num_items(summed, MeanModel()) and not takes_num_items(mean, KeywordModel())


@pytest.mark.fast
def test_count_targets_and_items_per_rank_at_world_size_one():
    a = {"input_ids": torch.zeros(2, 3), "labels": torch.tensor([[1, -100, 2], [-100, -100, 5]])}
    b = {"input_ids": torch.zeros(1, 3), "labels": torch.tensor([[-100, -100, -100]])}
    assert int(count_targets(a)) == 3 and int(count_targets(b)) == 0
    assert count_targets(torch.zeros(2, 3)) is None and count_targets({"x": torch.zeros(1)}) is None
    n = items_per_rank([a, b], device=torch.device("cpu"), dp_world_size=1)
    assert n.dtype == torch.float32 and float(n) == 3.0
    assert items_per_rank([a, torch.zeros(1)], device=torch.device("cpu"), dp_world_size=1) is None
    # No valid target in the whole global batch: a zero loss, not 0/0.
    assert float(items_per_rank([b], device=torch.device("cpu"), dp_world_size=1)) == 1.0


@pytest.mark.fast
def test_to_device_walks_mappings_sequences_and_named_tuples():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.ones(1), "keep")], "c": Pair(torch.ones(1), 3)}
    out = to_device(batch, torch.device("meta"))
    assert out["a"].is_meta and out["b"][0].is_meta and out["b"][1][0].is_meta and out["b"][1][1] == "keep"
    assert isinstance(out["c"], Pair) and out["c"].x.is_meta and out["c"].y == 3
    assert isinstance(out["b"][1], tuple)


@pytest.mark.fast
def test_a_compiled_module_is_judged_by_its_own_forward():
    """torch.compile's wrapper forwards *args, **kwargs: the rule must follow the module inside."""
    compiled = torch.compile(MeanModel())  # wrapping only; nothing is compiled until called
    assert not takes_num_items(forward_loss, compiled)


@pytest.mark.fast
def test_builtin_models_take_keyword_batches_and_num_items():
    from dptrain.models.toy import build_mlp

    torch.manual_seed(0)
    lm = build_llama(**LLAMA_KWARGS)
    batch = default_collate([padded_tokens(**TOKENS_KWARGS)[i] for i in range(4)])
    mean = lm(**batch)
    n_valid = int(count_targets(batch))
    torch.testing.assert_close(lm(**batch, num_items_in_batch=torch.tensor(7.0)), mean * n_valid / 7)
    torch.testing.assert_close(lm(batch), mean)  # a mapping passed positionally, as in one's own loop
    mlp = build_mlp(in_dim=3, hidden=4, out_dim=2, depth=1)
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    torch.testing.assert_close(mlp(x=x, y=y), mlp((x, y)))
    with pytest.raises(TypeError, match="needs a batch"):
        lm(input_ids=batch["input_ids"])
