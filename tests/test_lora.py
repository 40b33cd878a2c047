"""LoRA as a first-class option (models/lora.py, checkpoint/adapters.py, checkpoint/base_identity.py): `model.lora` on
the built-in LLaMA and on a Hugging Face Llama, and a user's own PEFT factory.

- init: a meta-device build equals the eager one bit for bit, and the adapters start at B = 0, so step 0's logits are
  the base's (also for a HF model materialized from meta, where nn.Linear's reset_parameters would make B non-zero);
- frozen parameters: no gradients, no optimizer state, no gradient bytes on the wire (ddp's metered bytes are the
  adapters'), under ddp, zero1, zero2 and fsdp on 2 gloo ranks; parity with a single-process SGD reference;
- checkpoints: adapters only (size against the full model's), the base's identity, resume bit-identical, another
  base refused naming both;
- final/: PEFT's layout, loaded by `PeftModel.from_pretrained`; `dptrain ckpt export --merge` equals peft's own
  `merge_and_unload`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

peft = pytest.importorskip("peft", reason="peft is not installed (the optional extra: pip install -e '.[lora]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

import torch  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

from dptrain.config import ConfigError, LoraConfig, ModelConfig  # noqa: E402
from dptrain.config.load import load_config  # noqa: E402
from dptrain.data import GlobalBatchSampler  # noqa: E402
from dptrain.models.lora import apply_lora, base_name  # noqa: E402
from dptrain.parallel.materialize import materialize  # noqa: E402
from dptrain.train.build import build_model, build_model_meta  # noqa: E402
from dptrain.train.trainer import Trainer  # noqa: E402
from support.mp import run_ranks  # noqa: E402
from support.parity import SEED, tiny_tokens  # noqa: E402

LLAMA = {"vocab_size": 96, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 16}
TOKENS = {"n": 32, "seq_len": 17, "vocab_size": 96, "seed": 0}
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)
STEPS, GLOBAL, LR, MOMENTUM = 4, 8, 0.5, 0.9


def llama_cfg(**lora: Any) -> ModelConfig:
    return ModelConfig(factory="dptrain.models.llama:build_llama", kwargs=dict(LLAMA),
                       lora=LoraConfig(**{**LORA.__dict__, **lora}))


def items(strategy: str, world: int, *, steps: int = STEPS, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "model.factory=dptrain.models.llama:build_llama", *(f"model.kwargs.{k}={v}" for k, v in LLAMA.items()),
        "model.lora.enabled=true", f"model.lora.rank={LORA.rank}", f"model.lora.alpha={LORA.alpha}",
        "data.factory=support.parity:tiny_tokens", *(f"data.kwargs.{k}={v}" for k, v in TOKENS.items()),
        "data.num_workers=0", "optim.name=sgd", f"optim.lr={LR}", "optim.weight_decay=0", f"optim.momentum={MOMENTUM}",
        "optim.warmup_steps=0", "optim.schedule=constant", "optim.grad_clip=null",
        f"train.max_steps={steps}", f"train.seed={SEED}", "train.eval_batches=1", "train.log_every_steps=1",
        "train.eval_every_steps=0", f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={GLOBAL // world}",
        "train.grad_accum_steps=1", f"parallel.strategy={strategy}", "parallel.device=cpu", "parallel.timeout_s=60",
        "log.progress=false", "diagnostics.preflight=false", *extra,
    ]


def fit(rank: int, its: list[str], out: str, resume: str = "auto") -> dict[str, Any]:
    """One rank's run; what the test checks of its model and optimizer besides the summary."""
    t = Trainer(load_config(None, its), out_dir=out, resume=resume)
    summary = t.fit()
    plain = t.parallel.plain
    frozen = [p for p in plain.parameters() if not p.requires_grad]
    trainable = {id(p) for p in plain.parameters() if p.requires_grad}
    state_params = {id(p) for group in t.optimizer.param_groups for p in group["params"]}
    summary.update(
        frozen_grads=sum(p.grad is not None for p in frozen), n_frozen=len(frozen),
        opt_params_trainable=state_params <= trainable and bool(state_params),
        opt_state_trainable=all(id(p) in trainable for p in t.optimizer.state),
        trainable_bytes=sum(p.numel() * p.element_size() for p in plain.parameters() if p.requires_grad),
        all_bytes=sum(p.numel() * p.element_size() for p in plain.parameters()),
    )
    return summary


def reference() -> dict[str, torch.Tensor]:
    """One plain process, peft's own model: SGD with momentum on the whole global batch, the adapters' final values."""
    torch.manual_seed(SEED)
    net = build_model(llama_cfg(), seed=SEED)
    ds = tiny_tokens(**TOKENS)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM)
    order = GlobalBatchSampler(dataset_len=len(ds), global_batch_size=GLOBAL, micro_batch_size=GLOBAL,
                               grad_accum_steps=1, dp_rank=0, dp_world_size=1, seed=SEED, shuffle=True)
    for step in range(STEPS):
        net(default_collate([ds[i] for i in order.global_batch_indices(step)])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in net.named_parameters() if v.requires_grad}


