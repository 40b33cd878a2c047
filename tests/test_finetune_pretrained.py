"""The whole fine-tuning path together: a Hugging Face Llama saved locally (tests/support/pretrained.py), built on
the meta device by `dptrain.models.hf:causal_lm`, each rank loading only its shards, LoRA applied by `model.lora`,
trained on 2 forked gloo ranks under fsdp through the real `Trainer.fit()`:

- step 1's loss is the pretrained base's own loss on that batch (the base was loaded, and LoRA starts at B = 0);
- the checkpoints hold the adapters only and name the base folder;
- `final/` is PEFT's layout: `PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), final/)` gives the
  trained model's logits (max |d| <= 1e-5), and `dptrain ckpt export --merge` equals peft's `merge_and_unload`;
- the same run resumed from its step-2 checkpoint ends with the same losses and adapters, bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the optional extra: pip install -e '.[hf]')"
)
peft = pytest.importorskip("peft", reason="peft is not installed (the optional extra: pip install -e '.[lora]')")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402

from dptrain.checkpoint import manifest as mf  # noqa: E402
from support.hf import GLOBAL_BATCH, hf_batches, overrides  # noqa: E402
from support.mp import run_ranks  # noqa: E402
from support.parity import SEED  # noqa: E402
from support.pretrained import PROBE, save_hf_llama  # noqa: E402

STEPS = 4


def items(folder: Path, *, steps: int = STEPS) -> list[str]:
    base = [i for i in overrides("llama", "fsdp") if not i.startswith(("model.", "train.max_steps"))]
    return [*base, "model.factory=dptrain.models.hf:causal_lm", f"model.kwargs={{pretrained: {folder}}}",
            "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", f"train.max_steps={steps}",
            "checkpoint.every_steps=2", "train.log_every_steps=1"]


def _fit_and_probe(rank: int, cfg_items: list[str], out: str) -> dict:
    from dptrain.config.load import load_config
    from dptrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, cfg_items), out_dir=out)
    trainer.fit()
    model = trainer.parallel.module  # still the FSDP2 module: every rank runs the forward
    with torch.no_grad():
        logits = model.eval()(input_ids=PROBE).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"logits": logits.detach().clone()}


def losses(run: Path) -> list[tuple[int, str]]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], float(r["loss"]).hex()) for r in recs if "loss" in r]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_lora_on_a_sharded_pretrained_base_under_fsdp(tmp_path: Path) -> None:
    from torch.utils.data import default_collate

    from dptrain.data import GlobalBatchSampler

    folder = save_hf_llama(tmp_path / "base")
    run = tmp_path / "run"
    [r0, _] = run_ranks(_fit_and_probe, 2, items(folder), str(run), timeout=200)

    # step 1 is the base's own loss: loaded, not drawn; the adapters add nothing yet
    ds = hf_batches()
    order = GlobalBatchSampler(dataset_len=len(ds), global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH,
                               grad_accum_steps=1, dp_rank=0, dp_world_size=1, seed=SEED, shuffle=True)
    batch = default_collate([ds[i] for i in order.global_batch_indices(0)])
    base = transformers.LlamaForCausalLM.from_pretrained(str(folder))
    with torch.no_grad():
        want = base(**batch).loss.item()
    first = float.fromhex(losses(run)[0][1])
    assert abs(first - want) <= 1e-5, (first, want)

    # checkpoints: adapters only, and the base they belong to
    ckpt = run / "checkpoints" / "step_000002"
    meta = mf.verify(ckpt)
    assert meta["base_model"]["folder"] == str(folder)
    stored = list(FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata)
    tensors = [k for k in stored if k.startswith(("model.", "optim.state."))]
    assert tensors and all("lora_" in k for k in tensors), [k for k in tensors if "lora_" not in k][:5]

    # final/: PEFT's own loader gives the trained logits
    final = run / "final"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in final.iterdir()}
    assert all("lora_" in k for k in load_file(final / "adapter_model.safetensors"))
    tuned = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(str(folder)), str(final))
    with torch.no_grad():
        got = tuned.eval()(input_ids=PROBE).logits
    assert (got - r0["logits"]).abs().max().item() <= 1e-5
    assert (got - base.eval()(input_ids=PROBE).logits).abs().max().item() > 1e-4  # the adapters did train

    # the merged export of this run (its base read from the folder) equals peft's own merge_and_unload
    from dptrain.cli.main import main

    assert main(["ckpt", "export", str(run), "--merge", "--out", str(tmp_path / "merged")]) == 0
    mine = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).state_dict()
    theirs = tuned.merge_and_unload().state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

    # resume from step 2: the same losses and adapters, bit for bit
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(run / "checkpoints" / "step_000002", again / "checkpoints" / "step_000002")
    run_ranks(_fit_and_probe, 2, items(folder), str(again), timeout=200)
    assert losses(again) == losses(run)[2:]
    a, b = load_file(final / "adapter_model.safetensors"), load_file(again / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ QLoRA: a 4-bit base needs a GPU
@pytest.mark.fast
@pytest.mark.timeout(60)
def test_a_4bit_base_is_refused_on_a_cpu_with_the_reason(tmp_path: Path) -> None:
    """QLoRA's 4-bit base (bitsandbytes) is written for CUDA and not yet run on a GPU: on this machine it is
    refused before any process starts, naming the value; so are a 4-bit base without LoRA, under fsdp, and an
    unknown 4-bit type."""
    from dptrain.config import ConfigError, resolve
    from dptrain.config.load import load_config
    from dptrain.models.hf import causal_lm

    folder = save_hf_llama(tmp_path / "base")
    base = ["model.factory=dptrain.models.hf:causal_lm", f"model.kwargs={{pretrained: {folder}, quantize: nf4}}"]
    cases = {
        "a 4-bit base cannot be trained itself": [],
        "not FSDP2, ZeRO or tensor-parallel shards": ["model.lora.enabled=true", "parallel.strategy=fsdp"],
    }
    for message, extra in cases.items():
        with pytest.raises(ConfigError, match=message):
            resolve(load_config(None, [*base, *extra]), world_size=2)
    resolve(load_config(None, [*base, "model.lora.enabled=true", "parallel.strategy=ddp"]), world_size=2)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="quantize='nf4' .* needs a CUDA GPU and bitsandbytes"):
            causal_lm(str(folder), quantize="nf4")
    with pytest.raises(ConfigError, match="quantize='int3' is not one of nf4, fp4"):
        causal_lm(str(folder), quantize="int3")


@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_untied_embeddings_are_fsdp_units_of_their_own(tied: bool) -> None:
    """Under fsdp an untied Hugging Face model's input and output embeddings are each a unit (the two vocabulary-sized
    tensors are never gathered together: 4.79 -> 4.38 GB peak per rank for LoRA on a 1B Llama at 2 ranks); a tied
    pair stays with the root (one parameter cannot be in two units); also through a PEFT wrapper."""
    from dptrain.config import LoraConfig
    from dptrain.models.lora import apply_lora
    from dptrain.parallel.fsdp import shard_units
    from support.pretrained import hf_llama_config

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_llama_config(tied=tied))
    for m in (model, apply_lora(model, LoraConfig(enabled=True, rank=2))):
        units = shard_units(m)
        base = m.get_base_model() if hasattr(m, "get_base_model") else m
        embeddings = [base.model.embed_tokens, base.lm_head]
        assert [any(u is e for u in units) for e in embeddings] == [not tied, not tied]
        assert sum(type(u).__name__ == "LlamaDecoderLayer" for u in units) == base.config.num_hidden_layers


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_a_training_forward_keeps_no_generation_cache() -> None:
    """The default loss passes `use_cache=False` to a model whose config keeps a key/value cache (Hugging Face's
    `use_cache`, also through PEFT): under activation checkpointing the recomputed forward appended its keys and values
    to the same cache again and failed with a shape error on dynamically padded rows; other models get nothing."""
    from dptrain.config import LoraConfig
    from dptrain.models.lora import apply_lora
    from dptrain.train.loss import forward_loss
    from support.pretrained import hf_llama_config

    seen: list[dict] = []
    for model in (transformers.LlamaForCausalLM(hf_llama_config()),):
        peft_model = apply_lora(transformers.LlamaForCausalLM(hf_llama_config()), LoraConfig(enabled=True, rank=2))
        for m in (model, peft_model):
            real = m.forward
            m.forward = lambda *a, _real=real, **kw: (seen.append(kw), _real(*a, **kw))[1]  # type: ignore[method-assign]
            forward_loss(m, {"input_ids": PROBE, "labels": PROBE})
    assert [kw.get("use_cache") for kw in seen] == [False, False]

    class Plain(torch.nn.Module):
        def forward(self, **kw):
            seen.append(kw)
            return kw["x"].sum()

    forward_loss(Plain(), {"x": torch.ones(2)})
    assert "use_cache" not in seen[-1]
