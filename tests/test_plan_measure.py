"""`dptrain plan` for users' models (plan/measure.py, memory.profile_memory, timing.profile_step_time,
plan/measured.py): the fake-tensor measurement against the same measurement on real tensors and
against plan/llama.py's formulas, no real allocation for a 20B model, memory predicted vs measured
on 2 gloo ranks, and the CLI."""

from __future__ import annotations

import dataclasses
import os
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from dptrain import api
from dptrain.cli.main import main
from dptrain.config import DataConfig, ModelConfig, OptimConfig
from dptrain.config.load import load_config
from dptrain.metrics import hardware as specs
from dptrain.models.llama import LlamaConfig
from dptrain.tools.plan import memory, timing
from dptrain.tools.plan.llama import activation_bytes, activation_parts, param_counts
from dptrain.tools.plan.measure import MeasureError, measure_model, profile_module
from dptrain.tools.plan.predict import predict
from dptrain.train.build import build_datasets, build_model
from dptrain.train.optim import build_optimizer
from support.fsdp_alive import fsdp_llama_memory
from support.mp import run_ranks

MLP = ModelConfig(factory="dptrain.models.toy:build_mlp", kwargs={"in_dim": 16, "hidden": 48, "depth": 3})
REGRESSION = DataConfig(factory="dptrain.models.toy:build_regression_data", kwargs={"n": 32})
CNN = ModelConfig(factory="support.plan_models:build_cnn", kwargs={})
IMAGES = DataConfig(factory="support.plan_models:build_images", kwargs={})
LLAMA_KW = {"vocab_size": 256, "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32}
LLAMA = ModelConfig(factory="dptrain.models.llama:build_llama", kwargs=LLAMA_KW)
TOKENS = DataConfig(factory="support.plan_models:build_tokens", kwargs={"seq_len": 24})
CASES = {"mlp": (MLP, REGRESSION), "cnn": (CNN, IMAGES), "llama": (LLAMA, TOKENS)}


def _real(model_cfg: ModelConfig, data_cfg: DataConfig, *, micro_batch: int, precision: str):
    """The same measurement on a real model (seeded as the fake one) and a real batch of the first sample."""
    model = build_model(model_cfg, seed=0)
    train, _ = build_datasets(data_cfg)
    batch = default_collate([train[0]] * micro_batch)
    return profile_module(model, batch, micro_batch=micro_batch, precision=precision, factory=model_cfg.factory,
                          seq_len=getattr(train, "seq_len", None))


@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fake_measurement_equals_the_real_one(case, precision):
    model_cfg, data_cfg = CASES[case]
    fake = measure_model(model=model_cfg, data=data_cfg, micro_batch=3, precision=precision)
    real = _real(model_cfg, data_cfg, micro_batch=3, precision=precision)
    if case == "cnn" and precision != "fp32":
        # batch norm on bf16 input: the CPU kernel saves its mean and invstd in fp32, PyTorch's meta
        # kernel (fake tensors) in the input's dtype: 2 x 8 channels x 2 bytes less per block
        assert [r - f for r, f in zip(real.block_recompute_bytes, fake.block_recompute_bytes, strict=True)] == [
            32,
            32,
            32,
        ]
        real = dataclasses.replace(
            real, saved_bytes=real.saved_bytes - 96, block_recompute_bytes=fake.block_recompute_bytes
        )
    assert fake == real  # every count, exactly: parameters, saved bytes per block, FLOPs, FSDP units
    assert fake.saved_bytes > 0 and fake.flops > 0 and len(fake.block_recompute_bytes) == 3
    assert fake.activation_bytes("full") < fake.activation_bytes("none")
    assert fake.training_flops("full") == fake.flops + fake.block_forward_flops > fake.flops


@pytest.mark.fast
@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_hugging_face_models_fake_equals_real(name):
    pytest.importorskip("transformers", reason="transformers is not installed (the optional extra)")
    # dict batches with labels (the token rule: num_items_in_batch), tied embeddings, T5's two stacks
    model_cfg = ModelConfig(factory=f"support.hf:tiny_{name}", kwargs={})
    data_cfg = DataConfig(factory="support.hf:hf_batches", kwargs={"seq2seq": name == "t5"})
    fake = measure_model(model=model_cfg, data=data_cfg, micro_batch=4, precision="bf16")
    assert fake == _real(model_cfg, data_cfg, micro_batch=4, precision="bf16")
    # llama: 2 blocks + its untied input and output embeddings (units of their own); gpt2 (tied): 2 blocks; t5: 4 blocks
    assert fake.units == {"llama": 4, "gpt2": 2, "t5": 4}[name] and fake.saved_bytes > 0 and fake.flops > 0


@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_llama_measured_equals_the_formulas(precision):
    cfg = LlamaConfig(**LLAMA_KW)
    B, T = 3, 24
    prof = measure_model(model=LLAMA, data=TOKENS, micro_batch=B, precision=precision)
    counts = param_counts(cfg)
    assert prof.params == prof.trainable == counts.total and prof.param_bytes == 4 * counts.total
    largest_unit = max(counts.block, counts.embedding + counts.final_norm + counts.head)  # a block, or the root's
    assert prof.largest_unit_bytes == 4 * largest_unit and prof.units == cfg.n_layers
    assert prof.activation_bytes("none") == activation_bytes(cfg, batch=B, seq=T, precision=precision)
    # full checkpointing: every block's input + one block recomputed, its input counted once
    full = activation_bytes(cfg, batch=B, seq=T, precision=precision, checkpointing="full")
    assert prof.activation_bytes("full") == full
    # measured FLOPs vs the 6N + 12 L d T model (counts the norms' and the head's N, not the SDPA's causal half)
    model_flops = B * T * (6 * (counts.total - counts.embedding) + 12 * cfg.n_layers * cfg.dim * T)
    assert prof.flops == pytest.approx(model_flops, rel=0.10)
    lay = memory.Layout(
        strategy="fsdp", dp_shard=4, tp=1, pp=1, micro_batch=B, seq=T, precision=precision, optimizer="adamw"
    )
    # the same but for the loss's backward temporaries, which the LLaMA's formulas know (its vocabulary) and a
    # measured model's report does not count
    want = memory.layout_memory(cfg, lay)
    loss = memory.loss_backward_bytes(cfg, batch=B, seq=T)
    want = {**want, "temporary": want["temporary"] - loss, "total": want["total"] - loss, "stage": 0}
    assert memory.profile_memory(prof, lay) | {"stage": 0} == want


def _peak_above_start(model: torch.nn.Module, batch) -> int:
    """Peak bytes allocated on the CPU during one forward and backward above what was allocated before
    (the parameters and, zeroed in place beforehand, the gradients), from torch.profiler's memory timeline."""
    import json
    import tempfile
    import warnings

    from torch.profiler import ProfilerActivity, profile

    model(batch).backward()  # warm-up; the gradients now exist, so backward allocates no new ones
    model.zero_grad(set_to_none=False)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        model(batch).backward()
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", FutureWarning
        )  # export_memory_timeline: deprecated in favour of CUDA-only tools
        prof.export_memory_timeline(f"{d}/timeline.json", device="cpu")
        with open(f"{d}/timeline.json") as f:
            _, sizes = json.load(f)
    totals = [sum(s) for s in sizes]
    return max(totals) - totals[0]


