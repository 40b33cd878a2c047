"""`dptrain plan --recommend / --write / --model` (plan/search.py, plan/recommend.py, plan/presets.py):
the ranking, rejections with dptrain's own messages, a written recipe that `dptrain run` trains, the
presets' published parameter counts, bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dptrain.cli.main import main
from dptrain.config.fields import ConfigError
from dptrain.config.load import load_config
from dptrain.config.resolve import resolve
from dptrain.metrics import hardware as specs
from dptrain.models.llama import LlamaConfig, LlamaLM
from dptrain.parallel.tensor import tp_problem
from dptrain.tools.plan import presets, search, timing
from dptrain.tools.plan.llama import param_counts
from dptrain.tools.plan.memory import GB, layout_memory
from dptrain.tools.plan.recommend import load_plan_config
from dptrain.tools.plan.timing import step_time
from support import ROOT, subprocess_env

TINY = ["model.kwargs.dim=32", "model.kwargs.n_layers=2", "model.kwargs.n_heads=2", "model.kwargs.max_seq_len=32",
        "data.kwargs.seq_len=32", "train.global_batch_size=8", "train.log_every_steps=1", "train.eval_every_steps=0",
        "train.eval_batches=1"]


def _search(cfg, model, spec, *, gpus, nodes=1, global_batch):
    seq = int(cfg.data.kwargs.get("seq_len", model.max_seq_len))
    return search.search(cfg, model, spec, gpus=gpus, nodes=nodes, interconnect="ib", global_batch=global_batch,
                         seq=seq, efficiency=None), seq  # the CLI default: modelled


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_search_ranks_by_predicted_time_and_lists_layout_memory():
    cfg = load_config(None, ["precision.dtype=bf16"])
    model = LlamaConfig(**cfg.model.kwargs)
    spec = specs.gpu_spec("A100-40GB")
    result, seq = _search(cfg, model, spec, gpus=4, nodes=2, global_batch=16)
    everything = list(search.candidates(model, gpus=4, per_node=2, global_batch=16, half="bf16", seq=seq))
    assert len(result.ranked) + len(result.rejected) == len(everything) and len(result.ranked) > 20
    steps = [r.step_s for r in result.ranked]
    assert steps == sorted(steps) and steps[0] < steps[-1]
    for r in result.ranked:
        resolved = resolve(r.cfg, world_size=4, cuda_available=True)  # dptrain accepts every listed layout
        lay = search.layout_from_config(r.cfg, resolved, seq=seq)
        assert r.memory == layout_memory(model, lay) and r.memory["total"] <= spec.memory_gb * GB
        t = step_time(model, lay, spec, gpus=4, nodes=2, interconnect="ib", accum=resolved.grad_accum_steps,
                      efficiency=None)
        assert r.time == t and r.step_s == t["step"]
        assert (t["offload"] > 0) == r.cand.cpu_offload
        assert (timing.fsdp_gathers(lay) > 2) == (r.cand.strategy == "fsdp" and r.cand.pp > 1)
        assert (r.cand.tp, r.cand.pp, r.cand.dp) == (resolved.dims.tp, resolved.dims.pp, resolved.dp_world_size)
    assert any(r.cand.cpu_offload for r in result.ranked) and any(r.cand.strategy == "fsdp" and r.cand.pp > 1
                                                                  for r in result.ranked)


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_rejections_name_the_memory_or_dptrains_own_message():
    p = presets.preset("llama2-7b")
    cfg = load_plan_config(["precision.dtype=bf16"], model="llama2-7b")
    model = LlamaConfig(**p.kwargs)
    spec = specs.gpu_spec("RTX4090")
    result, seq = _search(cfg, model, spec, gpus=8, nodes=1, global_batch=8)
    too_big = [r for r in result.rejected if r.memory is not None]
    assert too_big and not [r for r in result.ranked if r.cand.strategy == "ddp" and r.cand.tp == r.cand.pp == 1]
    for r in too_big[:50]:
        c = search.candidate_config(cfg, r.cand, global_batch=8)
        lay = search.layout_from_config(c, resolve(c, world_size=8, cuda_available=True), seq=seq)
        total = layout_memory(model, lay)["total"]
        assert r.memory == total > 24 * GB and f"{total / GB:.1f} GB > RTX 4090's 24 GB" in r.reason
    refused = [r for r in result.rejected if r.memory is None]
    zero1_tp = next(r for r in refused if r.cand.strategy == "zero1" and r.cand.tp > 1)
    with pytest.raises(ConfigError) as e:
        resolve(search.candidate_config(cfg, zero1_tp.cand, global_batch=8), world_size=8, cuda_available=True)
    assert zero1_tp.reason == str(e.value)
    # the launcher's tensor-parallel check: 4 heads cannot be split over tp=8
    small = load_config(None, ["precision.dtype=bf16"])
    result, _ = _search(small, LlamaConfig(**small.model.kwargs), spec, gpus=8, global_batch=8)
    with torch.device("meta"):
        meta = LlamaLM(LlamaConfig(**small.model.kwargs))
    expected = tp_problem(meta, tp=8, tp_plan=None, sequence_parallel=True, seq_len=128)
    assert expected and {r.reason for r in result.rejected if r.cand.tp == 8 and r.cand.strategy != "zero1"} == {
        expected
    }


@pytest.mark.timeout(300)
def test_write_recipe_is_trained_by_dptrain_run(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    env = subprocess_env(tests=False)
    argv = [
        "plan",
        *TINY,
        "optim.lr=0.002",
        "train.max_steps=2",
        "--gpus",
        "2",
        "--gpu-type",
        "A100-40GB",
        "--write",
        str(recipe),
    ]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    written = load_config(recipe)
    base = load_config(None, [*TINY, "optim.lr=0.002", "train.max_steps=2"])
    model = LlamaConfig(**base.model.kwargs)
    result, _ = _search(base, model, specs.gpu_spec("A100-40GB"), gpus=2, global_batch=8)
    best = result.ranked[0]
    assert f"wrote {recipe}: {best.cand.label()}" in stdout
    assert written.parallel == best.cfg.parallel and written.train == best.cfg.train  # the chosen layout
    assert written.optim.lr == 0.002 and written.launch.nproc_per_node == 2  # the user's other fields kept
    out = tmp_path / "run"
    run = subprocess.run(
        [sys.executable, "-m", "dptrain", "run", str(recipe), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "dptrain run summary" in run.stdout and (out / "summary.json").is_file()


@pytest.mark.timeout(120)
def test_presets_have_the_published_parameter_counts():
    published_b = {
        "llama-7b": 6.74,
        "llama2-7b": 6.74,
        "llama2-13b": 13.02,
        "llama2-70b": 68.98,
        "llama3-8b": 8.03,
        "llama3-70b": 70.55,
        "llama3-405b": 405.85,
    }
    assert set(presets.PRESETS) == set(published_b)
    for name, p in presets.PRESETS.items():
        n = param_counts(LlamaConfig(**p.kwargs)).total
        assert n == p.published and round(n / 1e9, 2) == published_b[name], name
    with torch.device("meta"):
        llama3 = LlamaLM(LlamaConfig(**presets.preset("llama3-8b").kwargs))
    assert sum(t.numel() for t in llama3.parameters()) == 8_030_261_248
    code = (
        "import sys, dptrain.tools.plan.presets, dptrain.tools.plan.search, dptrain.tools.plan.recommend; "
        "import dptrain.cli.plan; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=subprocess_env(tests=False))


@pytest.mark.timeout(60)
def test_model_preset_is_the_lowest_layer(tmp_path):
    cfg = load_plan_config(["model.kwargs.n_layers=2"], model="llama3-8b")
    assert cfg.model.kwargs == {**presets.preset("llama3-8b").kwargs, "n_layers": 2}
    assert cfg.data.kwargs["seq_len"] == 8192
    recipe = tmp_path / "c.yaml"
    recipe.write_text("data:\n  kwargs:\n    seq_len: 1024\noptim:\n  lr: 0.0001\n")
    cfg = load_plan_config([str(recipe), "train.global_batch_size=64"], model="LLaMA2-7B")
    assert cfg.data.kwargs["seq_len"] == 1024 and cfg.optim.lr == 1e-4 and cfg.model.kwargs["dim"] == 4096
    assert cfg.train.global_batch_size == 64


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_bad_input_exits_2_naming_the_value(capsys, tmp_path):
    cases = [
        (["--recommend", "--top", "0"], ["--top 0"]),
        (["--recommend", "--model", "gpt5"], ["'gpt5'", "llama2-7b", "llama3-70b"]),
        (
            ["--recommend", "model.kwargs.n_layers=3", "--gpus", "2", "--nodes", "2", "--global-batch", "3"],
            ["--global-batch 3", "dp = gpus / (tp * pp): 2"],
        ),
        (["--recommend", "--global-batch", "0"], ["--global-batch 0"]),
        (["--write", str(tmp_path / "nope" / "r.yaml")], ["nope"]),
        (["--params", "1e9", "--model", "llama3-8b"], ["--model llama3-8b"]),
        (["--params", "1e9", "--recommend"], ["--params", "--recommend"]),
        (["--global-batch", "64"], ["--global-batch 64", "--recommend"]),
    ]
    for argv, names in cases:
        assert main(["plan", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert all(n in err for n in names), (argv, err)


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_the_issues_llama7b_layout_is_accepted_and_reported_as_the_search_ranks_it(capsys):
    # DP8 x PP4 x TP2 fsdp + cpu_offload on 64 H100s (8 x 8): the single-layout report and the search agree
    fixed = [
        "precision.dtype=bf16",
        "parallel.strategy=fsdp",
        "parallel.cpu_offload=true",
        "parallel.tp=2",
        "parallel.pp=4",
        "train.global_batch_size=1024",
        "train.micro_batch_size=128",
        "parallel.pp_microbatches=64",
    ]
    assert main(["plan", "--model", "llama2-7b", "--gpus", "64", "--nodes", "8", *fixed]) == 0
    out = capsys.readouterr().out
    assert "6,738,415,616 parameters; fsdp + cpu_offload on 64 x H100 SXM: dp_shard 8, tp 2, pp 4" in out
    cfg = load_plan_config(["precision.dtype=bf16"], model="llama2-7b")
    model = LlamaConfig(**cfg.model.kwargs)
    result, _ = _search(cfg, model, specs.gpu_spec("H100"), gpus=64, nodes=8, global_batch=1024)
    want = search.Candidate("fsdp", True, 2, 4, 8, micro_batch=128, accum=1, pp_microbatches=64, checkpointing="none")
    r = next(r for r in result.ranked if r.cand == want)
    assert f"{r.memory['total'] / GB:.3f}  of 80 GB: fits" in out
    assert f"step {r.step_s:.4g} s" in out and f"MFU {r.mfu:.1%}" in out


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_the_recommender_splits_the_sequence_when_a_row_does_not_fit_otherwise():
    """One layer (no pp) of 3 heads (no tp over 2), rows of 16,384 tokens: in 2.5 GB no layout without cp fits (not
    even with full checkpointing: the logits and the block recomputed in backward are the whole row's), cp 2 does; in
    4 GB the fastest layout has no cp (its K/V exchange is not overlapped)."""

    def ranked(memory_gb: float) -> search.SearchResult:
        cfg = load_config(None, ["model.kwargs.dim=1536", "model.kwargs.n_layers=1", "model.kwargs.n_heads=3",
                                 "model.kwargs.max_seq_len=16384", "data.kwargs.seq_len=16384", "precision.dtype=bf16"])
        spec = specs.with_memory(specs.gpu_spec("H100"), memory_gb)
        return _search(cfg, LlamaConfig(**cfg.model.kwargs), spec, gpus=2, global_batch=2)[0]

    tight = ranked(2.5)
    assert tight.ranked and all(r.cand.cp == 2 for r in tight.ranked)
    assert any(r.cand.cp == 1 and r.memory is not None for r in tight.rejected)  # too large without cp
    assert resolve(tight.ranked[0].cfg, world_size=2, cuda_available=True).dims.cp == 2  # dptrain accepts it
    roomy = ranked(4.0)
    assert roomy.ranked[0].cand.cp == 1 and any(r.cand.cp == 2 for r in roomy.ranked)
