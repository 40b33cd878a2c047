"""Context parallelism (parallel.cp, parallel/context.py): the built-in LLaMA trained with each row split over cp
ranks equals one plain process (the parity ladder's reference and tolerance), and what cp does not support is refused
before launch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from dptrain.config import ConfigError, resolve
from dptrain.config.load import load_config
from dptrain.data import GlobalBatchSampler
from dptrain.parallel.context import ContextParallel, chunk_positions
from support.parity import (
    GLOBAL_BATCH,
    LR,
    MODELS,
    SEED,
    STEPS,
    assert_weights_close,
    max_abs_diff,
    overrides,
    reference,
    train,
)


def _sgd_reference(ds, *, global_batch: int, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The tiny LLaMA (seeded) in one plain process on `ds`, SGD on the shuffled global batch:
    (final weights, each step's loss, the global batch's mean)."""
    spec = MODELS["llama"]
    torch.manual_seed(SEED)
    net = spec["build"](**spec["kwargs"])
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    order = GlobalBatchSampler(dataset_len=len(ds), global_batch_size=global_batch, micro_batch_size=global_batch,
                               grad_accum_steps=1, dp_rank=0, dp_world_size=1, seed=SEED, shuffle=True)
    losses = []
    for step in range(steps):
        loss = net(default_collate([ds[i] for i in order.global_batch_indices(step)]))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, losses


def reference_losses(*, global_batch: int, steps: int = STEPS) -> list[float]:
    """The plain single-process run of `reference("llama")`, recording each step's loss (the global batch's mean)."""
    spec = MODELS["llama"]
    return _sgd_reference(spec["data"](**spec["data_kwargs"]), global_batch=global_batch, steps=steps)[1]


CP_STEPS = 10
"""SGD steps of the parity cases (the issue's 10; the rest of the ladder runs support.parity's STEPS)."""


def cp_case(tmp_path, *, strategy: str, dp: int, cp: int, accum: int, extra: tuple[str, ...] = (),
            tp: int = 1, pp: int = 1, attention: str = "allgather") -> float:
    """Train the tiny LLaMA on dp x cp (x tp x pp) gloo ranks for CP_STEPS SGD steps with `attention`
    (parallel.cp_attention); assert every step's loss and gradient norm and the final weights equal the reference;
    return the largest weight difference."""
    g = GLOBAL_BATCH[dp]
    items = overrides(strategy=strategy, world_size=dp, accum=accum, model="llama", steps=CP_STEPS)
    items += [f"parallel.cp={cp}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.cp_attention={attention}",
              *extra]
    got, records = train(items, dp * cp * tp * pp, tmp_path, timeout=50)
    want, norms = reference("llama", global_batch=g, steps=CP_STEPS)
    logged = [r["loss"] for r in records if "loss" in r]
    assert len(logged) == CP_STEPS
    assert logged == pytest.approx(reference_losses(global_batch=g, steps=CP_STEPS), rel=1e-5)
    assert [r["grad_norm"] for r in records if "grad_norm" in r] == pytest.approx(norms, rel=1e-4)
    assert_weights_close(got, want)
    diff = max_abs_diff(got, want)
    print(f"{attention}: cp {cp} x tp {tp} x pp {pp} x {strategy} dp {dp}, accumulation {accum}: max |weight "
          f"difference| after {CP_STEPS} steps {diff:.2g}")
    return diff


@pytest.mark.timeout(60)
@pytest.mark.parametrize("accum", [1, 2])
def test_cp2_matches_reference(accum, tmp_path):
    cp_case(tmp_path, strategy="ddp", dp=1, cp=2, accum=accum)


@pytest.mark.timeout(60)
def test_cp4_matches_reference(tmp_path):
    cp_case(tmp_path, strategy="ddp", dp=1, cp=4, accum=1)


@pytest.mark.timeout(60)
def test_cp2_with_ddp2_matches_reference(tmp_path):
    cp_case(tmp_path, strategy="ddp", dp=2, cp=2, accum=1)


@pytest.mark.timeout(60)
def test_cp2_with_fsdp2_matches_reference(tmp_path):
    """FSDP2 shards parameters over dp_shard x cp (4 ranks) and reduce-scatters gradients over all of them."""
    cp_case(tmp_path, strategy="fsdp", dp=2, cp=2, accum=2, extra=("parallel.dp_shard=2",))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sp", [True, False])
