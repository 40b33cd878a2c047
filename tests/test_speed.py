"""Speed switches: train.compile parity under DDP and FSDP2, FSDP2 explicit prefetch parity, the
DataLoader's prefetch settings, the profiler window (validation and a 2-rank run writing per-rank
traces and the table), the CUDA flags, and benchmarks/gpu_check.sh refusing without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dptrain.config import ConfigError, resolve
from dptrain.config.load import load_config
from dptrain.train.trainer import Trainer
from support import ROOT
from support.mp import run_ranks

TINY = ["model.kwargs.dim=32", "model.kwargs.n_layers=2", "model.kwargs.n_heads=2", "model.kwargs.max_seq_len=16",
        "data.kwargs.seq_len=16", "data.num_workers=0", "optim.name=sgd", "optim.lr=0.5", "optim.weight_decay=0",
        "optim.warmup_steps=0", "optim.schedule=constant", "train.max_steps=3", "train.log_every_steps=1",
        "train.eval_every_steps=0", "train.eval_batches=1", "train.global_batch_size=8", "train.micro_batch_size=2",
        "parallel.device=cpu", "parallel.timeout_s=120", "log.progress=false", "checkpoint.keep_last=1"]


def _fit(rank: int, items: list[str], out_dir: str) -> dict[str, Any]:
    trainer = Trainer(load_config(None, items), out_dir=out_dir)
    summary = trainer.fit()
    blocks = list(trainer.module.layers)
    summary["compiled_blocks"] = sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    from torch._dynamo.utils import counters

    summary["graphs"] = int(counters["stats"]["unique_graphs"])
    return summary


def _train(tmp: Path, name: str, items: list[str], world: int = 2, timeout: float = 200) -> tuple[dict, list[dict]]:
    out = tmp / name
    summaries = run_ranks(_fit, world, [*TINY, *items], str(out), timeout=timeout)
    return load_file(str(out / "final" / "model.safetensors")), summaries


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()  # compiled in place: the same parameter names
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,backend", [("ddp", "inductor"), ("fsdp", "aot_eager")])
def test_compile_matches_eager_on_two_ranks(tmp_path: Path, strategy: str, backend: str) -> None:
    eager, _ = _train(tmp_path, "eager", [f"parallel.strategy={strategy}"])
    compiled, summaries = _train(tmp_path, "compiled", [f"parallel.strategy={strategy}", "train.compile=true",
                                                        f"train.compile_backend={backend}"])
    assert all(s["compiled_blocks"] == 2 and s["graphs"] >= 1 for s in summaries), summaries
    assert _max_diff(eager, compiled) < 1e-5
    if strategy == "fsdp":  # guard (once): the tolerance would catch one step less of training
        short, _ = _train(tmp_path, "short", [f"parallel.strategy={strategy}", "train.max_steps=2"])
        assert _max_diff(eager, short) > 1e-3


@pytest.mark.timeout(200)
def test_fsdp_explicit_prefetch_gives_the_same_weights(tmp_path: Path) -> None:
    items = ["parallel.strategy=fsdp", "model.kwargs.n_layers=3"]
    implicit, _ = _train(tmp_path, "implicit", items)
    explicit, _ = _train(tmp_path, "explicit", [*items, "parallel.fsdp_forward_prefetch=2",
                                                "parallel.fsdp_backward_prefetch=2",
                                                "parallel.reshard_after_forward=false"])
    assert _max_diff(implicit, explicit) == 0.0


@pytest.mark.timeout(300)
def test_reshard_after_forward_to_two_of_four_ranks_gives_the_same_weights(tmp_path: Path) -> None:
    items = ["parallel.strategy=fsdp", "train.max_steps=2"]
    full, _ = _train(tmp_path, "full", items, world=4, timeout=280)
    pairs, _ = _train(tmp_path, "pairs", [*items, "parallel.reshard_after_forward=2"], world=4, timeout=280)
    assert _max_diff(full, pairs) == 0.0


def _prefetch_targets(rank: int) -> list[list[list[int]]]:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from dptrain.models.llama import build_llama
    from dptrain.parallel.fsdp import apply_fsdp

    dist.init_process_group("gloo")
    try:
        model = build_llama(dim=16, n_layers=4, n_heads=2, max_seq_len=8)
        apply_fsdp(model, device=torch.device("cpu"), prefetch=(2, 1))
        index = {id(b): i for i, b in enumerate(model.layers)}
        blocks = [b for b in model.layers if isinstance(b, FSDPModule)]
        fwd = [[index[id(m)] for m in _modules(b, "forward")] for b in blocks]
        bwd = [[index[id(m)] for m in _modules(b, "backward")] for b in blocks]
        return [fwd, bwd]
    finally:
        dist.destroy_process_group()


def _modules(block: Any, direction: str) -> list[Any]:
    state = block._get_fsdp_state()
    states = state._states_to_forward_prefetch if direction == "forward" else state._states_to_backward_prefetch
    return [s._modules[0] for s in states]


@pytest.mark.timeout(60)
def test_prefetch_targets_are_the_next_and_previous_blocks() -> None:
    fwd, bwd = run_ranks(_prefetch_targets, 2, timeout=50)[0]
    assert fwd == [[1, 2], [2, 3], [3], []]
    assert bwd == [[], [0], [1], [2]]


@pytest.mark.fast
@pytest.mark.parametrize("value,message", [
    ("0-2", "first step must be >= 1"), ("5-3", "not after the last"), ("a-b", 'write it as "A-B"'),
    ("3-", 'write it as "A-B"'), ("2-9", "ends after train.max_steps=5"), ("1-2-3", 'write it as "A-B"'),
])
def test_profile_steps_refused_before_launch(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        resolve(load_config(None, [f"diagnostics.profile_steps={value}", "train.max_steps=5"]), world_size=2)
    assert "diagnostics.profile_steps" in str(e.value)


@pytest.mark.fast
def test_profile_steps_accepts_a_range_and_one_step() -> None:
    from dptrain.config.speed_checks import parse_profile_steps

    assert parse_profile_steps("10-12") == (10, 12)
    assert parse_profile_steps("4") == (4, 4)
    assert load_config(None, ["diagnostics.profile_steps=4"]).diagnostics.profile_steps == "4"


@pytest.mark.timeout(60)
def test_dptrain_run_exits_2_on_a_bad_profile_range(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dptrain", "run", "diagnostics.profile_steps=8-20",
                           "train.max_steps=10", f"log.out_dir={tmp_path / 'r'}"], capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 2, proc.stderr
    assert "profile_steps='8-20' ends after train.max_steps=10" in proc.stderr


@pytest.mark.timeout(200)
def test_profile_writes_a_trace_per_rank_and_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, summaries = _train(tmp_path, "prof", ["parallel.strategy=ddp", "train.max_steps=4",
                                             "diagnostics.profile_steps=2-3"])
    profile = tmp_path / "prof" / "profile"
    for rank in (0, 1):
        trace = json.loads((profile / f"rank{rank}.json").read_text())
        steps = {e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#1", "ProfilerStep#2"}  # steps 2 and 3 (the profiler counts from 0)
        table = (profile / f"rank{rank}_ops.txt").read_text()
        assert "Self CPU" in table and f"rank {rank}: per profiled step" in table
        assert "communication ops:" in table and "allreduce" in table.lower()
    prof = summaries[0]["profile"]
    assert prof["steps"] == 2 and 0 < prof["communication_cpu_ms_per_step"] < prof["self_cpu_ms_per_step"]
    summary = json.loads((tmp_path / "prof" / "summary.json").read_text())
    assert summary["profile"]["communication_share"] == pytest.approx(prof["communication_share"])


@pytest.mark.fast
def test_communication_names() -> None:
    from dptrain.diagnostics.profiler import is_communication

    for name in ("c10d::allreduce_", "gloo:all_reduce", "nccl:all_gather", "FSDP::all_gather (layers.0)",
                 "c10d::_reduce_scatter_base_", "_c10d_functional::wait_tensor", "record_param_comms"):
        assert is_communication(name), name
    for name in ("aten::mm", "aten::addmm", "Optimizer.step#AdamW.step", "aten::scaled_dot_product_attention"):
        assert not is_communication(name), name


@pytest.mark.fast
def test_prefetch_factor_needs_workers() -> None:
    with pytest.raises(ConfigError, match=r"data.prefetch_factor=4 needs data.num_workers > 0"):
        resolve(load_config(None, ["data.prefetch_factor=4", "data.num_workers=0"]), world_size=2)
    with pytest.raises(ConfigError, match=r"data.prefetch_factor=0 is not valid"):
        resolve(load_config(None, ["data.prefetch_factor=0", "data.num_workers=2"]), world_size=2)
    resolve(load_config(None, ["data.prefetch_factor=4", "data.num_workers=2"]), world_size=2)


@pytest.mark.fast
def test_loader_gets_the_worker_settings() -> None:
    from dptrain.data import GlobalBatchSampler, build_dataloader

    sampler = GlobalBatchSampler(dataset_len=64, global_batch_size=8, micro_batch_size=4, grad_accum_steps=1,
                                 dp_rank=0, dp_world_size=2, seed=0)
    ds = list(range(64))
    loader = build_dataloader(ds, sampler=sampler, num_workers=2, persistent_workers=False, prefetch_factor=5)  # type: ignore[arg-type]
    assert (loader.persistent_workers, loader.prefetch_factor) == (False, 5)
    assert build_dataloader(ds, sampler=sampler, num_workers=1).persistent_workers  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefetch_factor=3 needs num_workers > 0"):
        build_dataloader(ds, sampler=sampler, num_workers=0, prefetch_factor=3)  # type: ignore[arg-type]


@pytest.mark.fast
@pytest.mark.parametrize("items,message", [
    (["parallel.strategy=fsdp", "parallel.reshard_after_forward=2"], "dp_shard=2 has none, so use true or false"),
    (["parallel.strategy=fsdp", "parallel.reshard_after_forward=3"], "valid sizes at dp_shard=8: 2, 4"),
    (["parallel.strategy=ddp", "parallel.reshard_after_forward=true"], "applies to FSDP2 only"),
    (["parallel.strategy=ddp", "parallel.fsdp_forward_prefetch=1"], "applies to FSDP2 only"),
    (["parallel.strategy=fsdp", "parallel.fsdp_backward_prefetch=-1"], "parallel.fsdp_backward_prefetch=-1"),
])
def test_fsdp_tuning_refusals(items: list[str], message: str) -> None:
    world = 8 if "=3" in items[1] else 2
    with pytest.raises(ConfigError, match=message):
        resolve(load_config(None, items), world_size=world)


@pytest.mark.fast
def test_reshard_after_forward_int_resolves_at_four_ranks() -> None:
    res = resolve(load_config(None, ["parallel.strategy=fsdp", "parallel.reshard_after_forward=2"]), world_size=4)
    assert res.dims.dp_shard == 4
    assert load_config(None, ["parallel.reshard_after_forward=true"]).parallel.reshard_after_forward is True


@pytest.mark.fast
def test_compile_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="train.compile_backend='tvm' is not valid; choose one of: inductor"):
        resolve(load_config(None, ["train.compile_backend=tvm"]), world_size=2)
    with pytest.raises(ConfigError, match="not supported with parallel.pp=2"):
        resolve(load_config(None, ["train.compile=true", "parallel.pp=2", "parallel.strategy=ddp"]), world_size=2)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match=r"needs a C\+\+ compiler, and none was found .*g\+\+"):
        resolve(load_config(None, ["train.compile=true", "parallel.device=cpu"]), world_size=2)
    resolve(load_config(None, ["train.compile=true", "train.compile_backend=aot_eager"]), world_size=2)


def test_cuda_flags_only_on_cuda() -> None:
    from dptrain.train.backend import backend_flags

    train = load_config(None, []).train
    assert backend_flags(train, torch.device("cpu")) == {}
    assert backend_flags(train, torch.device("cuda", 0)) == {"tf32": True, "cudnn_benchmark": True}
    off = load_config(None, ["train.tf32=false", "train.cudnn_benchmark=false"]).train
    assert backend_flags(off, torch.device("cuda", 0)) == {"tf32": False, "cudnn_benchmark": False}


@pytest.mark.timeout(60)
def test_gpu_check_refuses_without_a_gpu() -> None:
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=50, env={**os.environ, "PYTHON": sys.executable})  # this test's torch
    assert proc.returncode == 1
    assert "gpu_check: no GPU to check" in proc.stderr and "CPU-only build" in proc.stderr
    assert proc.stdout == ""


_MALLOC_PROBE = """
import ctypes, json, sys
import torch
from dptrain.config import TrainConfig
from dptrain.train.backend import apply_malloc_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                              "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
kib = None if sys.argv[1] == "null" else int(sys.argv[1])
done = apply_malloc_threshold(TrainConfig(malloc_mmap_threshold_kib=kib))
big = torch.empty(4 << 20)  # 16 MiB: mapped; freeing it raises glibc's dynamic threshold to 16 MiB
del big
before = libc.mallinfo2().hblkhd
t = torch.empty(1 << 20)  # 4 MiB
print(json.dumps({"set": done, "mapped": libc.mallinfo2().hblkhd - before}))
"""


@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_the_malloc_threshold_maps_large_host_tensors_on_their_own() -> None:
    """train.malloc_mmap_threshold_kib (train/backend.py): with it, a 4 MiB host tensor allocated after a 16 MiB one
    was freed gets its own memory map (returned to the system when freed); with null, glibc's dynamic threshold has
    risen and the heap serves it (and keeps it). glibc's own counters (mallinfo2) say which, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    got = {}
    for kib in ("1024", "null"):
        out = subprocess.run([sys.executable, "-c", _MALLOC_PROBE, kib], env=env, capture_output=True, text=True,
                             timeout=50)
        assert out.returncode == 0, out.stderr
        got[kib] = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["1024"] == {"set": 1024 * 1024, "mapped": got["1024"]["mapped"]} and got["1024"]["mapped"] >= 4 << 20
    assert got["null"] == {"set": None, "mapped": 0}
