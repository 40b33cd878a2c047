"""Sharded loading of pretrained weights (dptrain/models/pretrained.py, dptrain/models/hf.py,
dptrain/parallel/load_pretrained.py): a tiny HF Llama saved with save_pretrained in tmp_path, built by
`dptrain.models.hf:causal_lm` on the meta device, laid out on 2 forked gloo ranks and loaded: its logits equal
transformers' own `from_pretrained` (fp32, max |d| <= 1e-5), under fsdp each rank reads about half of the
file, under ddp each the whole file, tied embeddings stay tied. Training from it: the loss of step 1 is the HF
model's loss on that batch. Bad folders are ConfigErrors naming the value, before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the optional extra: pip install -e '.[hf]')"
)

import torch  # noqa: E402

from dptrain.config import ConfigError, ModelConfig  # noqa: E402
from support.hf import overrides  # noqa: E402
from support.mp import in_group, run_ranks  # noqa: E402
from support.pretrained import PROBE, hf_logits, layout_and_load, save_hf_llama  # noqa: E402

HF = "dptrain.models.hf:causal_lm"


def _load_and_probe(rank: int, folder: str, strategy: str) -> dict:
    def body() -> dict:
        pmodel, mat = layout_and_load(HF, {"pretrained": folder}, strategy=strategy)
        plain = pmodel.plain
        with torch.no_grad():
            logits = pmodel.module(input_ids=PROBE).logits.detach().clone()
        report = mat.reports[0]
        return {
            "logits": logits, "read": report.bytes_read, "total": report.total_bytes, "files": report.files,
            "tied": plain.lm_head.weight is plain.model.embed_tokens.weight, "line": report.line(),
        }

    return in_group(body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_causal_lm_loads_sharded_with_from_pretrained_logits(strategy: str, tied: bool, tmp_path: Path) -> None:
    folder = save_hf_llama(tmp_path / "hf", tied=tied)
    file_bytes = (folder / "model.safetensors").stat().st_size
    got = run_ranks(_load_and_probe, 2, str(folder), strategy, timeout=100)
    want = hf_logits(folder)
    for r in got:
        assert (r["logits"] - want).abs().max().item() <= 1e-5
        assert r["tied"] is tied and r["files"] == 1
        assert r["total"] <= file_bytes < r["total"] + 64 * 1024  # the tensors' bytes (+ the header)
    if strategy == "fsdp":  # each rank its own half (+ the small replicated... nothing: all is sharded)
        assert all(0.4 * r["total"] <= r["read"] <= 0.6 * r["total"] for r in got), [r["read"] for r in got]
        assert sum(r["read"] for r in got) == got[0]["total"]  # no byte read twice
    else:  # every rank holds the whole model, copied tensor by tensor from the mapped file
        assert all(r["read"] == r["total"] for r in got)
    assert str(folder) in got[0]["line"] and "1 safetensors file(s)" in got[0]["line"]


def _fit(rank: int, items: list[str], out: str) -> None:
    from dptrain.config.load import load_config
    from dptrain.train.trainer import Trainer

    Trainer(load_config(None, items), out_dir=out).fit()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_training_from_pretrained_starts_at_the_pretrained_loss(strategy: str, tmp_path: Path, capfd) -> None:
    """Step 1's loss through the Trainer is the HF model's loss on the same global batch: the weights were
    loaded, not drawn at random (a random init gives another loss: checked)."""
    from torch.utils.data import default_collate

    from dptrain.data import GlobalBatchSampler
    from support.hf import GLOBAL_BATCH, hf_batches
    from support.parity import SEED

    folder = save_hf_llama(tmp_path / "hf")
    items = [i for i in overrides("llama", strategy) if not i.startswith("model.")]
    items += [f"model.factory={HF}", f"model.kwargs={{pretrained: {folder}}}", "train.max_steps=1"]
    run_ranks(_fit, 2, items, str(tmp_path / "run"), timeout=100)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(r["loss"] for r in records if r.get("step") == 1 and "loss" in r)
    console = capfd.readouterr().err  # rank 0's console line (the forked ranks share the test's stderr)
    assert console.count(f"dptrain: loaded pretrained weights from {folder} (1 safetensors file(s)") == 1

    ds = hf_batches()
    order = GlobalBatchSampler(dataset_len=len(ds), global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH,
                               grad_accum_steps=1, dp_rank=0, dp_world_size=1, seed=SEED, shuffle=True)
    batch = default_collate([ds[i] for i in order.global_batch_indices(0)])
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder))
    with torch.no_grad():
        want = model(**batch).loss.item()
        torch.manual_seed(0)
        fresh = transformers.LlamaForCausalLM(model.config)(**batch).loss.item()
    assert abs(first - want) <= 1e-5, (first, want)
    assert abs(fresh - want) > 1e-4  # ten times the tolerance: the check would catch random weights


# ------------------------------------------------------------------ bad folders: ConfigError naming the value
def _meta_build(kwargs: dict) -> None:
    from dptrain.train.build import build_model_meta

    build_model_meta(ModelConfig(factory=HF, kwargs=kwargs), seed=0)


def _without_safetensors(tmp_path: Path) -> dict:
    folder = save_hf_llama(tmp_path / "hf")
    (folder / "model.safetensors").unlink()
    return {"pretrained": str(folder)}


def _extra_key(tmp_path: Path) -> dict:
    from safetensors.torch import load_file, save_file

    folder = save_hf_llama(tmp_path / "hf")
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return {"pretrained": str(folder)}


def _missing_key(tmp_path: Path) -> dict:
    from safetensors.torch import load_file, save_file

    folder = save_hf_llama(tmp_path / "hf")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return {"pretrained": str(folder)}


def _wrong_shape(tmp_path: Path) -> dict:
    folder = save_hf_llama(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] += 2
    (folder / "config.json").write_text(json.dumps(config))
    return {"pretrained": str(folder)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda p: {"pretrained": str(p / "nowhere")}, ["nowhere", "is not a directory", "save_pretrained"]),
        (_without_safetensors, ["no model.safetensors", "config.json"]),
        (_extra_key, ["'model.layers.9.mlp.up_proj.weight'", "no parameter for"]),
        (_missing_key, ["'model.layers.1.self_attn.k_proj.weight'", "has no tensor"]),
        (_wrong_shape, ["'model.layers.0.mlp.gate_proj.weight' has shape [64, 32]", "the model's parameter [66, 32]"]),
        (lambda p: {"pretrained": str(save_hf_llama(p / "hf")), "dtype": "float8"}, ["dtype='float8'"]),
    ],
    ids=["missing-folder", "no-safetensors", "unexpected-key", "missing-key", "shape", "dtype"],
)
def test_bad_pretrained_folders_are_refused_naming_the_value(make, named: list[str], tmp_path: Path) -> None:
    kwargs = make(tmp_path)
    with pytest.raises(ConfigError) as err:
        _meta_build(kwargs)
    for text in named:
        assert text in str(err.value), str(err.value)
    from dptrain.launch.checks import check_model  # the launcher's check, before any worker: the same message

    with pytest.raises(ConfigError) as err2:
        check_model(ModelConfig(factory=HF, kwargs=kwargs))
    assert str(err2.value) == str(err.value)