def test_cp2_with_tp2_matches_reference(sp, tmp_path):
    """tp splits the heads (and under sequence parallelism each cp rank's chunks once more over the tp ranks); cp
    gathers K/V over the cp ranks only; replicate all-reduces the gradients over dp x cp, DTensor handles tp."""
    cp_case(tmp_path, strategy="ddp", dp=1, cp=2, tp=2, accum=1,
            extra=(f"parallel.sequence_parallel={str(sp).lower()}",))


@pytest.mark.timeout(60)
def test_cp2_with_tp2_and_loss_parallel_matches_reference(tmp_path):
    """The head's logits stay vocabulary-sharded over tp (loss_parallel) while the rows are split over cp."""
    cp_case(tmp_path, strategy="ddp", dp=1, cp=2, tp=2, accum=2, extra=("parallel.loss_parallel=true",))


@pytest.mark.timeout(60)
def test_the_tolerance_catches_cp_x_tp_gradients_not_reduced_over_cp(tmp_path, monkeypatch):
    """Guard: under cp x tp the replicas' gradient all-reduce left out (each cp rank steps on its own chunks' gradient,
    the token count still over dp x cp) fails the parity check."""
    from dptrain.parallel import ddp
    from dptrain.parallel.single import apply_single

    monkeypatch.setattr(ddp, "apply_ddp_over_tp",
                        lambda model, *, device, mesh, materialize=None: apply_single(model, device=device,
                                                                                      materialize=materialize))
    with pytest.raises(AssertionError):
        cp_case(tmp_path, strategy="ddp", dp=1, cp=2, tp=2, accum=1)


@pytest.mark.timeout(60)
def test_cp2_with_tp2_and_fsdp2_matches_reference(tmp_path):
    """8 ranks: FSDP2 shards over dp_shard x cp on a (dp_shard_cp, tp) mesh."""
    cp_case(tmp_path, strategy="fsdp", dp=2, cp=2, tp=2, accum=1, extra=("parallel.dp_shard=2",))


@pytest.mark.timeout(60)
def test_cp2_with_pp2_matches_reference(tmp_path):
    """Each pipeline stage holds the cp split: its attention gathers K/V over the cp ranks of its stage, its rotary
    tables are read at the rank's global positions; replicate all-reduces each stage's gradients over dp x cp."""
    cp_case(tmp_path, strategy="ddp", dp=1, cp=2, pp=2, accum=2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy,dp,tp,extra", [("ddp", 1, 2, ()), ("fsdp", 2, 1, ("parallel.dp_shard=2",))])
def test_cp2_with_pp2_and_tp2_or_fsdp2_matches_reference(strategy, dp, tp, extra, tmp_path):
    """8 ranks: cp 2 x pp 2 x tp 2 (sequence parallelism within each stage), or x fsdp dp_shard 2 (FSDP2 on each
    stage over dp_shard x cp)."""
    cp_case(tmp_path, strategy=strategy, dp=dp, cp=2, tp=tp, pp=2, accum=1, extra=extra)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["positions", "reduction"])