def adapters_of(run: Path) -> dict[str, torch.Tensor]:
    """final/'s adapters loaded by peft into the base model, under the PEFT model's parameter names."""
    base = build_model(ModelConfig(factory="dptrain.models.llama:build_llama", kwargs=dict(LLAMA)), seed=SEED)
    model = peft.PeftModel.from_pretrained(base, str(run / "final"))
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


# ------------------------------------------------------------------ init
@pytest.mark.fast
@pytest.mark.timeout(60)
def test_meta_build_equals_eager_and_starts_at_the_base() -> None:
    cfg = llama_cfg()
    eager = build_model(cfg, seed=SEED)
    meta, reason = build_model_meta(cfg, seed=SEED)
    assert reason is None and all(p.is_meta for p in meta.parameters())
    materialize(meta, device="cpu", seed=SEED)
    want = eager.state_dict()
    for k, v in meta.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert [n for n, p in meta.named_parameters() if p.requires_grad] == [
        n for n, p in eager.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n, p in meta.named_parameters() if p.requires_grad)
    assert sum("lora_" in n for n, _ in meta.named_parameters()) == 2 * 7 * LLAMA["n_layers"]  # wq..w3, never head
    base = build_model(ModelConfig(factory=cfg.factory, kwargs=cfg.kwargs), seed=SEED)
    x = torch.randint(0, LLAMA["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(meta.get_base_model().logits(x), base.logits(x))  # B = 0: the base's logits at step 0


def tiny_hf_llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


def hf_peft_factory() -> torch.nn.Module:
    """A user's own PEFT factory (model.factory=test_lora:hf_peft_factory)."""
    return peft.get_peft_model(tiny_hf_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                 task_type="CAUSAL_LM"))


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_hf_peft_model_materialized_from_meta_keeps_peft_init() -> None:
    """As the pretrained loader feeds it: a HF PEFT model built on meta, then materialized. nn.Linear's
    reset_parameters alone would make lora_B non-zero; the replay of peft's reset_lora_parameters keeps it zero,
    seeded (two materializations agree), and the model's logits are its base's."""
    def meta_model() -> torch.nn.Module:
        with torch.device("meta"):
            return hf_peft_factory()

    a, b = meta_model(), meta_model()
    materialize(a, device="cpu", seed=SEED)
    materialize(b, device="cpu", seed=SEED)
    for (k, va), (_, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert "lora_" not in k or torch.equal(va, vb), k
    # the base's weights as the pretrained loader puts them in: by name, less peft's prefix and infix
    pretrained = tiny_hf_llama().state_dict()
    with torch.no_grad():
        for name, t in [*a.named_parameters(), *a.named_buffers()]:
            if "lora_" not in name and base_name(name) in pretrained:
                t.copy_(pretrained[base_name(name)])
    lora_b = [p for n, p in a.named_parameters() if "lora_B" in n]
    lora_a = [p for n, p in a.named_parameters() if "lora_A" in n]
    assert len(lora_b) == 4 and all(torch.count_nonzero(p) == 0 for p in lora_b)
    assert all(torch.count_nonzero(p) == p.numel() for p in lora_a)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = a(input_ids=x).logits
        with a.disable_adapter():
            base = a(input_ids=x).logits
    assert torch.equal(got, base)


# ------------------------------------------------------------------ refusals
@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("override", "named"), [
    ("model.lora.rank=0", "model.lora.rank=0 is not valid; it must be an integer >= 1"),
    ("model.lora.dropout=1.0", "model.lora.dropout=1.0 is not valid"),
    ("model.lora.alpha=-1", "model.lora.alpha=-1.0 is not valid"),
    ("parallel.pp=2", "model.lora.enabled=true cannot be used with parallel.pp=2"),
])
def test_bad_lora_settings_are_refused_before_launch(override: str, named: str) -> None:
    from dptrain.config.resolve import validate

    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(".", r"\.")):
        validate(load_config(None, ["model.lora.enabled=true", override]))


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_targets_that_match_nothing_name_the_linears_there_are() -> None:
    with pytest.raises(ConfigError, match=r"\['q_proj'\] match\(es\) no linear layer of LlamaLM; its linears are "
                                          r"named: head, w1, w2, w3, wk, wo, wq, wv"):
        build_model(llama_cfg(target_modules=("wq", "q_proj")), seed=SEED)
    with pytest.raises(ConfigError, match="already returns a PEFT model"):
        apply_lora(hf_peft_factory(), LORA)


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_missing_peft_is_a_config_error(monkeypatch) -> None:
    import importlib.util

    from dptrain.config.resolve import validate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs peft, which is not installed: pip install 'dptrain\[lora\]'"):
        validate(load_config(None, ["model.lora.enabled=true"]))


