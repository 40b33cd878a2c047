"""The double shift: a transformers causal LM shifts its labels itself, so fine-tuning rows shifted by the data
as well train every token to predict the one two places ahead. Memorising one response through the real
Trainer on `data.source=FILE.jsonl`, the model's own next-token loss reaches ~0 and greedy generation gives the
response back only with the labels the model expects; the old default (`shift: true`, forced here below the
check) trains too, its loss falls, and the response is not learnt."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from dptrain.config.load import load_config  # noqa: E402
from dptrain.train.trainer import Trainer  # noqa: E402
from support.checkpoints import losses  # noqa: E402
from support.labels import RESPONSE, greedy_response, true_next_token_loss, write_one_example  # noqa: E402

STEPS = 50
RECIPE = [
    "model.factory=support.labels:tiny_byte_llama",
    "data.kwargs={min_rows: 1, max_tokens: 64, seq_len: 48}", "data.num_workers=0",
    "train.global_batch_size=1", "train.micro_batch_size=1", f"train.max_steps={STEPS}", "train.seed=0",
    "train.log_every_steps=5", "train.eval_every_steps=0",
    "optim.name=adamw", "optim.lr=0.01", "optim.weight_decay=0", "optim.warmup_steps=0", "optim.schedule=constant",
    "parallel.strategy=single", "parallel.device=cpu", "log.progress=false", "checkpoint.every_steps=0",
]


def memorise(tmp_path, factory: str | None = None):
    """Train the tiny HF Llama on the one example (`data.source=FILE.jsonl`, or the data `factory` given the
    file); return (its first and last logged loss, the model)."""
    src = write_one_example(tmp_path / "one.jsonl")
    data = [f"data.source={src}"] if factory is None else [f"data.factory={factory}", f"data.kwargs.source={src}"]
    cfg = load_config(None, [*RECIPE, *data])
    trainer = Trainer(cfg, out_dir=tmp_path / "run", resume="none")
    trainer.fit()
    logged = [float.fromhex(loss) for _, loss in losses(tmp_path / "run")]
    return logged[0], logged[-1], trainer.module


@pytest.mark.timeout(120)
def test_a_memorised_response_is_learnt_only_with_the_labels_the_model_expects(tmp_path):
    # data.source=FILE.jsonl with nothing said about shift: the labels must be the ones LlamaForCausalLM expects
    first, last, model = memorise(tmp_path)
    assert last < 0.05 < first
    assert true_next_token_loss(model) < 0.05, "the response's next-token loss did not reach ~0: labels shifted twice?"
    assert greedy_response(model) == RESPONSE
    assert "shift: false" in (tmp_path / "run" / "config.yaml").read_text()  # the run says what trained


@pytest.mark.timeout(120)
def test_the_double_shift_trains_silently_and_learns_the_wrong_thing(tmp_path):
    # the guard: the same run with the data shifted too (the old default) trains and its own loss falls,
    # but the model learnt to predict two tokens ahead: the check above would catch it
    first, last, model = memorise(tmp_path, "support.labels:shifted_rows")
    assert last < 0.05 < first  # silent: the training loss falls just as well
    assert true_next_token_loss(model) > 1.0
    assert greedy_response(model) != RESPONSE
