"""The built-in LLaMA <-> Hugging Face Llama, both ways (dptrain/models/llama_hf.py, checkpoint/hf.py,
`dptrain ckpt export --format hf`, `build_llama(pretrained=DIR)`):

- a run of the built-in LLaMA (GQA, tied and untied, another rope theta and norm eps) exported with
  `--format hf` loads with transformers' own `LlamaForCausalLM.from_pretrained`, and its logits equal the
  built-in's (max |d| <= 1e-5, fp32); loaded back into the built-in (`pretrained=DIR`) they are bit-equal;
- a HF Llama folder loaded into the built-in under tensor parallelism (tp 2, each rank reading its shards)
  and under fsdp gives HF's logits (<= 1e-5);
- what the built-in cannot represent, and dimensions that contradict the folder, are refused naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the optional extra: pip install -e '.[hf]')"
)

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from dptrain.config import ConfigError, ModelConfig  # noqa: E402
from dptrain.models.llama import build_llama  # noqa: E402
from support.mp import in_group, run_ranks  # noqa: E402
from support.parity import fit_items, overrides  # noqa: E402
from support.pretrained import PROBE, hf_logits, layout_and_load, save_hf_llama  # noqa: E402

LLAMA = "dptrain.models.llama:build_llama"
KWARGS = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 16, "rope_theta": 5000.0,
          "norm_eps": 1e-5}
TOL = 1e-5


def _builtin_run(tmp_path: Path, *, tied: bool) -> tuple[Path, dict]:
    """Two SGD steps of the built-in LLaMA in one process; (run dir, its kwargs)."""
    kwargs = {**KWARGS, "tie_embeddings": tied}
    items = [i for i in overrides(strategy="single", world_size=1, accum=1, model="llama", steps=2)
             if not i.startswith("model.kwargs.")]
    items += [f"model.kwargs.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kwargs.items()]
    run = tmp_path / "run"
    fit_items(0, items, str(run))
    return run, kwargs


def _builtin_logits(state: dict[str, torch.Tensor], kwargs: dict) -> torch.Tensor:
    model = build_llama(**kwargs)
    model.load_state_dict(state, strict=False)  # a tied model's final/ holds the shared matrix once
    if kwargs.get("tie_embeddings"):
        assert model.head.weight is model.tok_emb.weight
    with torch.no_grad():
        return model.eval().logits(PROBE)


def _export(run: Path, out: Path) -> None:
    from dptrain.cli.main import main

    assert main(["ckpt", "export", str(run), "--format", "hf", "--out", str(out)]) == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_builtin_exported_as_hf_loads_with_from_pretrained_and_round_trips(tied: bool, tmp_path: Path) -> None:
    run, kwargs = _builtin_run(tmp_path, tied=tied)
    trained = load_file(str(run / "final" / "model.safetensors"))
    want = _builtin_logits(trained, kwargs)
    out = tmp_path / "hf"
    _export(run, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["rms_norm_eps"] == 1e-5
    assert config["rope_parameters"]["rope_theta"] == 5000.0 and config["tie_word_embeddings"] is tied

    model, info = transformers.LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    with torch.no_grad():
        got = model.eval()(input_ids=PROBE).logits
    assert (got - want).abs().max().item() <= TOL
    assert want.abs().max().item() > 0.1  # logits that differ: a wrong permutation would show

    # ... and back: the built-in from the exported folder (one rank, loaded by the Materializer) is bit-equal
    cfg, again = run_ranks(_builtin_from, 1, str(out), timeout=60)[0]
    assert cfg == build_llama(**kwargs).cfg
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def _builtin_from(rank: int, folder: str) -> tuple:
    def body() -> tuple:
        pmodel, _ = layout_and_load(LLAMA, {"pretrained": folder}, strategy="single")
        with torch.no_grad():
            return pmodel.plain.cfg, pmodel.plain.eval().logits(PROBE)

    return in_group(body)


def _hf_into_builtin(rank: int, folder: str, strategy: str, tp: int) -> dict:
    def body() -> dict:
        pmodel, mat = layout_and_load(LLAMA, {"pretrained": folder}, strategy=strategy, tp=tp)
        if strategy == "fsdp":  # logits() is not forward: FSDP2 must all-gather around it too
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(pmodel.module, "logits")
        with torch.no_grad():
            logits = pmodel.module.logits(PROBE)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        return {"logits": logits.detach().clone(), "read": mat.reports[0].bytes_read,
                "total": mat.reports[0].total_bytes}

    return in_group(body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("strategy", "tp"), [("ddp", 2), ("fsdp", 1)], ids=["tp2", "fsdp2"])
def test_hf_llama_into_the_builtin_gives_hf_logits(strategy: str, tp: int, tmp_path: Path) -> None:
    folder = save_hf_llama(tmp_path / "hf", num_attention_heads=4, num_key_value_heads=2)  # GQA
    want = hf_logits(folder)
    got = run_ranks(_hf_into_builtin, 2, str(folder), strategy, tp, timeout=100)
    for r in got:
        assert (r["logits"] - want).abs().max().item() <= TOL
        assert r["read"] < 0.75 * r["total"]  # its shards (norms are replicated under tp: read whole)
    if strategy == "fsdp":
        assert sum(r["read"] for r in got) == got[0]["total"]


# ------------------------------------------------------------------ what the built-in cannot represent
def _edited(tmp_path: Path, **changes) -> str:
    folder = save_hf_llama(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("changes", "kwargs", "named"),
    [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, {},
         ["rope_parameters has rope_type='llama3'", "'default'"]),
        ({"attention_bias": True}, {}, ["attention_bias=True", "no biases in attention"]),
        ({"hidden_act": "gelu"}, {}, ["hidden_act='gelu'", "SiLU"]),
        ({"head_dim": 8}, {}, ["head_dim=8", "hidden_size/num_attention_heads=32/2"]),
        ({"model_type": "mistral"}, {}, ["'mistral'", "model_type", "dptrain.models.hf:causal_lm"]),
        ({}, {"dim": 64}, ["model.kwargs.dim=64", "hidden_size=32"]),
        ({}, {"max_seq_len": 64}, ["model.kwargs.max_seq_len=64", "max_position_embeddings=32"]),
    ],
    ids=["rope-scaling", "bias", "activation", "head-dim", "model-type", "dim", "longer-context"],
)
def test_what_the_builtin_cannot_represent_is_refused(changes, kwargs, named, tmp_path: Path) -> None:
    from dptrain.launch.checks import check_model

    folder = _edited(tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        check_model(ModelConfig(factory=LLAMA, kwargs={"pretrained": folder, **kwargs}))
    for text in named:
        assert text in str(err.value), str(err.value)


@pytest.mark.timeout(60)
def test_export_refuses_another_model_and_a_missing_out(tmp_path: Path, capsys) -> None:
    from dptrain.cli.main import main

    (tmp_path / "config.yaml").write_text("model:\n  factory: support.hf:tiny_llama\n  kwargs: {}\n")
    assert main(["ckpt", "export", str(tmp_path), "--format", "hf", "--out", str(tmp_path / "o")]) == 2
    assert "writes the built-in LLaMA" in capsys.readouterr().err
    assert main(["ckpt", "export", str(tmp_path), "--format", "hf"]) == 2
    assert "needs --out DIR" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_pretrained_on_the_default_recipe_takes_the_folders_dimensions(tmp_path: Path) -> None:
    """`dptrain run model.kwargs.pretrained=DIR` keeps the built-in recipe's other kwargs (dim 128, 4 layers, ...):
    they are the recipe's, not the user's, so the folder's config.json sets the model; a dimension the user does
    give that disagrees is still refused, naming it."""
    from dptrain.config.load import load_config
    from dptrain.train.build import build_model_meta

    folder = save_hf_llama(tmp_path / "hf")
    cfg = load_config(None, [f"model.kwargs.pretrained={folder}"])
    model, reason = build_model_meta(cfg.model, seed=0)
    config = json.loads((folder / "config.json").read_text())
    assert reason is None and model.cfg.dim == config["hidden_size"] and model.cfg.n_layers == config[
        "num_hidden_layers"] and model.cfg.max_seq_len == config["max_position_embeddings"]
    with pytest.raises(ConfigError, match="model.kwargs.dim=48 contradicts"):
        build_model_meta(load_config(None, [f"model.kwargs.pretrained={folder}", "model.kwargs.dim=48"]).model, seed=0)