def test_the_tolerance_catches_cp_x_pp_without_global_positions_or_the_cp_reduction(fault, tmp_path, monkeypatch):
    """Guard: the stages' rotary tables read at 0..T/cp-1 (the chunks' own positions forgotten), or the stages'
    gradients not all-reduced over the cp ranks, fail the parity check."""
    from dptrain.parallel import pipeline

    if fault == "positions":
        monkeypatch.setattr(pipeline, "chunk_positions",
                            lambda n, *, cp, rank, device=None: torch.arange(n // cp, device=device))
    else:
        def no_reduction(part, *, device, mesh, materialize):
            materialize(part)
            return part.to(device)

        monkeypatch.setattr(pipeline, "apply_replicate", no_reduction)
    with pytest.raises(AssertionError):
        cp_case(tmp_path, strategy="ddp", dp=1, cp=2, pp=2, accum=1)


@pytest.mark.timeout(90)
def test_validation_loss_under_cp2_x_pp2_is_the_single_process_one(tmp_path):
    """The pipeline's forward-only schedule on split rows: the valid targets counted over the cp ranks, each rank's
    share summed over its pipeline (last stage) and its cp group."""
    import json

    def val_losses(cp: int, pp: int, ranks: int) -> list[float]:
        out = tmp_path / f"cp{cp}pp{pp}"
        items = overrides(strategy="ddp" if ranks > 1 else "single", world_size=1, accum=1, model="llama", steps=2)
        items += [f"parallel.cp={cp}", f"parallel.pp={pp}", "data.factory=dptrain.data.corpus:build_stdlib_lm",
                  "data.kwargs={seq_len: 16}", "train.eval_every_steps=1", "train.eval_batches=2"]
        train(items, ranks, out, timeout=50)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["val_loss"] for r in records if "val_loss" in r]

    want = val_losses(1, 1, 1)
    assert len(want) == 3  # before training and after each step
    assert val_losses(2, 2, 4) == pytest.approx(want, rel=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_cp2_under_activation_checkpointing_matches_reference(mode, tmp_path):
    """The recompute runs the blockwise attention and its K/V all-gather again; selective keeps the kernel's outputs."""
    cp_case(tmp_path, strategy="ddp", dp=1, cp=2, accum=1, extra=(f"parallel.activation_checkpointing={mode}",))


def packed_corpus(folder) -> str:
    """A prepared corpus (byte tokenizer) of short documents, 1-3 words: every packed row of 16 tokens holds several,
    and documents start inside the cp chunks."""
    from dptrain.data.prepare import prepare
    from support.corpora import documents, write_jsonl

    src = write_jsonl(folder / "docs.jsonl", documents(240, seed=5, max_words=3))
    prepare([str(src)], tokenizer="bytes", out=folder / "prepared", workers=0, shard_docs=256)
    return str(folder / "prepared")


def packed_reference(source: str, *, global_batch: int, steps: int) -> tuple[dict, list[float]]:
    """One plain process on the packed rows: the model's document mask from the rows' position ids, the token mean
    over the global batch, SGD; (final weights, each step's loss)."""
    from dptrain.data.packed import build_packed

    ds, _ = build_packed(source=source, seq_len=16)
    return _sgd_reference(ds, global_batch=global_batch, steps=steps)


@pytest.mark.timeout(90)
def test_packed_rows_with_document_masks_on_cp2_match_one_process(tmp_path):
    """Packed rows (data/packed.py): documents found on the whole row's positions, each rank's queries attend to
    keys of their own document only, rotary by the position within the document."""
    packed_case(tmp_path)


@pytest.mark.timeout(90)
def test_the_packed_case_catches_attention_across_documents(tmp_path, monkeypatch):
    """Guard: every row taken as one document under cp (the document mask lost) fails the packed parity check."""
    from dptrain.parallel import context

    monkeypatch.setattr(context, "document_ids", lambda pos: torch.ones_like(pos))
    with pytest.raises(AssertionError):
        packed_case(tmp_path)


def packed_case(tmp_path, attention: str = "allgather") -> None:
    source = packed_corpus(tmp_path / "corpus")
    g = GLOBAL_BATCH[1]
    items = [i for i in overrides(strategy="ddp", world_size=1, accum=1, model="llama", steps=CP_STEPS)
             if not i.startswith("data.")]
    items += ["data.factory=dptrain.data.packed:build_packed", f"data.kwargs.source={source}",
              "data.kwargs.seq_len=16", "data.num_workers=0", "parallel.cp=2", "train.eval_every_steps=0",
              f"parallel.cp_attention={attention}"]
    got, records = train(items, 2, tmp_path / "run", timeout=60)
    want, losses = packed_reference(source, global_batch=g, steps=CP_STEPS)
    assert [r["loss"] for r in records if "loss" in r] == pytest.approx(losses, rel=1e-5)
    assert_weights_close(got, want)
    diff = max_abs_diff(got, want)
    print(f"packed rows, {attention}, cp 2: max |weight difference| after {CP_STEPS} steps {diff:.2g}")


@pytest.mark.timeout(60)
def test_the_tolerance_catches_gradients_reduced_over_dp_only(tmp_path, monkeypatch):
    """Guard: the token count and the gradients reduced over dp alone (cp forgotten) fail the parity check."""
    from dptrain.distributed.mesh import ParallelMesh

    monkeypatch.setattr(ParallelMesh, "grad_group", property(lambda self: self.dp_group))
    monkeypatch.setattr(ParallelMesh, "grad_size", property(lambda self: self.dp_size))
    with pytest.raises(AssertionError):
        cp_case(tmp_path, strategy="ddp", dp=1, cp=2, accum=1)


@pytest.mark.timeout(90)
def test_resume_across_cp_degrees_cp2_fsdp_then_single_then_cp2_ddp(tmp_path):
    """One run, SGD with momentum, a checkpoint every step: steps 1-2 on cp 2 (fsdp: DCP shards over dp_shard x cp),
    step 3 in one process, step 4 on cp 2 under ddp. The data position and the optimizer state carry over: the
    gradient norms and the final weights are the uninterrupted single-process reference's."""
    import json

    from safetensors.torch import load_file

    from support.mp import run_ranks
    from support.parity import fit_items

    def items(strategy: str, cp: int, steps: int) -> list[str]:
        return [*overrides(strategy=strategy, world_size=1, accum=1, model="llama", steps=steps),
                f"parallel.cp={cp}", "optim.momentum=0.9", "checkpoint.every_steps=1", "train.eval_every_steps=0"]

    for strategy, cp, steps in (("fsdp", 2, 2), ("single", 1, 3), ("ddp", 2, 4)):
        run_ranks(fit_items, cp, items(strategy, cp, steps), str(tmp_path), timeout=40)
    want, norms = reference("llama", global_batch=GLOBAL_BATCH[1], momentum=0.9)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["grad_norm"] for r in records if "grad_norm" in r}
    assert [r["step"] for r in records if "grad_norm" in r] == [1, 2, 3, 4]  # each step once: every run resumed
    assert [logged[s] for s in range(1, 5)] == pytest.approx(norms, rel=1e-4)
    assert_weights_close(load_file(str(tmp_path / "final" / "model.safetensors")), want)


# ------------------------------------------------------------------ the split
def test_chunks_are_load_balanced_and_cover_the_row_once():
    assert chunk_positions(8, cp=2, rank=0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, cp=2, rank=1).tolist() == [2, 3, 4, 5]
    every = torch.cat([chunk_positions(16, cp=4, rank=r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))


def test_shard_takes_the_rows_chunks_with_their_global_positions():
    rows = torch.arange(2 * 9).view(2, 9)  # [B, T+1]: 8 inputs
    mine = ContextParallel(None, cp=2, rank=1).shard(rows)
    assert mine["input_ids"].tolist() == [[2, 3, 4, 5], [11, 12, 13, 14]]
    assert mine["labels"].tolist() == [[3, 4, 5, 6], [12, 13, 14, 15]]
    assert mine["position_ids"].tolist() == [[2, 3, 4, 5]] * 2


def test_shard_refuses_rows_that_do_not_split_and_padding_masks():
    with pytest.raises(ConfigError, match=r"7 input tokens cannot be split into 2\*cp=4"):
        ContextParallel(None, cp=2, rank=0).shard(torch.zeros(2, 8, dtype=torch.long))
    padded = {"input_ids": torch.zeros(1, 8), "labels": torch.zeros(1, 8), "attention_mask": torch.zeros(1, 8)}
    with pytest.raises(ConfigError, match="attention_mask"):
        ContextParallel(None, cp=2, rank=0).shard(padded)


def test_shard_of_packed_rows_numbers_documents_on_the_whole_row():
    """Documents start at positions 0 and 5 of the row: rank 1 (global tokens 2-5) holds the end of the first and
    the start of the second, which its own positions [2, 3, 4, 0] could not tell apart from a chunk boundary."""
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    packed = {"input_ids": torch.arange(8)[None], "labels": torch.arange(1, 9)[None], "position_ids": pos}
    mine = ContextParallel(None, cp=2, rank=1).shard(packed)
    assert mine["input_ids"].tolist() == [[2, 3, 4, 5]]
    assert mine["position_ids"].tolist() == [[2, 3, 4, 0]]  # rotary: positions within the document
    assert mine["document_ids"].tolist() == [[1, 1, 1, 2]]
    assert ContextParallel(None, cp=2, rank=0).shard(packed)["document_ids"].tolist() == [[1, 1, 2, 2]]


def _eval_on_cp_ranks(rank: int, cp: int, attention: str) -> tuple[float, float]:
    import torch.distributed as dist

    from dptrain.models.llama import build_llama
    from dptrain.parallel.context import apply_cp
    from dptrain.train.loss import forward_loss

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(SEED)
        model = build_llama(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)  # GQA: 2 KV heads travel
        rows = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(1))
        labels = rows[:, 1:].clone()
        labels[0, :11] = -100  # uneven over the chunks: a prompt, then the answer
        batch = {"input_ids": rows[:, :-1], "labels": labels}
        with torch.no_grad():
            whole = float(model(batch))
        group = dist.new_group(list(range(cp)))
        assert apply_cp(model, group=group, cp=cp, rank=rank, attention=attention) == attention
        split = float(ContextParallel(group, cp=cp, rank=rank).eval_loss(model, batch, loss_fn=forward_loss))
        return whole, split
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attention", ["allgather", "ulysses"])
def test_validation_loss_of_split_rows_is_the_whole_rows_token_mean(attention):
    from support.mp import run_ranks

    for whole, split in run_ranks(_eval_on_cp_ranks, 2, 2, attention, timeout=50):
        assert split == pytest.approx(whole, rel=1e-6)


# ------------------------------------------------------------------ refusals before launch
BASE = ["parallel.device=cpu", "parallel.cp=2"]


@pytest.mark.parametrize(
    "extra,world,match",
    [
        (["parallel.tp=2", "parallel.tp_plan=support.parity:tiny_tokens"], 4, r"parallel.tp_plan=.*drop parallel.tp"),
        (["parallel.tp=4", "data.kwargs.seq_len=36"], 8,
         r"seq_len=36: .* leaves each of the cp=2 ranks 18, .* over tp=4; .* multiple of 8"),
        (["parallel.strategy=zero1"], 4, r"parallel.strategy='zero1' is not supported with cp > 1"),
        (["model.factory=dptrain.models.hf:build_hf_causal_lm"], 2, r"model.factory=.*built-in LLaMA"),
        (["model.kwargs.pretrained=/some/folder"], 2, r"no pretrained folder"),
        (["data.factory=dptrain.data.packed:build_packed", "data.kwargs.seq_len=126"], 2,
         r"data.kwargs.seq_len=126 is not divisible by 2\*cp=4"),
        (["data.kwargs.seq_len=126"], 2, r"data.kwargs.seq_len=126 is not divisible by 2\*cp=4"),
        (["train.loss=support.parity:tiny_tokens"], 2, r"train.loss="),
        (["train.eval_fn=support.parity:tiny_tokens"], 2, r"train.eval_fn="),
        (["parallel.grad_compression=fp16"], 2, r"grad_compression='fp16'"),
        ([], 3, r"world size 3 is not divisible .*cp=2"),
    ],
)
def test_what_cp_does_not_support_is_refused_before_launch(extra, world, match):
    with pytest.raises(ConfigError, match=match):
        resolve(load_config(None, [*BASE, *extra]), world_size=world)


def test_cp_with_tp_resolves_and_sequence_parallelism_needs_an_even_share():
    res = resolve(load_config(None, [*BASE, "parallel.strategy=ddp", "parallel.tp=2", "data.kwargs.seq_len=36"]),
                  world_size=4)
    assert (res.dims.cp, res.dims.tp, res.dims.grad_size, res.dp_world_size) == (2, 2, 2, 1)
    off = ["parallel.sequence_parallel=false", "data.kwargs.seq_len=36"]
    assert resolve(load_config(None, [*BASE, "parallel.tp=4", *off]), world_size=8).dims.tp == 4


def test_launch_check_reads_each_cp_ranks_share_of_a_sample():
    from dptrain.config.fields import ParallelConfig
    from dptrain.launch.checks import check_tensor_parallel
    from dptrain.models.llama import build_llama

    with torch.device("meta"):
        model = build_llama(dim=32, n_layers=1, n_heads=4, max_seq_len=64)
    sp = ParallelConfig(sequence_parallel=True)
    check_tensor_parallel(model, parallel=sp, tp=4, cp=2, sample=torch.zeros(33, dtype=torch.long))  # 16 a rank
    with pytest.raises(ConfigError, match=r"leaves each of the cp=2 ranks 10, .* over tp=4"):
        check_tensor_parallel(model, parallel=sp, tp=4, cp=2, sample=torch.zeros(21, dtype=torch.long))


def test_cp_layout_resolves_with_fsdp():
    res = resolve(load_config(None, [*BASE, "parallel.strategy=fsdp"]), world_size=4)
    assert (res.dims.dp_shard, res.dims.cp, res.dims.grad_size, res.dp_world_size) == (2, 2, 4, 2)
