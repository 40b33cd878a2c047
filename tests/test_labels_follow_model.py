"""The fine-tuning labels follow the model (dptrain/models/labels.py, `align_labels` in dptrain/train/build.py):
which models shift their labels themselves (transformers causal LMs, also inside PEFT's wrapper) and which do
not (the built-in LLaMA); `data.kwargs.shift` set from the model when not given; one against the model refused
naming the setting, the model's class and the value to set, by the Trainer and by `dptrain run` before any
worker; packed rows refused for a model that shifts its labels. The double shift itself: tests/test_labels.py."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dptrain.config import ConfigError, DataConfig  # noqa: E402
from dptrain.config.datasource import FINETUNE_FACTORY, PACKED_FACTORY  # noqa: E402
from dptrain.config.load import load_config  # noqa: E402
from dptrain.models.labels import labels_shifted_by, model_kind  # noqa: E402
from dptrain.models.llama import build_llama  # noqa: E402
from dptrain.models.toy import build_mlp  # noqa: E402
from dptrain.train.build import align_labels  # noqa: E402
from dptrain.train.trainer import Trainer  # noqa: E402
from support.hf import tiny_gpt2, tiny_llama, tiny_t5  # noqa: E402
from support.labels import write_one_example  # noqa: E402
from support.run_helpers import dptrain  # noqa: E402


class ShiftsItself(torch.nn.Module):
    shifts_labels = True


class MyLlama(transformers.LlamaForCausalLM):  # a user's subclass: its name says nothing
    pass


def byte_llama() -> torch.nn.Module:
    return build_llama(vocab_size=256, dim=16, n_layers=1, n_heads=2, max_seq_len=64)


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_which_models_shift_their_labels_themselves():
    with torch.device("meta"):  # as the launcher builds it
        assert labels_shifted_by(tiny_llama()) is True
    assert labels_shifted_by(tiny_gpt2()) is True  # GPT2LMHeadModel: a causal LM of transformers' registry
    assert labels_shifted_by(MyLlama(tiny_llama().config)) is True
    assert labels_shifted_by(tiny_t5()) is None  # seq2seq: its labels are the decoder's, not a shift of the input
    assert labels_shifted_by(byte_llama()) is False
    assert labels_shifted_by(build_mlp()) is None
    assert labels_shifted_by(ShiftsItself()) is True


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_a_peft_model_is_looked_through():
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    for wrapped in (peft.get_peft_model(tiny_llama(), lora),
                    peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, task_type="CAUSAL_LM"))):
        assert labels_shifted_by(wrapped) is True
        assert model_kind(wrapped).endswith("around LlamaForCausalLM")
    # transformers' own `base_model` (the decoder without its head) is not a causal LM: only PEFT is unwrapped
    assert labels_shifted_by(tiny_llama().base_model) is None


def finetune(tmp_path, **kwargs) -> DataConfig:
    src = write_one_example(tmp_path / "one.jsonl")
    return DataConfig(source=str(src), kwargs=kwargs)


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_shift_follows_the_model_when_not_given(tmp_path):
    data = finetune(tmp_path, seq_len=32)
    hf = align_labels(data, tiny_llama())
    assert hf.factory == FINETUNE_FACTORY and hf.kwargs == {"seq_len": 32, "source": data.source, "shift": False}
    assert align_labels(data, byte_llama()).kwargs["shift"] is True
    assert "shift" not in align_labels(data, build_mlp()).kwargs  # a model that does not say: the data's default
    assert align_labels(finetune(tmp_path, shift=False), tiny_llama()).kwargs["shift"] is False  # agreeing: kept
    other = DataConfig(factory="support.labels:shifted_rows", kwargs={"source": data.source})
    assert align_labels(other, tiny_llama()) == other  # a user's own data factory is the user's business


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_a_shift_against_the_model_is_refused_naming_the_setting_the_model_and_the_value(tmp_path):
    hf = (r"data.kwargs.shift=true contradicts the model: LlamaForCausalLM shifts its labels itself .* two places "
          r"ahead; remove data.kwargs.shift .* or set data.kwargs.shift=false")
    with pytest.raises(ConfigError, match=hf):
        align_labels(finetune(tmp_path, shift=True), tiny_llama())
    own = r"data.kwargs.shift=false contradicts the model: LlamaLM takes labels aligned with its predictions.*=true"
    with pytest.raises(ConfigError, match=own):
        align_labels(finetune(tmp_path, shift=False), byte_llama())


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_packed_rows_are_refused_for_a_model_that_shifts_its_labels():
    packed = DataConfig(factory=PACKED_FACTORY, kwargs={"source": "corpus"})
    with pytest.raises(ConfigError, match=r"build_packed gives labels already shifted .* LlamaForCausalLM shifts its "
                       r"labels itself"):
        align_labels(packed, tiny_llama())
    assert align_labels(packed, byte_llama()) == packed


@pytest.mark.timeout(60)
def test_the_trainer_refuses_a_shift_against_the_model(tmp_path):
    src = write_one_example(tmp_path / "one.jsonl")
    cfg = load_config(None, ["model.factory=support.labels:tiny_byte_llama", f"data.source={src}",
                             "data.kwargs={shift: true, min_rows: 1}", "train.global_batch_size=1",
                             "train.micro_batch_size=1", "train.max_steps=1", "parallel.strategy=single",
                             "parallel.device=cpu", "log.progress=false"])
    with pytest.raises(ConfigError, match="data.kwargs.shift=true contradicts the model: LlamaForCausalLM"):
        Trainer(cfg, out_dir=tmp_path / "run", resume="none").fit()
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text()  # never trained


@pytest.mark.timeout(120)
def test_dptrain_run_refuses_a_shift_against_the_model_before_any_worker(tmp_path):
    src = write_one_example(tmp_path / "one.jsonl")
    out = tmp_path / "run"
    r = dptrain("run", "model.factory=support.labels:tiny_byte_llama", f"data.source={src}",
                "data.kwargs={shift: true, min_rows: 2}", "train.global_batch_size=2", "train.micro_batch_size=1",
                "train.max_steps=1", "parallel.strategy=ddp", "log.progress=false", "--nproc-per-node", "2",
                "--out", str(out))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "data.kwargs.shift=true contradicts the model: LlamaForCausalLM shifts its labels itself" in r.stderr
    assert "Traceback" not in r.stderr and "rendezvous" not in r.stdout  # refused before torchrun started
    assert not (out / "config.yaml").exists()