@pytest.mark.fast
@pytest.mark.timeout(90)
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_llama_activations_match_the_profilers_peak(checkpointing):
    from dptrain.parallel.activation_checkpointing import apply_activation_checkpointing

    kw = {"vocab_size": 256, "dim": 256, "n_layers": 4, "n_heads": 4, "max_seq_len": 64}
    model_cfg = ModelConfig(factory="dptrain.models.llama:build_llama", kwargs=kw)
    prof = measure_model(
        model=model_cfg,
        data=DataConfig(factory="support.plan_models:build_tokens", kwargs={"seq_len": 64}),
        micro_batch=4,
        precision="fp32",
    )
    model = build_model(model_cfg, seed=0)
    apply_activation_checkpointing(model, mode=checkpointing)
    peak = _peak_above_start(model, torch.randint(0, 256, (4, 65)))
    # measured on torch 2.13 CPU: none +2.6%, full +8.6% (backward temporaries, not saved tensors)
    assert peak == pytest.approx(prof.activation_bytes(checkpointing), rel=0.10)
    assert peak >= prof.activation_bytes(checkpointing)


@pytest.mark.fast
@pytest.mark.timeout(90)
def test_a_20b_parameter_model_is_measured_without_allocating():
    proc = psutil.Process(os.getpid())
    huge = ModelConfig(factory="dptrain.models.toy:build_mlp", kwargs={"in_dim": 16, "hidden": 16384, "depth": 76})
    before, t0 = proc.memory_info().rss, time.perf_counter()
    prof = measure_model(model=huge, data=REGRESSION, micro_batch=8, precision="bf16")
    seconds, grown = time.perf_counter() - t0, proc.memory_info().rss - before
    h = 16384  # Linear(16, h), 75 x Linear(h, h), Linear(h, 4), with biases
    assert prof.params == 17 * h + 75 * (h * h + h) + 4 * h + 4 > 2e10
    assert prof.param_bytes == 4 * prof.params  # 80 GB of fp32 weights, more than this machine has
    assert prof.activation_bytes() > 2 * prof.params  # autocast's bf16 copy of every weight
    assert grown < 300e6, f"RSS grew by {grown / 1e6:.0f} MB"
    assert seconds < 60, seconds
    mem = memory.profile_memory(
        prof,
        memory.Layout(
            strategy="fsdp", dp_shard=64, tp=1, pp=1, micro_batch=8, seq=0, precision="bf16", optimizer="adamw"
        ),
    )
    assert mem["params"] == mem["grads"] == prof.param_bytes / 64 and mem["optimizer"] == 2 * prof.param_bytes / 64


