"""final/ of a Hugging Face model is a `save_pretrained` folder: a tiny LlamaForCausalLM (config built
in code, nothing downloaded), untied and with tied embeddings, trained on 2 forked gloo ranks
through the real `Trainer(cfg).fit()`, loads with `AutoModelForCausalLM.from_pretrained(final/)`
with no missing or unexpected key, and its logits equal the trained model's bit for bit (computed on
rank 0 right after `fit`). A model that is not a transformers model gets no config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the optional extra: pip install -e '.[hf]')"
)

import torch  # noqa: E402

from dptrain.config.load import load_config  # noqa: E402
from support.hf import HEADS, HIDDEN, LAYERS, SEQ, VOCAB, overrides  # noqa: E402
from support.mp import run_ranks  # noqa: E402

PROBE = torch.arange(3, 3 + 2 * SEQ).reshape(2, SEQ) % VOCAB  # a fixed input for the logits


def tiny_llama_tied() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=2 * SEQ,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(cfg)


def _fit_and_probe(rank: int, items: list[str], out_dir: str) -> torch.Tensor:
    from dptrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, items), out_dir=out_dir)
    trainer.fit()
    with torch.no_grad():
        return trainer.module.eval()(input_ids=PROBE).logits.detach().clone()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_final_dir_loads_with_from_pretrained(tied: bool, tmp_path: Path) -> None:
    items = overrides("llama", "ddp")
    if tied:
        items = [i for i in items if not i.startswith("model.factory=")] + [
            "model.factory=test_hf_pretrained:tiny_llama_tied"
        ]
    logits = run_ranks(_fit_and_probe, 2, items, str(tmp_path), timeout=200)
    final = tmp_path / "final"
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is tied and config["dtype"] == "float32"

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(final), output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    assert (head.data_ptr() == embed.data_ptr()) is tied  # tied again by from_pretrained, as the config says
    with torch.no_grad():
        got = model.eval()(input_ids=PROBE).logits
    torch.testing.assert_close(got, logits[0], rtol=0, atol=0)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)  # ddp replicas agree
    # the trained weights, not the initial ones: a freshly built model gives other logits
    torch.manual_seed(0)
    fresh = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(str(final)))
    with torch.no_grad():
        assert not torch.allclose(fresh.eval()(input_ids=PROBE).logits, got, atol=1e-3)


def test_a_plain_model_gets_no_config(tmp_path: Path) -> None:
    from dptrain.checkpoint.hf import save_pretrained_config
    from dptrain.models.toy import build_mlp

    model = build_mlp()
    assert save_pretrained_config(model, model.state_dict(), tmp_path) == []
    assert list(tmp_path.iterdir()) == []
