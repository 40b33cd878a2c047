"""`dptrain plan` against published runs (plan/published.py, published_runs.py, gpt.py, efficiency.py): the share
of rows within the issue's bounds (memory 15%, throughput 20%), the one sustained factor derived from its reference
run, Korthikanti et al.'s activation formulas, DeepSpeed's own estimators, Megatron's tied embedding, the 96 GB
H100, and the CLI's modelled efficiency and --gpu-memory."""

from __future__ import annotations

import pytest

from dptrain.cli.main import main
from dptrain.metrics.hardware import gpu_spec, with_memory
from dptrain.tools.plan import efficiency, gpt, published
from dptrain.tools.plan.memory import zero_states
from dptrain.tools.plan.published_runs import MPT_REFERENCE, checked_throughput, mpt, runs, torchtitan_memory

pytestmark = pytest.mark.fast
GB = 1e9


def _throughput_errors() -> list[tuple[str, float]]:
    out = []
    for run in filter(checked_throughput, runs()):
        tokens = published.tokens_per_gpu(run)
        pred, pub = (published.mfu(run, tokens), run.mfu) if run.mfu is not None else (tokens, run.tokens_per_gpu)
        out.append((run.name, pred / pub - 1))
    return out


@pytest.mark.timeout(60)
def test_the_sustained_factor_is_what_its_reference_run_gives_and_that_run_is_not_checked():
    ref = mpt(MPT_REFERENCE)
    assert efficiency.SUSTAINED == pytest.approx(published.sustained_from(ref), abs=1e-3)
    assert published.tokens_per_gpu(ref) == pytest.approx(MPT_REFERENCE[6], rel=1e-3)
    assert ref.name not in {r.name for r in runs()}


@pytest.mark.timeout(60)
def test_throughput_within_20_percent_on_at_least_80_percent_of_published_rows():
    errors = _throughput_errors()
    inside = [name for name, err in errors if abs(err) <= 0.20]
    assert len(errors) >= 50
    assert len(inside) / len(errors) >= 0.80, [(n, f"{e:+.1%}") for n, e in errors if abs(e) > 0.20]
    torchtitan = [err for name, err in errors if name.startswith("torchtitan")]
    assert len(torchtitan) == 4 and all(abs(e) <= 0.20 for e in torchtitan)


@pytest.mark.timeout(60)
def test_torchtitan_8b_fits_its_96_gb_h100s_within_15_percent_of_the_published_memory():
    rows = [r for r in runs() if r.memory is not None and r.cp == 1 and "table 2" not in r.source]
    assert len(rows) == 4
    for r in rows:
        predicted = torchtitan_memory(r)
        assert predicted == pytest.approx(r.memory, rel=0.15), (r.name, predicted / 2**30, r.memory / 2**30)
        assert predicted < gpu_spec("H100-96GB").memory_gb * GB  # "fits"


@pytest.mark.timeout(60)
def test_torchtitan_long_sequences_keep_the_memory_per_gpu_flat_as_cp_grows_with_the_row():
    """Table 2 (32,768 tokens per GPU at CP 1, 2, 4, 8): published 83.9-84.5 GiB, flat within 1%; the prediction is
    flat too (the rank's tokens are the same; only the gathered K/V of the block in backward grows) but 24% low: a
    gap the issue's 15% does not cover, documented in docs/results/planner.md (max reserved at 32K-token tensors,
    Float8's copies; neither modelled)."""
    rows = sorted((r for r in runs() if "table 2" in r.source), key=lambda r: r.cp)
    assert [r.cp for r in rows] == [1, 2, 4, 8] and all(not checked_throughput(r) for r in rows)
    predicted = [torchtitan_memory(r) for r in rows]
    published_ = [r.memory for r in rows]
    assert max(published_) / min(published_) < 1.01 and max(predicted) / min(predicted) < 1.02
    assert predicted == sorted(predicted)  # the gathered K/V of the whole row grow with it
    for p, q in zip(predicted, published_, strict=True):
        assert 0.70 < p / q < 0.80, (p / 2**30, q / 2**30)