def _saved_after_backward(module: torch.nn.Module, batch) -> int:
    """Bytes autograd saved in one forward (each storage once, parameters excluded) that are still
    allocated after backward: FSDP2 frees the unsharded parameters it saved (`temporary` in the
    plan), the activations stay alive as long as they are referenced."""
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    seen = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in params:
            seen[t.untyped_storage()._cdata] = t.untyped_storage()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module(batch)
    loss.backward()
    return sum(s.nbytes() for s in seen.values())


def _states_and_activations(
    rank: int, cases: dict[str, tuple[ModelConfig, DataConfig, list[str]]], micro_batch: int
) -> dict[tuple[str, str], dict[str, int]]:
    """Per model and strategy: this rank's bytes of parameters, gradients and AdamW state after
    one real step, and the activations autograd saved in that step's forward."""
    import torch.distributed as dist

    from dptrain import api
    from support.mp import local_bytes

    api.init_distributed(device="cpu")
    out = {}
    try:
        for name, (model_cfg, data_cfg, strategies) in cases.items():
            train, _ = build_datasets(data_cfg)
            batch = default_collate([train[i] for i in range(micro_batch)])
            for strategy in strategies:
                pm = api.parallelize(build_model(model_cfg, seed=0), strategy=strategy, device=torch.device("cpu"))
                opt = build_optimizer(pm, cfg=OptimConfig(), lr=1e-3)  # a run's AdamW and param groups
                saved = _saved_after_backward(pm.module, batch)
                opt.step()
                inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer holds the rank's shard in .optim
                params = list(pm.module.parameters())
                out[name, strategy] = {
                    "params": sum(local_bytes(p) for p in params),
                    "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
                    "optimizer": sum(local_bytes(v) for s in inner.state.values() for v in s.values() if v.dim() > 0),
                    "activations": saved,
                }
                pm.release()
    finally:
        dist.destroy_process_group()
    return out


STRATEGIES = ["ddp", "zero1", "zero2", "fsdp"]
MEASURED_CASES = {"mlp": (MLP, REGRESSION, STRATEGIES), "cnn": (CNN, IMAGES, STRATEGIES)}


