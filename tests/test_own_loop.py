"""The own-loop API in one process: epochs of `prepare_dataloader` (length, ends, world-size-invariant order,
resume mid-epoch, positions with prefetching workers), `micro_steps` across epochs, the evaluation sampler
(nothing dropped, padding removed), the plain-DataLoader check, the helpers at world size one, and the
mixed-precision helper against torch's own autocast and GradScaler.

References: the Trainer's never-ending GlobalBatchSampler (the order the epochs must cut), the data set's
own order (evaluation), torch's autocast/GradScaler and SGD."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dptrain
from dptrain.config import ConfigError
from dptrain.data import EpochBatchSampler, EvalBatchSampler, GlobalBatchSampler
from dptrain.distributed import collectives

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]

N = 37  # not a multiple of the global batch: each epoch leaves samples out


def _ids(n: int = N) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _flat(batches) -> list[list[int]]:
    return [b[0].tolist() for b in batches]


def _reference(steps: range, *, g: int, m: int, a: int, rank: int = 0, world: int = 1) -> list[list[int]]:
    """The micro-batches the Trainer's never-ending sampler hands out for `steps`."""
    ref = GlobalBatchSampler(dataset_len=N, global_batch_size=g, micro_batch_size=m, grad_accum_steps=a,
                             dp_rank=rank, dp_world_size=world)
    return [mb for s in steps for mb in ref.micro_batches(s)]


def test_an_epoch_ends_has_a_length_and_the_next_iter_is_the_next_epoch():
    loader = dptrain.prepare_dataloader(_ids(), global_batch_size=8, micro_batch_size=4)  # accum 2 at world 1
    assert loader.steps_per_epoch == N // 8 == 4
    assert len(loader) == 4 * 2  # micro-batches per epoch on this rank
    first, second = _flat(loader), _flat(loader)
    assert first == _reference(range(0, 4), g=8, m=4, a=2)
    assert second == _reference(range(4, 8), g=8, m=4, a=2)
    assert sorted(sum(first, [])) != sorted(sum(second, [])) or first != second  # reshuffled per epoch
    assert loader.step == 8 and loader.epoch == 2


def test_epochs_are_cut_the_same_at_every_world_size():
    """Per step, the union of the ranks' micro-batches at world 2 is the world-1 global batch; the epoch
    has the same steps at both."""
    one = EpochBatchSampler(dataset_len=N, global_batch_size=8, micro_batch_size=4, grad_accum_steps=2, dp_rank=0,
                            dp_world_size=1, start_step=4)
    two = [EpochBatchSampler(dataset_len=N, global_batch_size=8, micro_batch_size=4, grad_accum_steps=1, dp_rank=r,
                             dp_world_size=2, start_step=4) for r in range(2)]
    a, b0, b1 = list(one), list(two[0]), list(two[1])
    assert len(b0) == len(b1) == len(two[0]) == 4 and len(a) == len(one) == 8
    for s in range(4):
        assert sorted(a[2 * s] + a[2 * s + 1]) == sorted(b0[s] + b1[s])


def test_a_resumed_loader_finishes_its_epoch_then_goes_on():
    ref = dptrain.prepare_dataloader(_ids(), global_batch_size=8, micro_batch_size=8)
    assert len(_flat(ref)) == 4  # epoch 0
    for _ in ref:
        if ref.step == 6:  # mid epoch 1
            break
    state = ref.state_dict()
    rest_ref = _flat(ref)  # the same loader goes on: the rest of epoch 1
    assert rest_ref == _reference(range(6, 8), g=8, m=8, a=1)

    resumed = dptrain.prepare_dataloader(_ids(), global_batch_size=8, micro_batch_size=4)  # another accumulation
    resumed.load_state_dict(state)
    assert resumed.step == 6 and resumed.epoch == 1
    epochs_run, batches = [], []
    for e in dptrain.epochs(resumed, 3):
        epochs_run.append(e)
        batches.append(_flat(resumed))
    assert epochs_run == [1, 2]
    assert batches[0] == _reference(range(6, 8), g=8, m=4, a=2)  # the end of epoch 1 only
    assert batches[1] == _reference(range(8, 12), g=8, m=4, a=2)


def test_epochs_refuses_a_body_that_never_iterates():
    loader = dptrain.prepare_dataloader(_ids(), global_batch_size=8, micro_batch_size=8)
    with pytest.raises(RuntimeError, match="did not iterate the loader"):
        for _ in dptrain.epochs(loader, 2):
            pass


def test_the_position_counts_what_the_loop_consumed_not_what_workers_prefetched():
    loader = dptrain.prepare_dataloader(_ids(), global_batch_size=4, micro_batch_size=4, num_workers=1)
    it = iter(loader)
    for _ in range(3):
        next(it)
    assert loader.step == 3  # the worker has fetched further ahead
    del it
    assert _flat(loader)[0] == _reference(range(3, 4), g=4, m=4, a=1)[0]  # continues at step 3


