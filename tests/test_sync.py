"""Gradient synchronisation through the low-level API (`dptrain.parallelize`, `sync_gradients`,
`clip_grad_norm_`, `unwrap`) on 2 gloo ranks that see DIFFERENT data.

- inside `sync_gradients(model, False)` a backward only accumulates locally: the ranks'
  gradients differ, each equal to its own micro-batch's gradient;
- after the last micro-step under `sync_gradients(model, True)` they are identical on every rank
  and equal the average over ranks of the single-process accumulated gradients;
- `clip_grad_norm_` returns the same global norm on every rank, the norm of the full averaged
  gradient (also when FSDP2 shards it), and clips by that norm everywhere.

Teardown order matters: a DDP model deallocated after `destroy_process_group()` can deadlock
(its Reducer drops the last reference to the gloo group with the GIL held; ~ProcessGroupGloo then
joins a gloo thread that is waiting for the GIL). The rank function deletes the model first.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from torch import nn

from dptrain.api import parallelize
from dptrain.distributed.env import DistEnv
from dptrain.distributed.process_group import destroy_process_group, init_process_group
from dptrain.models.toy import build_mlp, build_regression_data
from dptrain.parallel import clip_grad_norm_, is_sharded, sync_gradients, unwrap
from support.mp import run_ranks

SEED = 7
WORLD = 2
ACCUM = 2
MICRO = 4
MLP_KWARGS = {"in_dim": 8, "hidden": 16, "out_dim": 4, "depth": 2}
MAX_NORM = 0.01
CPU = torch.device("cpu")


def micro_batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s k-th micro-batch: disjoint samples on every rank."""
    ds = build_regression_data(n=WORLD * ACCUM * MICRO, in_dim=8, out_dim=4, seed=3)
    start = (rank * ACCUM + k) * MICRO
    return ds.x[start : start + MICRO], ds.y[start : start + MICRO]


def fresh_model() -> nn.Module:
    torch.manual_seed(SEED)
    return build_mlp(**MLP_KWARGS)


# ------------------------------------------------------------------ reading gradients
def local_unsynced_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's not-yet-reduced gradients, under the plain module's parameter names.

    DDP under no_sync accumulates in `p.grad`. FSDP2 with gradient sync off keeps them unsharded
    and out of `p.grad` (which stays None), in its per-parameter state (internal API: read only
    by this test)."""
    module = unwrap(model)
    if not is_sharded(module):
        return {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    from torch.distributed.fsdp import FSDPModule

    by_id: dict[int, torch.Tensor] = {}
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    grad = fp.unsharded_accumulated_grad
                    if grad is None:
                        grad = fp._unsharded_param.grad
                    if grad is not None:
                        by_id[id(fp.sharded_param)] = grad.detach().clone()
    return {n: by_id[id(p)] for n, p in module.named_parameters() if id(p) in by_id}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) reduced gradients; collective under FSDP: every rank calls it."""
    out = {}
    for n, p in unwrap(model).named_parameters():
        assert p.grad is not None, f"{n} has no gradient after the synchronised micro-step"
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[n] = g.detach().clone()
    return out


# ------------------------------------------------------------------ the rank function
def _rank_fn(rank: int, strategy: str, sync_each: bool) -> dict:
    env = DistEnv.from_env()
    assert env.launched and env.rank == rank and env.world_size == WORLD
    init_process_group(env, backend="gloo", device=CPU, timeout_s=60)
    model = None
    try:
        model = parallelize(fresh_model(), strategy=strategy, device=CPU).module
        out: dict = {"sharded": is_sharded(model)}
        for k in range(ACCUM):
            sync = sync_each or k == ACCUM - 1
            with sync_gradients(model, sync):
                loss = model(micro_batch(rank, k)) / ACCUM
                loss.backward()
            if k == 0 and not sync:
                out["unsynced"] = local_unsynced_grads(model)
                out["sharded_grad_is_none"] = all(p.grad is None for p in unwrap(model).parameters())
        out["synced"] = full_grads(model)
        out["norm"] = clip_grad_norm_(model, MAX_NORM).detach().clone()
        out["clipped"] = full_grads(model)
        return out
    finally:
        # Drop the wrapper BEFORE the process group: DDP's C++ Reducer holds the gloo group, and
        # if its deallocation drops the last reference, ~ProcessGroupGloo joins the gloo threads
        # while holding the GIL, deadlocking with a thread that needs the GIL to free a finished
        # work item (upstream PyTorch; see the module docstring).
        del model
        gc.collect()
        destroy_process_group()