@pytest.mark.timeout(150)
def test_measured_model_memory_predicted_vs_measured_on_2_ranks():
    from support.mp import run_ranks

    measured = run_ranks(_states_and_activations, 2, MEASURED_CASES, 4, timeout=130)
    for name, (model_cfg, data_cfg, strategies) in MEASURED_CASES.items():
        prof = measure_model(model=model_cfg, data=data_cfg, micro_batch=4, precision="fp32")
        for strategy in strategies:
            lay = memory.Layout(
                strategy=strategy, dp_shard=2, tp=1, pp=1, micro_batch=4, seq=0, precision="fp32", optimizer="adamw"
            )
            mem = memory.profile_memory(prof, lay)
            for rank in range(2):
                for key, got in measured[rank][name, strategy].items():
                    if strategy == "zero1" and key == "optimizer":
                        continue  # ZeroRedundancyOptimizer's uneven partition: the most loaded rank, below
                    assert mem[key] == pytest.approx(got, rel=0.10), (name, strategy, rank, key, got, mem[key])
            if strategy == "zero1":  # whole tensors per rank: the plan gives the larger share, exactly
                assert mem["optimizer"] == max(measured[r][name, strategy]["optimizer"] for r in range(2))


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_profile_step_time_follows_the_alpha_beta_rules():
    prof = measure_model(model=MLP, data=REGRESSION, micro_batch=4, precision="bf16")
    h100 = specs.gpu_spec("H100")
    lay = memory.Layout(
        strategy="ddp", dp_shard=1, tp=1, pp=1, micro_batch=4, seq=0, precision="bf16", optimizer="adamw"
    )
    one = timing.profile_step_time(prof, lay, h100, gpus=1, nodes=1, interconnect="nvlink", accum=2, efficiency=0.5)
    assert one["compute"] == pytest.approx(2 * prof.flops / (989.5e12 * 0.5)) and one["dp_comm"] == 0
    assert one["mfu"] == pytest.approx(0.5) and one["samples_per_s"] == pytest.approx(8 / one["step"])
    eth = timing.profile_step_time(prof, lay, h100, gpus=4, nodes=4, interconnect="ethernet", accum=2, efficiency=0.5)
    link = timing.Link(12.5e9, 30e-6)
    buckets = timing.ddp_buckets(prof.param_bytes, lay.bucket_cap_mb)  # DDP's buckets, as for the LLaMA
    busy, exposed = timing.bucket_overlap(buckets, 4, link, backward=2 / 3 * eth["compute"] / 2)
    assert eth["dp_comm"] == pytest.approx(busy) and eth["exposed_comm"] == pytest.approx(exposed)
    assert eth["step"] == pytest.approx(eth["compute"] + exposed)
    fsdp = dataclasses.replace(lay, strategy="fsdp", dp_shard=4)
    t = timing.profile_step_time(prof, fsdp, h100, gpus=4, nodes=4, interconnect="ethernet", accum=2, efficiency=0.5)
    # two gathers per micro-step (forward, backward), one reduce-scatter on the last
    assert t["dp_comm"] == pytest.approx((2 * 2 + 1) * timing.gather_time(prof.param_bytes, 4, link))