# ------------------------------------------------------------------ frozen parameters, parity
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_frozen_base_gets_no_grads_no_state_no_traffic_and_matches_one_process(strategy: str, tmp_path) -> None:
    out = tmp_path / strategy
    summaries = run_ranks(fit, 2, items(strategy, 2), str(out), timeout=150)
    for s in summaries:
        assert s["n_frozen"] > 0 and s["frozen_grads"] == 0
        assert s["opt_params_trainable"] and s["opt_state_trainable"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    if strategy in ("ddp", "zero1"):  # measured: DDP's buckets hold the adapters' gradients only
        trainable = summaries[0]["trainable_bytes"]
        assert trainable < summaries[0]["all_bytes"] / 5
        # zero1: + the broadcast of the updated partitions, (n-1)/n of the adapters' bytes
        per_step = trainable * (1.5 if strategy == "zero1" else 1.0)
        assert [r["comm_bytes"] for r in steps] == [per_step] * STEPS
    got, want = adapters_of(out), reference()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------ a HF base read from a folder: checkpoints, final/
def hf_from_folder(path: str) -> torch.nn.Module:
    """A user's factory of a pretrained HF model (model.factory=test_lora:hf_from_folder model.kwargs.path=DIR)."""
    return transformers.LlamaForCausalLM.from_pretrained(path)


def save_base(folder: Path, seed: int) -> None:
    torch.manual_seed(seed)
    tiny_hf_llama().save_pretrained(str(folder))


def hf_items(base: Path, *, steps: int = 4) -> list[str]:
    return [
        "model.factory=test_lora:hf_from_folder", f"model.kwargs.path={base}", "model.lora.enabled=true",
        "model.lora.rank=4", "data.factory=support.hf:hf_batches", "data.num_workers=0", "optim.name=adamw",
        "optim.lr=0.01", "optim.warmup_steps=0", "optim.schedule=constant", f"train.max_steps={steps}",
        f"train.seed={SEED}", "train.eval_every_steps=0", "train.eval_batches=1", "train.log_every_steps=1",
        "train.global_batch_size=4", "train.micro_batch_size=4", "parallel.strategy=single", "parallel.device=cpu",
        "checkpoint.every_steps=2", "log.progress=false", "diagnostics.preflight=false",
    ]


def losses(run: Path) -> dict[int, str]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: float(r["loss"]).hex() for r in recs if "loss" in r}