def test_micro_steps_run_across_epoch_ends_in_the_never_ending_order():
    loader = dptrain.prepare_dataloader(_ids(), global_batch_size=8, micro_batch_size=4, start_step=2)
    got = [(s, k, b[0].tolist()) for s, k, b in dptrain.micro_steps(loader, max_steps=11)]
    assert [(s, k) for s, k, _ in got] == [(s, k) for s in range(2, 11) for k in range(2)]
    assert [b for _, _, b in got] == _reference(range(2, 11), g=8, m=4, a=2)
    assert dptrain.grad_accum_steps(loader) == 2 and loader.step == 11


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 13])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("bs", [1, 2, 4])
def test_evaluation_shards_keep_every_sample_once_after_the_padding_is_dropped(n, world, bs):
    samplers = [EvalBatchSampler(dataset_len=n, batch_size=bs, rank=r, world_size=world) for r in range(world)]
    per_rank = [list(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1 and all(len(b) == len(samplers[0]) for b in per_rank)
    gathered = []
    for k in range(len(samplers[0])):
        sizes = {len(b[k]) for b in per_rank}
        assert sizes == {samplers[0].batch_size_of(k)}  # equal shapes on every rank: all_gather lines up
        round_k = [i for b in per_rank for i in b[k]]
        gathered += round_k[: samplers[0].real_in_round(k)]
    assert gathered == list(range(n))  # the data set, in order, once


def test_gather_for_metrics_at_world_one_is_the_data_set_and_checks_shapes():
    loader = dptrain.prepare_eval_dataloader(_ids(7), 3)
    out = [dptrain.gather_for_metrics(x * 10, loader) for x, in loader]
    assert torch.cat(out).tolist() == [i * 10 for i in range(7)]
    with pytest.raises(ConfigError, match="one row per sample"):
        dptrain.gather_for_metrics(torch.tensor(3.0), loader)
    with pytest.raises(ConfigError, match="prepare_eval_dataloader"):
        dptrain.gather_for_metrics(torch.zeros(3), DataLoader(_ids(7), batch_size=3))


def test_a_plain_dataloader_on_several_ranks_is_caught(monkeypatch):
    plain = DataLoader(_ids(), batch_size=4)
    assert dptrain.check_loader(plain) is None  # one rank: nothing to catch
    monkeypatch.setattr(collectives, "world_size", lambda group=None: 2)
    with pytest.warns(UserWarning, match="every rank loads the whole data set.*prepare_dataloader"):
        assert dptrain.check_loader(plain)
    with pytest.raises(ConfigError, match="every rank loads the whole data set"):
        dptrain.check_loader(plain, strict=True)
    sharded = DataLoader(_ids(), batch_size=4, sampler=DistributedSampler(_ids(), num_replicas=2, rank=0))
    assert dptrain.check_loader(sharded) is None
    with pytest.warns(UserWarning, match="whole data set"):
        assert list(dptrain.epochs(plain, 2)) == [0, 1]
    with pytest.raises(ConfigError, match="needs a loader from dptrain.prepare_dataloader"):
        dptrain.Checkpointer("unused", torch.nn.Linear(2, 2), torch.optim.SGD([torch.zeros(1)], lr=1), loader=plain)


def test_helpers_in_a_world_of_one(capsys):
    dptrain.print0("hello", 3)
    assert capsys.readouterr().out == "hello 3\n"
    dptrain.barrier()
    assert dptrain.all_reduce_mean(2.5) == 2.5
    t = torch.tensor([1, 2])
    assert torch.equal(dptrain.all_reduce_mean(t), t.double())


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_mixed_precision_is_torchs_autocast_and_grad_scaler(dtype):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ref_model = torch.nn.Linear(8, 4)
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(5, 8)
    amp = dptrain.mixed_precision(dtype, model=model)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    ctx = torch.autocast("cpu", dtype=low) if low else contextlib.nullcontext()
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=amp.scaler.get_scale() if dtype == "fp16" else 1.0,
                                      enabled=dtype == "fp16")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref_model.parameters(), lr=0.1)
    with amp:
        out = model(x)
    with ctx:
        ref_out = ref_model(x)
    assert out.dtype == ref_out.dtype == (low or torch.float32)
    amp.backward(out.float().square().mean())
    ref_scaler.scale(ref_out.float().square().mean()).backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(ref_model), strict=True))
    amp.unscale_(opt)
    ref_scaler.unscale_(ref_opt)
    amp.step(opt)
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters(), strict=True))
    assert amp.scaler.is_enabled() == (dtype == "fp16")
    with pytest.raises(ConfigError, match="valid precisions"):
        dptrain.mixed_precision("fp8")