MLP_KW = {"in_dim": 16, "hidden": 2048, "depth": 4}
MLP_ARGS = [
    "model.factory=dptrain.models.toy:build_mlp",
    "model.kwargs={in_dim: 16, hidden: 2048, depth: 4}",
    "data.factory=dptrain.models.toy:build_regression_data",
    "data.kwargs={n: 64}",
]


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_cli_reports_a_measured_model_and_names_a_broken_factory(capsys):
    assert (
        main(
            [
                "plan",
                "--gpus",
                "2",
                "--gpu-type",
                "L40S",
                *MLP_ARGS,
                "parallel.strategy=fsdp",
                "precision.dtype=bf16",
                "train.micro_batch_size=8",
                "train.grad_accum_steps=2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    prof = measure_model(
        model=ModelConfig(factory="dptrain.models.toy:build_mlp", kwargs=MLP_KW),
        data=REGRESSION,
        micro_batch=8,
        precision="bf16",
    )
    assert "measured on fake tensors" in out and f"{prof.params:,} parameters" in out and prof.params > 12e6
    assert "fsdp on 2 x L40S" in out and "micro-batch 8 samples" in out and "samples/s" in out and "MFU" in out
    lay = memory.Layout(
        strategy="fsdp", dp_shard=2, tp=1, pp=1, micro_batch=8, seq=0, precision="bf16", optimizer="adamw"
    )
    mem = memory.profile_memory(prof, lay)
    for key in ("params", "grads", "optimizer", "activations", "temporary", "total"):
        assert f"  {key:<12}{mem[key] / 1e9:>10.3f}" in out, key
    assert mem["activations"] > 0.02e9 and "fits" in out
    assert f"checkpointing none {prof.activation_bytes('none') / 1e9:.4g} GB, full" in out
    t = timing.profile_step_time(
        prof, lay, specs.gpu_spec("L40S"), gpus=2, nodes=1, interconnect="ib", accum=2, efficiency=0.4
    )
    assert f"step {t['step']:.4g} s" in out
    assert (
        main(
            [
                "plan",
                "--gpus",
                "2",
                "model.factory=support.bad_factories:raising_model",
                "model.kwargs={}",
                *MLP_ARGS[2:],
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "'support.bad_factories:raising_model'" in err and "user bug: cannot build 4 layers" in err
    assert main(["plan", "--gpus", "2", *MLP_ARGS, "parallel.strategy=fsdp", "parallel.tp=2"]) == 2
    assert "tp=2" in capsys.readouterr().err
    with pytest.raises(MeasureError, match="data.factory 'support.bad_factories:raising_data'"):
        measure_model(
            model=MLP,
            data=DataConfig(factory="support.bad_factories:raising_data", kwargs={}),
            micro_batch=2,
            precision="fp32",
        )


def _fsdp_paths(rank: int, kw: dict, batch: torch.Tensor) -> dict[str, dict[str, int]]:
    api.init_distributed(device="cpu")
    try:
        out = {pdt: fsdp_llama_memory(kw, batch[rank], param_dtype=pdt) for pdt in ("fp32", "bf16")}
        out["bf16 selective_torchtitan"] = fsdp_llama_memory(kw, batch[rank], param_dtype="bf16",
                                                             activation_checkpointing="selective_torchtitan")
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_pure_bf16_fsdp_memory_predicted_vs_measured_on_2_ranks():
    """`dptrain plan`'s model states and activations for fsdp under bf16, with the parameters gathered in fp32
    (autocast) and in bf16 (fsdp_param_dtype), the latter also under torchtitan's selective checkpointing, against a
    real FSDP2 step on 2 gloo ranks."""
    B, T = 3, 24
    batch = torch.randint(0, LLAMA_KW["vocab_size"], (2, B, T + 1), generator=torch.Generator().manual_seed(0))
    measured = run_ranks(_fsdp_paths, 2, LLAMA_KW, batch, timeout=80)
    for name in ("fp32", "bf16", "bf16 selective_torchtitan"):
        pdt, _, ckpt = name.partition(" ")
        cfg = load_config(None, [
            *(f"model.kwargs.{k}={v}" for k, v in LLAMA_KW.items()), f"data.kwargs.seq_len={T}",
            "parallel.strategy=fsdp", "precision.dtype=bf16", f"parallel.fsdp_param_dtype={pdt}",
            "parallel.fsdp_reduce_dtype=fp32", f"train.micro_batch_size={B}", f"train.global_batch_size={2 * B}",
            f"parallel.activation_checkpointing={ckpt or 'none'}",
        ])
        want = predict(cfg, gpus=2, nodes=1, gpu_type="H100", interconnect="ib", comm=None, efficiency=0.5).memory
        # what the forward keeps: the plan's activations less one block's recompute working set (backward's)
        _, work = activation_parts(LlamaConfig(**LLAMA_KW), batch=B, seq=T, precision="bf16",
                                   checkpointing=ckpt or "none", param_dtype=pdt)
        want["activations"] -= work
        for rank in range(2):
            for key, got in measured[rank][name].items():
                assert want[key] == pytest.approx(got, rel=0.10), (name, rank, key, got, want[key])
    # the pure path saves no bf16 weight copies and keeps a bf16 residual stream
    assert measured[0]["bf16"]["activations"] < 0.9 * measured[0]["fp32"]["activations"]
    assert measured[0]["bf16 selective_torchtitan"]["activations"] < 0.7 * measured[0]["bf16"]["activations"]