def size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.timeout(120)
def test_hf_lora_run_checkpoints_final_resume_and_merge(tmp_path, capsys) -> None:
    import shutil

    from dptrain.checkpoint.manifest import CheckpointError
    from dptrain.cli.main import main

    base_dir, run = tmp_path / "base", tmp_path / "run"
    save_base(base_dir, seed=1)
    t = Trainer(load_config(None, hf_items(base_dir)), out_dir=str(run))
    t.fit()
    trained = t.parallel.plain
    x = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = trained(input_ids=x).logits

    # checkpoints: the adapters and their optimizer state only, and the base's identity
    step4 = run / "checkpoints" / "step_000004"
    meta = json.loads((step4 / "manifest.json").read_text())["meta"]
    assert meta["base_model"]["folder"] == str(base_dir) and len(meta["base_model"]["hash"]) == 64
    saved = torch.load(step4 / "model.pt", weights_only=True)
    assert saved and all("lora_" in k for k in saved)
    full_ckpt = tmp_path / "full"
    full_items = [i for i in hf_items(base_dir, steps=2) if not i.startswith("model.lora")]
    Trainer(load_config(None, full_items), out_dir=str(full_ckpt)).fit()
    lora_bytes, full_bytes = size(step4), size(full_ckpt / "checkpoints" / "step_000002")
    with capsys.disabled():
        print(f"\nLoRA checkpoint {lora_bytes} B vs full-model checkpoint {full_bytes} B "
              f"({full_bytes / lora_bytes:.1f}x)")
    assert lora_bytes < full_bytes / 3

    # final/: PEFT's layout, loaded by peft itself, gives the trained logits
    assert sorted(p.name for p in (run / "final").iterdir() if p.suffix in (".json", ".safetensors")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    loaded = peft.PeftModel.from_pretrained(hf_from_folder(str(base_dir)), str(run / "final"))
    with torch.no_grad():
        got = loaded(input_ids=x).logits
    assert float((got - want).abs().max()) <= 1e-5

    # export --merge: the merged full model, loadable by transformers, equals peft's own merge_and_unload
    merged_dir = tmp_path / "merged"
    assert main(["ckpt", "export", str(run), "--merge", "--out", str(merged_dir)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(merged_dir))
    reference_merge = peft.PeftModel.from_pretrained(hf_from_folder(str(base_dir)), str(run / "final"))
    reference_merge = reference_merge.merge_and_unload()
    with torch.no_grad():
        d = float((exported(input_ids=x).logits - reference_merge(input_ids=x).logits).abs().max())
    assert d <= 1e-6, d
    ref_sd = reference_merge.state_dict()
    assert all(torch.equal(v, ref_sd[k]) for k, v in exported.state_dict().items())

    # resume from step 2: losses (float.hex) and final adapters bit-identical to the uninterrupted run
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    shutil.rmtree(resumed / "final")
    Trainer(load_config(None, hf_items(base_dir)), out_dir=str(resumed), resume="auto").fit()
    assert losses(resumed) == losses(run) and len(losses(run)) == 4
    a = dict(peft.PeftModel.from_pretrained(hf_from_folder(str(base_dir)), str(run / "final")).named_parameters())
    b = peft.PeftModel.from_pretrained(hf_from_folder(str(base_dir)), str(resumed / "final")).named_parameters()
    assert all(torch.equal(v, a[k]) for k, v in b)

    # another base in the same folder (same shapes and sizes, other weights): refused, naming both
    other = tmp_path / "other"
    shutil.copytree(run, other)
    shutil.rmtree(other / "checkpoints" / "step_000004")
    save_base(base_dir, seed=2)
    first = meta["base_model"]["hash"][:12]
    with pytest.raises(CheckpointError, match=rf"trained on the base model {base_dir} \(hash {first}\), but this "
                                              rf"run's base is {base_dir} \(hash "):
        Trainer(load_config(None, hf_items(base_dir)), out_dir=str(other), resume="auto").fit()


# ------------------------------------------------------------------ the planner
@pytest.mark.fast
@pytest.mark.timeout(60)
def test_planner_counts_the_frozen_base_as_weights_only() -> None:
    """From first principles, d=32, 2 heads of 16, ffn 64, vocab 100, 2 layers, r=4: per block the adapters are
    r*(in+out) over wq, wk, wv, wo (4 x (32+32)) and w1, w3, w2 (3 x (32+64)) = 4 * 544 = 2176, 4352 in all; the base
    has 100*32 (embedding) + 2 * (4*32*32 + 3*32*64 + 2*32) + 32 + 100*32 (head) = 27040 parameters. A real AdamW step
    of the LoRA model holds exactly those bytes."""
    from dptrain.config import Config
    from dptrain.config.resolve import resolve
    from dptrain.models.llama import LlamaConfig
    from dptrain.tools.plan import memory
    from dptrain.tools.plan.llama import lora_block_params
    from dptrain.tools.plan.predict import layout_from_config

    shape = {"vocab_size": 100, "dim": 32, "n_layers": 2, "n_heads": 2, "ffn_hidden": 64, "max_seq_len": 16}
    cfg = LlamaConfig(**shape)
    assert lora_block_params(cfg, rank=4) == 2176
    adapters, base = 4352, 27040
    run = load_config(None, [f"model.kwargs.{k}={v}" for k, v in shape.items()] + [
        "model.lora.enabled=true", "model.lora.rank=4", "parallel.strategy=ddp", "train.global_batch_size=2",
        "train.micro_batch_size=2", "parallel.device=cpu", "data.kwargs.seq_len=16"])
    assert isinstance(run, Config)
    lay = layout_from_config(run, resolve(run, world_size=1, cuda_available=False), seq=16, cpu=True)
    mem = memory.layout_memory(cfg, lay)
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * (base + adapters), 4 * adapters, 8 * adapters)
    fsdp = memory.layout_memory(cfg, memory.Layout(**{**lay.__dict__, "strategy": "fsdp", "dp_shard": 4}))
    assert (fsdp["params"], fsdp["grads"], fsdp["optimizer"]) == (base + adapters, adapters, 2 * adapters)

    model = build_model(ModelConfig(kwargs=shape, lora=LoraConfig(enabled=True, rank=4)), seed=SEED)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randint(0, 100, (2, 9))).backward()
    opt.step()
    real = {"params": sum(p.nbytes for p in model.parameters()),
            "grads": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
            "optimizer": sum(v.nbytes for s in opt.state.values() for v in s.values() if v.dim() > 0)}
    assert real == {k: mem[k] for k in real}


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_every_lora_field_is_documented() -> None:
    import dataclasses

    from dptrain.config import field_docs

    assert set(field_docs(LoraConfig)) == {f.name for f in dataclasses.fields(LoraConfig)}