def test_ckpt_ls_of_a_directory_without_checkpoints_exits_1_saying_where_it_looked(tmp_path, capsys):
    from dptrain.cli.main import main as cli

    (tmp_path / "checkpoints").mkdir()
    assert cli(["ckpt", "ls", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"no checkpoints under {tmp_path / 'checkpoints'}" in err and "Checkpointer" in err


def _trio(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(1, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = dptrain.prepare_dataloader(_ids(), global_batch_size=8, micro_batch_size=4)  # accum 2
    return model, opt, sched, loader


def _train_steps(model, opt, sched, loader, n: int) -> None:
    for _, micro, (x,) in dptrain.micro_steps(loader, max_steps=loader.step + n):
        model(x.float()[:, None]).square().mean().backward()
        if micro == 1:
            opt.step()
            opt.zero_grad()
            sched.step()


def test_checkpointer_in_one_process_restores_everything_and_refuses_a_half_step(tmp_path):
    """No process group needed at world size one; the reference is the same objects trained on uninterrupted."""
    model, opt, sched, loader = _trio()
    ckpt = dptrain.Checkpointer(tmp_path, model, opt, sched, loader)
    assert ckpt.resume() == 0
    _train_steps(model, opt, sched, loader, 6)  # mid epoch 1 (4 steps per epoch)
    ckpt.save(6)
    torch.manual_seed(123)  # the RNG state to be restored
    ckpt.save(6)
    rng = torch.get_rng_state()
    _train_steps(model, opt, sched, loader, 5)

    model2, opt2, sched2, loader2 = _trio(seed=1)  # other initial weights: all must come from the checkpoint
    ckpt2 = dptrain.Checkpointer(tmp_path, model2, opt2, sched2, loader2)
    assert ckpt2.resume() == 6 and loader2.step == 6 and loader2.epoch == 1
    assert torch.equal(torch.get_rng_state(), rng)
    _train_steps(model2, opt2, sched2, loader2, 5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    assert sched.state_dict() == sched2.state_dict() and loader2.step == loader.step == 11
    assert ckpt2.resumed_from == tmp_path / "checkpoints" / "step_000006"

    it = iter(loader2)
    next(it)  # one micro-batch of a two-micro-batch step
    with pytest.raises(ConfigError, match="middle of an optimizer step"):
        ckpt2.save(11)


@pytest.mark.parametrize(("world", "accum"), [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_interleaved_rank_split_gives_each_rank_what_distributed_sampler_gives_it(world, accum):
    """Over the same order (torch.randperm seeded with seed + epoch, both), rank r's micro-batches are the
    batches of a DataLoader over DistributedSampler(rank=r); the contiguous default is not."""
    data, m = _ids(48), 2
    steps = 48 // (m * accum * world)
    for epoch in range(2):
        for r in range(world):
            ds = DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=5, drop_last=True)
            ds.set_epoch(epoch)
            theirs = [b[0].tolist() for b in DataLoader(data, batch_size=m, sampler=ds)][: steps * accum]
            kw = dict(dataset_len=48, global_batch_size=m * accum * world, micro_batch_size=m, grad_accum_steps=accum,
                      dp_rank=r, dp_world_size=world, seed=5, start_step=epoch * steps)
            assert list(EpochBatchSampler(**kw, rank_split="interleaved")) == theirs
            assert list(EpochBatchSampler(**kw)) != theirs  # the default: each rank its own block
    with pytest.raises(ConfigError, match="rank_split='strided' is not valid; choose one of: contiguous, interleaved"):
        dptrain.prepare_dataloader(data, global_batch_size=4, rank_split="strided")


def test_stepping_on_every_micro_batch_of_an_accumulating_loader_warns_once_and_steps():
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    right = dptrain.prepare_dataloader(_ids(), global_batch_size=8, micro_batch_size=4)  # accum 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stepping after the last micro-batch: nothing to say
        for _, micro, (x,) in dptrain.micro_steps(right, max_steps=3):
            model(x.float()[:, None]).sum().backward()
            if micro == 1:
                opt.step()
                opt.zero_grad()
    wrong = dptrain.prepare_dataloader(_ids(), global_batch_size=8, micro_batch_size=4)
    before = model.weight.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for (x,) in wrong:  # the unported loop: a step per batch
            model(x.float()[:, None]).sum().backward()
            opt.step()
            opt.zero_grad()
    mine = [w for w in caught if "micro-batch" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]  # once, for 8 steps
    assert "SGD.step() ran after micro-batch 1 of 2" in str(mine[0].message)
    assert "grad_accum_steps=2" in str(mine[0].message) and "2x smaller" in str(mine[0].message)
    assert not torch.equal(model.weight, before)  # the steps were taken, not skipped
