"""What ported scripts get wrong on real gloo ranks, caught or matched:

- `Checkpointer.save` called on rank 0 alone (nanoGPT's `if master_process: torch.save(...)`) is refused on rank 0
  within the Checkpointer's `save_timeout_s` (10 s), naming the fix, instead of hanging until the process group's
  timeout; nothing is written, and the other rank, waiting in its next collective, fails on its own once rank 0
  is gone (not left hanging);
- the "save when validation improved" pattern (rank 0 decides, `dptrain.broadcast` tells every rank) saves;
- a BatchNorm model at world 2 over `prepare_dataloader(rank_split="interleaved")` is bitwise the plain
  DDP + DistributedSampler script (losses as float.hex, weights and running statistics); the contiguous default
  is not (BatchNorm normalises over each rank's share).

References: the wall clock; the directory's contents."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dptrain
from support.mp import RankError, in_group, run_ranks


def _one_rank_saves(rank: int, out: Path) -> None:
    def body() -> None:
        torch.manual_seed(0)
        model = dptrain.parallelize(nn.Linear(2, 1), strategy="ddp").module
        ckpt = dptrain.Checkpointer(out, model, torch.optim.SGD(model.parameters(), lr=0.1))
        t0 = time.monotonic()
        try:
            if rank == 0:  # the ported script's `if master_process:` around the save
                ckpt.save(1)
            else:
                dist.barrier()  # the next step's collective, which rank 0 never reaches
        except Exception as e:
            (out / f"rank{rank}.json").write_text(json.dumps({"s": time.monotonic() - t0, "error": str(e),
                                                             "type": type(e).__name__}))
            raise

    in_group(body)


@pytest.mark.timeout(90)
def test_a_save_on_rank_zero_alone_is_refused_within_seconds_naming_the_fix(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        run_ranks(_one_rank_saves, 2, tmp_path, timeout=60)
    total = time.monotonic() - t0
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["type"] == "CheckpointError" and 9 <= r0["s"] < 15, r0  # the 10 s save_timeout_s, not 60 s / 600 s
    assert "Checkpointer.save(1) on rank 0: not every rank called save within 10 s" in r0["error"]
    assert "call save on every rank" in r0["error"] and "dptrain.broadcast" in r0["error"]
    assert not (tmp_path / "checkpoints" / "step_000001").exists()  # nothing written
    r1 = json.loads((tmp_path / "rank1.json").read_text())  # rank 1 was released by rank 0 leaving
    assert 1 in e.value.failed and 1 not in e.value.killed and 1 not in e.value.timed_out
    assert r1["s"] < 20 and total < 40, (r1, total)
    print(f"rank 0 refused after {r0['s']:.1f}s; rank 1 released after {r1['s']:.1f}s ({r1['error'][:120]})")


def _save_when_improved(rank: int, out: Path) -> list[int]:
    def body() -> list[int]:
        torch.manual_seed(0)
        model = dptrain.parallelize(nn.Linear(2, 1), strategy="ddp").module
        ckpt = dptrain.Checkpointer(out, model, torch.optim.SGD(model.parameters(), lr=0.1))
        best, saved = float("inf"), []
        for step, val_loss in enumerate([3.0, 2.0, 2.5, 1.0], start=1):
            is_best = dptrain.broadcast(val_loss < best if rank == 0 else None)  # rank 0 decides
            if is_best:
                best = val_loss
                ckpt.save(step, extra={"best_val_loss": best})  # on every rank
                saved.append(step)
        ckpt.close()
        del model, ckpt
        gc.collect()
        return saved

    return in_group(body)


@pytest.mark.timeout(60)
def test_save_when_validation_improved_decided_on_rank_zero_and_broadcast(tmp_path):
    assert run_ranks(_save_when_improved, 2, tmp_path, timeout=45) == [[1, 2, 4], [1, 2, 4]]
    meta = json.loads((tmp_path / "checkpoints" / "step_000004" / "manifest.json").read_text())["meta"]
    assert meta["extra"] == {"best_val_loss": 1.0}


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def _bn_data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 4, generator=g) * torch.tensor([1.0, 3.0, 0.5, 2.0])
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def _train_bn(model: nn.Module, loader, epochs: int, set_epoch) -> list[str]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for epoch in range(epochs):
        set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(dptrain.all_reduce_mean(loss.detach()).item().hex())
    return losses


def _bn_runs(rank: int) -> dict:
    def body() -> dict:
        data, out = _bn_data(), {}
        # the original: torch's DDP, DistributedSampler, per-rank batch 4 (global 8)
        model = nn.parallel.DistributedDataParallel(_bn_model())
        sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
        out["torch"] = _train_bn(model, DataLoader(data, batch_size=4, sampler=sampler), 2, sampler.set_epoch)
        out["torch_state"] = {k: v.clone() for k, v in model.module.state_dict().items()}
        for split in ("interleaved", "contiguous"):
            model = dptrain.parallelize(_bn_model(), strategy="ddp").module
            loader = dptrain.prepare_dataloader(data, global_batch_size=8, seed=0, rank_split=split)
            out[split] = _train_bn(model, loader, 2, lambda e: None)
            out[f"{split}_state"] = {k: v.clone() for k, v in dptrain.unwrap(model).state_dict().items()}
        del model
        gc.collect()
        return out

    return in_group(body)


@pytest.mark.timeout(60)
def test_batchnorm_at_world_two_matches_ddp_with_distributed_sampler_bitwise_through_interleaved():
    for r in run_ranks(_bn_runs, 2, timeout=45):
        assert len(r["torch"]) == 10 and r["interleaved"] == r["torch"]  # every step's loss, bit for bit
        assert r["interleaved_state"].keys() == r["torch_state"].keys()
        assert all(torch.equal(r["interleaved_state"][k], v) for k, v in r["torch_state"].items())  # + running stats
        assert r["contiguous"] != r["torch"]  # the same global batches, other per-rank BatchNorm statistics
