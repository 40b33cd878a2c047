"""The own-loop API on real gloo ranks:

- a `Checkpointer` run stopped by SIGTERM (agreed by both ranks, saved mid-epoch) and resumed at world size 1
  ends bit-identical to an uninterrupted 2-rank run: weights, momentum, StepLR, RNG, data position;
  `dptrain ckpt ls/verify/export` read its out_dir;
- accuracy through `prepare_eval_dataloader` + `gather_for_metrics` on an uneven set (7 samples) is the same
  on 1 and 2 ranks, and equals the single-process computation over the data set;
- `parallelize(...).module` passes attributes through; `save_model` writes the plain module's state;
- `dptrain.monitor` names the rank that is not in the collective when the other waits in it.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import dptrain
from dptrain.cli.main import main as cli
from dptrain.models import build_mlp, build_regression_data
from support.mp import RankError, in_group, run_ranks

N_DATA, GLOBAL, MICRO = 40, 8, 4  # 5 steps per epoch; world 2: accumulation 1, world 1: 2
EPOCHS, SIGTERM_AT = 3, 6  # rank 1 gets SIGTERM after step 6; both agree at step 7 (epoch 1), save it, stop


def _loop(rank: int, out: Path, strategy: str, stop_by_signal: bool) -> dict:
    """An epoch-based own loop with a Checkpointer; returns the final state or where it stopped."""
    return in_group(lambda: _train(rank, out, strategy, stop_by_signal))


def _reference_then_stopped(rank: int, tmp: Path, strategy: str) -> list[dict]:
    """In one process group (one launch): the uninterrupted run, then the run stopped by SIGTERM."""
    return in_group(lambda: [_train(rank, tmp / "ref", strategy, False), _train(rank, tmp / "run", strategy, True)])


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()  # FSDP2's DTensors, whole (collective)


def _train(rank: int, out: Path, strategy: str, stop_by_signal: bool) -> dict:
    torch.manual_seed(0)
    model = dptrain.parallelize(build_mlp(), strategy=strategy).module
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    loader = dptrain.prepare_dataloader(build_regression_data(n=N_DATA), global_batch_size=GLOBAL,
                                        micro_batch_size=MICRO)
    accum = dptrain.grad_accum_steps(loader)
    ckpt = dptrain.Checkpointer(out, model, opt, sched, loader)
    step = start = ckpt.resume()
    rng_at_start = torch.get_rng_state()
    stopped = False
    for _epoch in dptrain.epochs(loader, EPOCHS):
        for micro, (x, y) in enumerate(loader):
            with dptrain.sync_gradients(model, micro % accum == accum - 1):
                (model((x, y)) / accum).backward()
            if micro % accum == accum - 1:
                opt.step()
                opt.zero_grad()
                step += 1
                torch.rand(1)  # the loop uses the global RNG: its state must be restored too
                if stop_by_signal and rank == 1 and step == SIGTERM_AT:
                    os.kill(os.getpid(), signal.SIGTERM)
                if ckpt.step(step):
                    stopped = True
                    break
        if stopped:
            break
        sched.step()
    ckpt.close()
    state = dptrain.full_state_dict(model)
    momentum = [_full(opt.state[p]["momentum_buffer"]) for p in model.parameters()]
    result = {"start": start, "step": step, "exit_code": ckpt.exit_code, "loader_step": loader.step,
              "state": state, "momentum": momentum, "lr": opt.param_groups[0]["lr"],
              "sched": sched.state_dict(), "rng": torch.get_rng_state(), "rng_at_start": rng_at_start}
    del model, opt, ckpt
    gc.collect()
    return result


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("strategy", "fmt"), [("ddp", "full"), ("fsdp", "dcp")])
def test_checkpointer_sigterm_mid_epoch_then_resume_at_world_one_is_bit_identical(tmp_path, capsys, strategy, fmt):
    (ref, stopped0), (_, stopped1) = run_ranks(_reference_then_stopped, 2, tmp_path, strategy, timeout=90)
    out, stopped = tmp_path / "run", [stopped0, stopped1]
    saved = SIGTERM_AT + 1  # agreed one step after the signal
    assert [r["step"] for r in stopped] == [saved, saved] and {r["exit_code"] for r in stopped} == {143}
    assert stopped[0]["loader_step"] == saved  # mid epoch 1
    resumed = run_ranks(_loop, 1, out, strategy, False, timeout=90)[0]
    assert resumed["start"] == saved
    assert torch.equal(resumed["rng_at_start"], stopped[0]["rng"])  # rank 0's RNG, restored at world 1
    assert resumed["step"] == ref["step"] == EPOCHS * (N_DATA // GLOBAL)
    _same(resumed["state"], ref["state"])  # bit-identical weights
    assert all(torch.equal(a, b) for a, b in zip(resumed["momentum"], ref["momentum"], strict=True))
    assert resumed["lr"] == ref["lr"] and resumed["sched"] == ref["sched"]

    root = out / "checkpoints"
    assert (root / f"step_{saved:06d}" / "COMMITTED").is_file()
    meta = json.loads((root / f"step_{saved:06d}" / "manifest.json").read_text())["meta"]
    assert meta["format"] == fmt and meta["strategy"] == strategy and meta["world_size"] == 2
    capsys.readouterr()
    assert cli(["ckpt", "ls", str(out)]) == 0
    listing = capsys.readouterr().out
    assert f"step_{saved:06d}" in listing and "committed" in listing
    assert cli(["ckpt", "verify", str(out)]) == 0
    assert cli(["ckpt", "export", str(out), "--out", str(tmp_path / "w.safetensors")]) == 0
    from safetensors.torch import load_file

    _same(load_file(tmp_path / "w.safetensors"), stopped[0]["state"])  # the one checkpoint: the stopped step


def _accuracy(rank: int, batch_size: int) -> dict:
    def body() -> dict:
        torch.manual_seed(0)
        model = dptrain.parallelize(nn.Linear(4, 3), strategy="ddp").module
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(7, 4, generator=g), torch.randint(0, 3, (7,), generator=g))
        loader = dptrain.prepare_eval_dataloader(data, batch_size)
        preds, labels = [], []
        with torch.no_grad():
            for x, y in loader:
                p, t = dptrain.gather_for_metrics((model(x).argmax(1), y), loader)
                preds.append(p)
                labels.append(t)
        p, t = torch.cat(preds), torch.cat(labels)
        plain = dptrain.unwrap(model)
        with torch.no_grad():
            ref = plain(data.tensors[0]).argmax(1)
        acc = dptrain.all_reduce_mean(float((p == t).float().mean()))  # the same on every rank anyway
        del model, plain
        gc.collect()
        return {"n": len(p), "preds": p, "ref": ref, "labels_ok": torch.equal(t, data.tensors[1]), "acc": acc,
                "ref_acc": float((ref == data.tensors[1]).float().mean())}

    return in_group(body)


@pytest.mark.timeout(90)
def test_accuracy_via_gather_for_metrics_is_equal_on_one_and_two_ranks_with_seven_samples():
    one = run_ranks(_accuracy, 1, 2, timeout=60)
    two = run_ranks(_accuracy, 2, 2, timeout=60)  # rounds: 2+2 samples, then 2+2 with one repeat dropped
    for r in one + two:
        assert r["n"] == 7 and r["labels_ok"]
        assert torch.equal(r["preds"], r["ref"])  # the data set's predictions, in order, each once
        assert r["acc"] == r["ref_acc"]
    assert one[0]["acc"] == two[0]["acc"] == two[1]["acc"]


class WithHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def init_hidden(self, batch: int) -> torch.Tensor:
        return torch.zeros(1, batch, 5)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x, h)
        return self.head(out[:, -1])


def _pass_through(rank: int, out: Path) -> dict:
    def body() -> dict:
        torch.manual_seed(0)
        plain = WithHidden()
        model = dptrain.parallelize(plain, strategy="ddp").module
        h = model.init_hidden(4)  # the user's method, through the DDP wrapper
        model(torch.randn(4, 6, 3), h).sum().backward()
        dptrain.save_model(model, out / "model.pt")
        dptrain.save_model(model, out / "model.safetensors")
        result = {
            "unwrapped": dptrain.unwrap(model) is plain,
            "ddp": isinstance(model, nn.parallel.DistributedDataParallel),
            "head": model.head is plain.head,
            "state": {k: v.clone() for k, v in plain.state_dict().items()},
        }
        del model, plain
        gc.collect()
        return result

    return in_group(body)


@pytest.mark.timeout(60)
def test_parallelize_module_passes_attributes_through_and_save_model_writes_the_plain_state(tmp_path):
    r = run_ranks(_pass_through, 2, tmp_path, timeout=45)[0]
    assert r["unwrapped"] and r["ddp"] and r["head"]
    _same(torch.load(tmp_path / "model.pt", weights_only=True), r["state"])  # plain names, no "module." prefix
    from safetensors.torch import load_file

    _same(load_file(tmp_path / "model.safetensors"), r["state"])
    fresh = WithHidden()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))


def _hangs(rank: int, out: Path) -> None:
    def body() -> None:
        with dptrain.monitor(out, hang_timeout_s=2, log_every_steps=1) as mon:
            for step in range(1, 100):
                if rank == 1 and step == 3:
                    time.sleep(60)  # rank 1 never reaches the all-reduce rank 0 waits in
                x = torch.ones(1)
                torch.distributed.all_reduce(x)
                mon.step(step, loss=x)

    in_group(body)


@pytest.mark.timeout(60)
def test_monitor_names_the_rank_that_is_not_in_the_collective(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        run_ranks(_hangs, 2, tmp_path, timeout=40)
    assert "exited with code 3" in str(e.value) and time.monotonic() - t0 < 30
    report = (tmp_path / "hang_report.txt").read_text()
    assert "suspect rank(s): rank 1 " in report, report
    assert "not inside torch.distributed" in report
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]  # the records before the hang