@pytest.mark.timeout(30)
def test_korthikanti_activation_formulas_and_first_stage_memory():
    s, b, h, a = 2048, 1, 12288, 96
    assert gpt.megatron_layer_bytes(s=s, b=b, h=h, a=a) == s * b * h * (34 + 5 * a * s / h)
    assert gpt.megatron_layer_bytes(s=s, b=b, h=h, a=a, t=8) == pytest.approx(
        s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert gpt.megatron_layer_bytes(s=s, b=b, h=h, a=a, t=8, sp=True) == pytest.approx(
        s * b * h / 8 * (34 + 5 * a * s / h))
    assert gpt.megatron_layer_bytes(s=s, b=b, h=h, a=a, t=8, sp=True, recompute="selective") == pytest.approx(
        34 * s * b * h / 8)
    assert gpt.megatron_layer_bytes(s=s, b=b, h=h, a=a, recompute="full") == 2 * s * b * h
    # GPT-3 175B / 530B / 1T (Korthikanti et al. table 3): about 10, 19 and 29 GB on the first stage
    for (hh, aa, layers, p), want in zip([(12288, 96, 96, 8), (20480, 128, 105, 35), (25600, 160, 128, 64)],
                                         [10.3, 18.7, 28.5], strict=True):
        blk = gpt.Block(h=hh, a=aa, layers=layers, ffn=4 * hh, kv=hh, vocab=51200)
        got = gpt.megatron_first_stage_bytes(s=2048, b=1, blk=blk, t=8, p=p, m=4 * p, sp=True, recompute="selective")
        assert got / GB == pytest.approx(want, abs=0.05)


@pytest.mark.timeout(30)
def test_megatron_holds_the_tied_embedding_on_the_first_and_last_stage():
    blk = gpt.Block(h=1024, a=16, layers=8, ffn=4096, kv=1024, vocab=50304)
    stages = [gpt.megatron_stage_params(blk, seq=1024, t=2, p=4, stage=i) for i in range(4)]
    one = gpt.megatron_stage_params(blk, seq=1024, t=2, p=1, stage=0)
    assert sum(stages) == pytest.approx(one + blk.vocab * blk.h / 2)  # the copy on the last stage
    assert stages[0] - stages[1] == pytest.approx(blk.vocab * blk.h / 2 + 1024 * blk.h)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("params,largest,gpus,offload", [(7.5e9, 2.1e8, 64, "none"), (1.3e9, 5e7, 8, "none"),
                                                         (6.7e9, 1.3e8, 16, "optimizer"),
                                                         (6.7e9, 1.3e8, 16, "optimizer+params")])
def test_deepspeed_convention_equals_deepspeeds_own_estimators(params, largest, gpus, offload):
    stage12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    _, z2 = stage12.estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=gpus,
                                                          cpu_offload=offload != "none")
    _, z3, _ = stage3.estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=gpus,
                                                            cpu_offload=offload != "none",
                                                            cpu_offload_params=offload == "optimizer+params")
    assert gpt.deepspeed_zero2_gpu_bytes(params, gpus, offload=offload != "none") == z2
    assert gpt.deepspeed_zero3_gpu_bytes(params, largest, gpus, offload=offload) == z3
    assert zero_states(params=7.5e9, gpus=64, optimizer="adam", precision="fp16")[2] != z2  # a different convention


@pytest.mark.timeout(30)
def test_the_96_gb_h100_says_its_peak_is_estimated_and_gpu_memory_overrides(capsys):
    spec = gpu_spec("H100-96GB")
    assert gpu_spec("H100-NVL").peaks["bf16"] < spec.peaks["bf16"] < gpu_spec("H100-SXM").peaks["bf16"]
    assert "between" in spec.note and spec.memory_gb == 96 and spec.hbm_gbps == 2400
    assert with_memory(gpu_spec("H100"), 96).memory_gb == 96
    assert main(["plan", "--params", "7.5e9", "--gpus", "64", "--gpu-memory", "0"]) == 2
    assert main(["plan", "--params", "7.5e9", "--gpus", "64", "--convention", "deepspeed", "--largest-layer",
                 "2.1e8"]) == 0
    out = capsys.readouterr().out
    assert "DeepSpeed" in out and "3 (+ parameters)" in out


@pytest.mark.timeout(120)
def test_cli_models_the_efficiency_and_efficiency_overrides_it(capsys):
    base = ["plan", "--model", "llama3-8b", "parallel.strategy=fsdp", "precision.dtype=bf16",
            "train.micro_batch_size=2", "train.global_batch_size=16", "parallel.activation_checkpointing=selective",
            "parallel.fsdp_param_dtype=bf16", "--gpus", "8", "--gpu-type", "H100-96GB"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "modelled per layout" in out and "between H100 NVL" in out
    assert main([*base, "--efficiency", "0.5"]) == 0
    assert "compute at 0.5 x the dense peak, assumed (--efficiency)" in capsys.readouterr().out
    assert main([*base, "--gpu-memory", "141"]) == 0
    assert "of 141 GB: fits" in capsys.readouterr().out
