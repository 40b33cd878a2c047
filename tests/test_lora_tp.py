"""LoRA under tensor parallelism (models/lora_parallel.py: the tp plans rewritten for peft's LoRA layers), for the
built-in LLaMA and a Hugging Face LlamaForCausalLM read from a folder, on real gloo ranks (tests/support/mp.py):

- parity with one plain process training peft's own model with SGD (momentum): every step's loss and the final
  adapters within rtol 1e-5, under tp2 with and without sequence parallelism, with loss parallelism and activation
  checkpointing, and dp2 x tp2 under fsdp, zero2 and ddp (4 ranks);
- every adapter's gradient in fp64 (lora_B non-zero, so lora_A has one) equal to one process's to 1e-12 relative,
  which the trained parity cannot show for lora_A (from B = 0 some A's move by 1e-8 in 4 steps);
- the frozen base stays frozen through the plan (SequenceParallel would make its norms trainable), gets no gradient
  and no optimizer state; the adapters are split as the plan says; the planner's per-rank adapter count;
- the meta-device init under tp gives every rank its shard of the one-process init, bit for bit;
- final/ (gathered from DTensor adapters) loads with `PeftModel.from_pretrained` and gives the trained logits; the tp
  DCP checkpoint holds the adapters only and resumes bit-identical; `ckpt export --merge` equals peft's own merge;
- the refusals: pipeline parallelism and LoRA dropout under tp before launch, a LoRA layer the plan cannot split
  (DoRA), a base model whose numbers tp does not divide.
"""

from __future__ import annotations

import json
import warnings
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
from dptrain.train.build import build_model  # noqa: E402
from dptrain.train.trainer import Trainer  # noqa: E402
from support import hf  # noqa: E402
from support.mp import run_ranks  # noqa: E402
from support.parity import SEED, tiny_tokens  # noqa: E402

warnings.filterwarnings("ignore", message=".*sequential all_(reduce|gather).*")

LLAMA = {"vocab_size": 96, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 16}
TOKENS = {"n": 32, "seq_len": 17, "vocab_size": 96, "seed": 0}
RANK, ALPHA = 4, 8.0
STEPS, GLOBAL, LR, MOMENTUM = 4, 8, 0.5, 0.9
PROBE = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(5))  # 8 tokens: splits over tp=2 (SP)
RTOL, ATOL = 1e-5, 1e-6


# ------------------------------------------------------------------ the two models and their runs
def llama_model_cfg() -> ModelConfig:
    return ModelConfig(factory="dptrain.models.llama:build_llama", kwargs=dict(LLAMA),
                       lora=LoraConfig(enabled=True, rank=RANK, alpha=ALPHA))


def hf_from_folder(path: str) -> torch.nn.Module:
    """A user's factory of a pretrained HF model (model.factory=test_lora_tp:hf_from_folder model.kwargs.path=DIR)."""
    return transformers.LlamaForCausalLM.from_pretrained(path)


def hf_model_cfg(base: Path) -> ModelConfig:
    return ModelConfig(factory="test_lora_tp:hf_from_folder", kwargs={"path": str(base)},
                       lora=LoraConfig(enabled=True, rank=RANK, alpha=ALPHA))