# ------------------------------------------------------------------ the reference
def reference_grads(micro: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Single process: accumulate loss/ACCUM over the given (rank, k) micro-batches."""
    model = fresh_model()
    for rank, k in micro:
        (model(micro_batch(rank, k)) / ACCUM).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def total_norm(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


STRATEGIES = ["ddp", "zero2", "fsdp"]


@functools.cache
def no_sync_run(strategy: str) -> list[dict]:
    """One 2-rank run per strategy (no-sync micro-steps, then a synchronised one, then the clip),
    shared by the two tests that read it: it is the same run, and a run costs a fork of 2 ranks."""
    return run_ranks(_rank_fn, WORLD, strategy, False, timeout=30)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sync_accumulates_locally_then_sync_averages(strategy):
    results = no_sync_run(strategy)
    assert [r["sharded"] for r in results] == [strategy != "ddp"] * WORLD

    # Under no-sync: nothing was reduced, every rank holds only its own micro-batch's gradient.
    for rank, r in enumerate(results):
        assert_grads_close(r["unsynced"], reference_grads([(rank, 0)]))
        if strategy != "ddp":
            assert r["sharded_grad_is_none"], "FSDP2 must not reduce-scatter into p.grad under no-sync"
    for n in results[0]["unsynced"]:
        assert not torch.allclose(results[0]["unsynced"][n], results[1]["unsynced"][n]), f"{n}: ranks agree before sync"

    # After the synchronised last micro-step: identical everywhere, the average over ranks of
    # each rank's accumulated gradient (= the gradient of the mean loss over all samples).
    want = {n: g / WORLD for n, g in reference_grads([(r, k) for r in range(WORLD) for k in range(ACCUM)]).items()}
    for r in results[1:]:
        for n in want:
            assert torch.equal(r["synced"][n], results[0]["synced"][n]), f"{n}: ranks differ after sync"
    assert_grads_close(results[0]["synced"], want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sync_each_micro_step_gives_the_same_gradients(strategy):
    results = run_ranks(_rank_fn, WORLD, strategy, True, timeout=30)
    want = {n: g / WORLD for n, g in reference_grads([(r, k) for r in range(WORLD) for k in range(ACCUM)]).items()}
    for r in results:
        assert "unsynced" not in r
        assert_grads_close(r["synced"], want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clip_grad_norm_is_global(strategy):
    results = no_sync_run(strategy)
    want = {n: g / WORLD for n, g in reference_grads([(r, k) for r in range(WORLD) for k in range(ACCUM)]).items()}
    ref_norm = total_norm(want)
    assert ref_norm > 10 * MAX_NORM, "the clip must be active for this test to mean anything"
    norms = [r["norm"] for r in results]
    for norm in norms:
        assert type(norm) is torch.Tensor and norm.ndim == 0, f"expected a plain scalar tensor, got {type(norm)}"
        assert torch.equal(norm, norms[0]), f"ranks report different norms: {norms}"
    torch.testing.assert_close(norms[0], ref_norm, rtol=1e-5, atol=0)
    # Every rank clipped by the same global factor (torch's: max_norm / (norm + 1e-6)).
    scale = MAX_NORM / (float(ref_norm) + 1e-6)
    for r in results:
        assert_grads_close(r["clipped"], {n: g * scale for n, g in want.items()})
    torch.testing.assert_close(total_norm(results[0]["clipped"]), torch.tensor(MAX_NORM), rtol=1e-4, atol=0)


# ------------------------------------------------------------------ the harness itself
def _env_and_result(rank: int, scale: int) -> dict:
    import os

    return {
        "rank": rank,
        "value": rank * scale,
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "env": {
            k: os.environ.get(k)
            for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS")
        },
        "launched": DistEnv.from_env().launched,
    }


def _fail_some(rank: int, pid_dir: str) -> None:
    import os
    import time
    from pathlib import Path

    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 0:
        raise ValueError("culprit on rank 0")
    if rank == 1:
        raise KeyError("second failure on rank 1")
    time.sleep(60)  # rank 2 hangs, like a rank blocked in a collective


@pytest.mark.timeout(30)
def test_run_ranks_returns_results_in_rank_order_with_launcher_env():
    results = run_ranks(_env_and_result, 3, 10, timeout=20)
    assert [r["value"] for r in results] == [0, 10, 20]
    for rank, r in enumerate(results):
        assert r["launched"] and r["threads"] == 1
        assert r["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": "1",
        }
    assert len({r["pid"] for r in results}) == 3


@pytest.mark.timeout(30)
def test_run_ranks_reports_every_failing_rank_and_kills_the_hung_one(tmp_path, monkeypatch):
    import os
    import time

    from support.mp import RankError

    monkeypatch.setenv("DPTRAIN_TEST_NATIVE_STACKS", "0")  # gdb would take seconds per rank
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_fail_some, 3, str(tmp_path), timeout=20, grace=0.5)
    assert time.monotonic() - t0 < 10, "the hung rank must be killed soon after the others failed"
    msg = str(info.value)
    assert "culprit on rank 0" in msg and "second failure on rank 1" in msg
    assert info.value.killed == [2] and sorted(info.value.failed) == [0, 1]
    assert "_fail_some" in msg.split("===== rank 2")[1], "the hung rank's stack must be in the report"
    for rank in range(3):
        pid = int((tmp_path / f"{rank}.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # no orphan left behind


@pytest.mark.timeout(30)
def test_run_ranks_timeout_kills_all_ranks(monkeypatch):
    import time

    from support.mp import RankError

    monkeypatch.setenv("DPTRAIN_TEST_NATIVE_STACKS", "0")
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(lambda rank: time.sleep(60), 2, timeout=1)
    assert time.monotonic() - t0 < 8
    assert info.value.timed_out == [0, 1]
    assert "timed out after 1s" in str(info.value)