def common(*, dp: int, tp: int, strategy: str) -> list[str]:
    return [
        "model.lora.enabled=true", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "data.num_workers=0",
        "optim.name=sgd", f"optim.lr={LR}", "optim.weight_decay=0", f"optim.momentum={MOMENTUM}",
        "optim.warmup_steps=0", "optim.schedule=constant", "optim.grad_clip=null", f"train.max_steps={STEPS}",
        f"train.seed={SEED}", "train.eval_batches=1", "train.log_every_steps=1", "train.eval_every_steps=0",
        f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={GLOBAL // dp}", "train.grad_accum_steps=1",
        f"parallel.strategy={strategy}", f"parallel.tp={tp}", "parallel.device=cpu", "parallel.timeout_s=60",
        "log.progress=false", "diagnostics.preflight=false",
    ]


def llama_items(*, dp: int = 1, tp: int = 2, strategy: str = "ddp", extra: tuple[str, ...] = ()) -> list[str]:
    return ["model.factory=dptrain.models.llama:build_llama", *(f"model.kwargs.{k}={v}" for k, v in LLAMA.items()),
            "data.factory=support.parity:tiny_tokens", *(f"data.kwargs.{k}={v}" for k, v in TOKENS.items()),
            *common(dp=dp, tp=tp, strategy=strategy), *extra]


def hf_items(base: Path, *, dp: int = 1, tp: int = 2, strategy: str = "ddp") -> list[str]:
    return ["model.factory=test_lora_tp:hf_from_folder", f"model.kwargs.path={base}",
            "data.factory=support.hf:hf_batches", *common(dp=dp, tp=tp, strategy=strategy)]


def probe_logits(model: torch.nn.Module) -> torch.Tensor:
    """The logits of PROBE from a PEFT model (built-in LLaMA or HF), whole (vocabulary-sharded ones gathered)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        base = model.get_base_model()  # type: ignore[operator]
        out = base.logits(PROBE) if hasattr(base, "logits") else model(input_ids=PROBE).logits
    return (out.full_tensor() if isinstance(out, DTensor) else out).detach().clone()


def fit(rank: int, items: list[str], out: str, with_logits: bool) -> dict[str, Any]:
    """One rank's run: what the test checks of its model, optimizer and (with_logits) the trained model's logits,
    taken right before final/ is written (while the process group lives)."""
    from torch.distributed.tensor import DTensor

    from dptrain.train.outputs import RunOutputs

    seen: dict[str, Any] = {}
    real = RunOutputs.save_final

    def save_final(self: RunOutputs, pmodel: Any) -> None:
        if with_logits:
            seen["logits"] = probe_logits(pmodel.plain)
        real(self, pmodel)

    RunOutputs.save_final = save_final  # type: ignore[method-assign]  # a forked rank: patched here only
    t = Trainer(load_config(None, items), out_dir=out)
    summary = t.fit()
    plain = t.parallel.plain
    trainable = {id(p) for p in plain.parameters() if p.requires_grad}
    in_optimizer = {id(p) for group in t.optimizer.param_groups for p in group["params"]}
    return {
        **summary, **seen,
        "n_frozen": sum(not p.requires_grad for p in plain.parameters()),
        # the base stays frozen through the plan (SequenceParallel re-registers norm weights as trainable ones)
        "trained_not_adapters": [n for n, p in plain.named_parameters() if p.requires_grad and "lora_" not in n],
        "frozen_grads": sum(p.grad is not None for p in plain.parameters() if not p.requires_grad),
        "optimizer_trainable_only": bool(in_optimizer) and in_optimizer <= trainable
        and all(id(p) in trainable for p in t.optimizer.state),
        "local_trainable": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in plain.parameters()
                               if p.requires_grad),
        "placements": {n: [repr(pl) for pl in p.placements] for n, p in plain.named_parameters()
                       if isinstance(p, DTensor) and "lora_" in n},
    }


def reference(model_cfg: ModelConfig, data: Any, step_loss: Any) -> dict[str, Any]:
    """One plain process, peft's own model: SGD with momentum on each whole global batch; the losses, the final
    adapters and the trained logits of PROBE."""
    net = build_model(model_cfg, seed=SEED)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM)
    order = GlobalBatchSampler(dataset_len=len(data), global_batch_size=GLOBAL, micro_batch_size=GLOBAL,
                               grad_accum_steps=1, dp_rank=0, dp_world_size=1, seed=SEED, shuffle=True)
    losses = []
    for step in range(STEPS):
        loss = step_loss(net, default_collate([data[i] for i in order.global_batch_indices(step)]))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    adapters = {k: v.detach().clone() for k, v in net.named_parameters() if v.requires_grad}
    return {"losses": losses, "adapters": adapters, "logits": probe_logits(net)}


def llama_reference() -> dict[str, Any]:
    return reference(llama_model_cfg(), tiny_tokens(**TOKENS), lambda net, batch: net(batch))


def hf_reference(base: Path) -> dict[str, Any]:
    return reference(hf_model_cfg(base), hf.hf_batches(), lambda net, batch: net(**batch).loss)


def run_losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def final_model(run: Path, base: torch.nn.Module) -> torch.nn.Module:
    """final/ loaded by peft itself into `base`."""
    assert sorted(p.name for p in (run / "final").iterdir() if p.suffix in (".json", ".safetensors")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    return peft.PeftModel.from_pretrained(base, str(run / "final"))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def check_run(run: Path, summaries: list[dict[str, Any]], want: dict[str, Any], base: torch.nn.Module,
              *, label: str) -> None:
    """The parity, frozen-base and final/ checks shared by the tests; prints the measured max |d|."""
    for s in summaries:
        assert s["n_frozen"] > 0 and s["frozen_grads"] == 0 and s["trained_not_adapters"] == [], s
        assert s["optimizer_trainable_only"]
    got_losses = run_losses(run)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want["losses"]), rtol=RTOL, atol=ATOL)
    loaded = final_model(run, base)
    got = {k: v.detach() for k, v in loaded.named_parameters() if "lora_" in k}
    for k in want["adapters"]:
        torch.testing.assert_close(got[k], want["adapters"][k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")
    d_adapters = max_diff(got, want["adapters"])
    d_loss = max(abs(a - b) for a, b in zip(got_losses, want["losses"], strict=True))
    line = f"\n{label}: max |d| adapters {d_adapters:.2e}, losses {d_loss:.2e}"
    if "logits" in summaries[0]:  # final/ loaded by peft gives the logits the tp model had at the end
        trained = summaries[0]["logits"]
        d_final = float((probe_logits(loaded) - trained).abs().max())
        assert d_final <= 1e-5, d_final
        line += f", final/ logits vs the trained tp model {d_final:.2e}, vs one process " \
                f"{float((trained - want['logits']).abs().max()):.2e}"
    print(line)


# ------------------------------------------------------------------ the built-in LLaMA
@pytest.fixture(scope="module")
def llama_want() -> dict[str, Any]:
    return llama_reference()


def llama_base() -> torch.nn.Module:
    return build_model(ModelConfig(factory="dptrain.models.llama:build_llama", kwargs=dict(LLAMA)), seed=SEED)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("label", "extra"), [
    ("tp2, sequence parallel", ()),
    ("tp2, no sequence parallel", ("parallel.sequence_parallel=false",)),
    ("tp2, loss parallel", ("parallel.loss_parallel=true",)),
    ("tp2, activation checkpointing", ("parallel.activation_checkpointing=full",)),
])
def test_builtin_llama_lora_under_tp2_matches_one_process(label, extra, llama_want, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    summaries = run_ranks(fit, 2, llama_items(extra=extra), str(run), True, timeout=130)
    with capsys.disabled():
        check_run(run, summaries, llama_want, llama_base(), label=f"built-in LLaMA, {label}")
    placements = summaries[0]["placements"]
    # split as the plan says: colwise base -> lora_A replicated, lora_B sharded like the base's rows;
    # rowwise base -> lora_A sharded like the base's columns, lora_B replicated
    prefix = "base_model.model.layers.0"
    assert placements[f"{prefix}.attn.wq.lora_A.default.weight"] == ["Replicate()"]
    assert placements[f"{prefix}.attn.wq.lora_B.default.weight"] == ["Shard(dim=0)"]
    assert placements[f"{prefix}.mlp.w2.lora_A.default.weight"] == ["Shard(dim=1)"]
    assert placements[f"{prefix}.mlp.w2.lora_B.default.weight"] == ["Replicate()"]
    assert len(placements) == 2 * 7 * LLAMA["n_layers"]
    # the planner's count of one rank's adapters, from first principles: d=32, ffn 96, r=4, tp=2, per block
    # wq wk wv 3 x 4*(32+16), w1 w3 2 x 4*(32+48), wo 4*(16+32), w2 4*(48+32) = 1728 (2560 unsplit)
    from dptrain.models.llama import LlamaConfig
    from dptrain.tools.plan.llama import lora_block_params

    assert lora_block_params(LlamaConfig(**LLAMA), rank=RANK, tp=2) == 1728
    assert all(s["local_trainable"] == 1728 * LLAMA["n_layers"] for s in summaries)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "ddp"])
def test_builtin_llama_lora_under_dp2_times_tp2_matches_one_process(strategy, llama_want, tmp_path, capsys) -> None:
    """4 ranks: 2 data-parallel replicas (ddp: FSDP2's replicate) or shards (fsdp, zero2) of a model split over 2;
    the adapters are 2-D DTensors on (dp, tp)."""
    run = tmp_path / "run"
    summaries = run_ranks(fit, 4, llama_items(dp=2, strategy=strategy), str(run), False, timeout=220)
    with capsys.disabled():
        check_run(run, summaries, llama_want, llama_base(), label=f"built-in LLaMA, {strategy} dp2 x tp2")


def random_b(net: torch.nn.Module) -> torch.nn.Module:
    """Every lora_B drawn at random (seeded): with B = 0, as initialised, every lora_A's gradient is zero."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return net


def adapter_grads(net: torch.nn.Module, batch: Any, step_loss: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    step_loss(net, batch).backward()
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in net.named_parameters() if p.grad is not None}


def grads_under_tp(rank: int, build: Any, batch: Any, step_loss: Any, sequence_parallel: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dptrain.parallel.tensor import apply_tp

    dist.init_process_group("gloo")
    try:
        net = build()
        apply_tp(net, init_device_mesh("cpu", (2,)), sequence_parallel=sequence_parallel)
        return adapter_grads(net, batch, step_loss)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["built-in, sequence parallel", "built-in, no sequence parallel", "HF Llama"])
def test_every_adapter_gradient_under_tp2_equals_one_process_in_fp64(case, tmp_path, capsys) -> None:
    """In float64, with every lora_B non-zero (so every lora_A has a gradient): each adapter's gradient under tp2,
    gathered whole, equals one process's to 1e-12 relative; only the adapters get one. (The training parity above
    cannot see lora_A's gradient well: from B = 0 some A's move by 1e-8 in its 4 steps.) A missing or extra
    reduction shows here as an error of 1e-3 or more (measured, with a frozen norm left trainable)."""
    if case.startswith("HF"):
        base = tmp_path / "base"
        torch.manual_seed(1)
        hf.tiny_llama().save_pretrained(str(base))
        cfg, batch = hf_model_cfg(base), default_collate([hf.hf_batches()[i] for i in range(8)])

        def step_loss(net: Any, b: Any) -> torch.Tensor:
            return net(**b).loss
    else:
        cfg, batch = llama_model_cfg(), default_collate([tiny_tokens(**TOKENS)[i] for i in range(8)])

        def step_loss(net: Any, b: Any) -> torch.Tensor:
            return net(b)

    def build() -> torch.nn.Module:
        return random_b(build_model(cfg, seed=SEED).double())

    want = adapter_grads(build(), batch, step_loss)
    got = run_ranks(grads_under_tp, 2, build, batch, step_loss, "no sequence" not in case, timeout=80)
    assert want.keys() == got[0].keys() and all("lora_" in k for k in want) and len(want) == 28
    d = max(float((got[r][k] - want[k]).abs().max() / want[k].abs().max()) for r in (0, 1) for k in want)
    with capsys.disabled():
        print(f"\n{case}: adapter gradients under tp2, fp64, max |d| / max |g| {d:.1e}")
    assert d < 1e-12


def resume_fit(rank: int, items: list[str], out: str) -> dict[str, Any]:
    return Trainer(load_config(None, items), out_dir=out, resume="auto").fit()


@pytest.mark.timeout(150)
def test_adapter_only_checkpoints_under_tp2_resume_bit_identical(tmp_path) -> None:
    """The DCP checkpoint of a tp2 LoRA run holds the adapters and their optimizer state only (DTensor shards);
    resumed at step 2 under tp2, the losses (float.hex) and final/'s adapters equal the uninterrupted run's; its
    merged export equals peft's own merge_and_unload."""
    import shutil

    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    run, resumed = tmp_path / "run", tmp_path / "resumed"
    items = llama_items(extra=("checkpoint.every_steps=2",))
    run_ranks(resume_fit, 2, items, str(run), timeout=130)
    keys = list(FileSystemReader(str(run / "checkpoints" / "step_000002" / "dcp")).read_metadata().state_dict_metadata)
    assert keys and all("lora_" in k for k in keys), [k for k in keys if "lora_" not in k][:5]
    assert sum(k.startswith("model.") for k in keys) == 2 * 7 * LLAMA["n_layers"]
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    shutil.rmtree(resumed / "final")
    run_ranks(resume_fit, 2, items, str(resumed), timeout=130)
    hexes = [[float(x).hex() for x in run_losses(r)] for r in (run, resumed)]
    assert hexes[0] == hexes[1] and len(hexes[0]) == STEPS
    a, b = (load_file(r / "final" / "adapter_model.safetensors") for r in (run, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # export --merge reads the tp checkpoint's DCP shards whole: equal to peft's own merge_and_unload of final/
    from dptrain.cli.main import main

    assert main(["ckpt", "export", str(run), "--merge", "--out", str(tmp_path / "merged")]) == 0
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    want = final_model(run, llama_base()).merge_and_unload().state_dict()
    assert merged.keys() == want.keys() and all(torch.equal(merged[k], want[k]) for k in want)


@pytest.mark.timeout(90)
def test_meta_init_under_tp_gives_each_rank_its_shard_of_the_one_process_init(tmp_path) -> None:
    """Built on meta, split over tp=2, materialized: every tensor (base and adapters, whole via DTensor) equals the
    eager one-process build bit for bit; lora_B starts at zero."""
    def one_rank(rank: int) -> list[str]:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor

        from dptrain.parallel.materialize import materialize
        from dptrain.parallel.tensor import apply_tp
        from dptrain.train.build import build_model_meta

        dist.init_process_group("gloo")
        try:
            model, reason = build_model_meta(llama_model_cfg(), seed=SEED)
            assert reason is None, reason
            apply_tp(model, init_device_mesh("cpu", (2,)))
            materialize(model, device="cpu", seed=SEED)
            want = build_model(llama_model_cfg(), seed=SEED).state_dict()
            bad = []
            for name, t in model.state_dict().items():
                whole = t.full_tensor() if isinstance(t, DTensor) else t
                if not torch.equal(whole, want[name]):
                    bad.append(name)
            assert sum(isinstance(t, DTensor) for n, t in model.state_dict().items() if "lora_" in n) == 28
            return bad
        finally:
            dist.destroy_process_group()

    assert run_ranks(one_rank, 2, timeout=80) == [[], []]


# ------------------------------------------------------------------ Hugging Face Llama from a folder
@pytest.mark.timeout(150)
def test_hf_llama_lora_under_tp2_matches_one_process(tmp_path, capsys) -> None:
    """LlamaForCausalLM read from a save_pretrained folder (the base weights loaded, not re-drawn), LoRA on every
    linear but lm_head, split by its own base_model_tp_plan rewritten for the LoRA layers."""
    base = tmp_path / "base"
    torch.manual_seed(1)
    hf.tiny_llama().save_pretrained(str(base))
    run = tmp_path / "run"
    summaries = run_ranks(fit, 2, hf_items(base), str(run), True, timeout=130)
    with capsys.disabled():
        check_run(run, summaries, hf_reference(base), hf_from_folder(str(base)), label="HF Llama, tp2")
    placements = summaries[0]["placements"]
    prefix = "base_model.model.model.layers.1"
    assert placements[f"{prefix}.self_attn.q_proj.lora_B.default.weight"] == ["Shard(dim=0)"]
    assert placements[f"{prefix}.self_attn.o_proj.lora_A.default.weight"] == ["Shard(dim=1)"]
    assert placements[f"{prefix}.mlp.down_proj.lora_B.default.weight"] == ["Replicate()"]


# ------------------------------------------------------------------ refusals
@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("overrides", "named"), [
    (["parallel.pp=2"], "model.lora.enabled=true cannot be used with parallel.pp=2 yet"),
    (["parallel.tp=2", "model.lora.dropout=0.1"], "model.lora.dropout=0.1 cannot be used with parallel.tp=2 yet"),
])
def test_what_lora_is_not_built_for_is_refused_before_launch(overrides, named) -> None:
    from dptrain.config.resolve import validate

    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        validate(load_config(None, ["model.lora.enabled=true", *overrides]))
    validate(load_config(None, ["model.lora.enabled=true", "parallel.tp=2"]))  # tp itself is fine now


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_a_lora_layer_the_plan_cannot_split_is_named() -> None:
    """A DoRA layer (a LoRA variant) under a tp plan: refused naming the layer, not split wrong."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from dptrain.models.lora_parallel import lora_tp_plan

    net = torch.nn.Sequential(torch.nn.Linear(8, 8))
    dora = peft.get_peft_model(net, peft.LoraConfig(r=2, target_modules=["0"], use_dora=True)).get_base_model()
    with pytest.raises(ValueError, match=r"'0' has DoraLinearVariant"):
        lora_tp_plan(dora, {"0": ColwiseParallel()})
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert list(lora_tp_plan(plain, {"0": ColwiseParallel()})) == ["0"]


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_a_lora_model_that_cannot_be_split_is_refused_by_its_base_models_numbers() -> None:
    """Before launch the PEFT model is judged by its base model's plan (built-in LLaMA, HF): the numbers named."""
    from dptrain.parallel.tensor import tp_problem
    from dptrain.train.build import build_model_meta

    cfg = ModelConfig(factory="dptrain.models.llama:build_llama", kwargs={**LLAMA, "n_heads": 4, "dim": 48},
                      lora=LoraConfig(enabled=True, rank=RANK))
    model, _ = build_model_meta(cfg, seed=SEED)
    assert tp_problem(model, tp=2, tp_plan=None, sequence_parallel=True) is None
    why = tp_problem(model, tp=3, tp_plan=None, sequence_parallel=True)
    assert why is not None and why.startswith("model.kwargs.n_heads=4 is not divisible by parallel.tp=3")
    hf_cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=3, num_key_value_heads=3)
    with torch.device("meta"):
        hf_lora = peft.get_peft_model(transformers.LlamaForCausalLM(hf_cfg),
                                      peft.LoraConfig(r=2, task_type="CAUSAL_LM"))
    why = tp_problem(hf_lora, tp=2, tp_plan=None, sequence_parallel=True)
    assert why is not None and "config.num_attention_heads=3 is not divisible by parallel.tp=2" in why
