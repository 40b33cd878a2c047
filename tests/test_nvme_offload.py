"""parallel.nvme_offload_dir (DeepSpeed's offload_optimizer device nvme): the optimizer state lives in memory-mapped
files on the drive, training is bit-identical to keeping it in RAM (one process with torch's AdamW; 2 gloo ranks
under fsdp, where each rank maps its DTensor shard), a loaded checkpoint's state goes to files too, the directory
is checked before launch, and DeepSpeed's ZeRO-Infinity config maps to it."""

from __future__ import annotations

import copy
import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dptrain.config import ConfigError, resolve
from dptrain.config.deepspeed import translate_deepspeed
from dptrain.config.load import load_config
from dptrain.config.nvme import check_nvme_dir
from dptrain.parallel.nvme_offload import NvmeOptimizerState, file_backed
from support import overrides
from support.mp import run_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _mapped_under(directory: Path) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(directory) in line]


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_state_lives_in_files_and_training_is_bitwise_the_same(tmp_path):
    ram, disk = _model(), _model()
    opt_ram = torch.optim.AdamW(ram.parameters(), lr=0.01)
    opt_disk = torch.optim.AdamW(disk.parameters(), lr=0.01)
    nvme = NvmeOptimizerState(opt_disk, tmp_path, rank=0)
    _train(ram, opt_ram, 5)
    _train(disk, opt_disk, 5)
    assert all(torch.equal(a, b) for a, b in zip(ram.parameters(), disk.parameters(), strict=True))
    tensors = nvme.state_tensors()
    assert len(tensors) == 2 * 4 and all(file_backed(t) for _, t in tensors)  # exp_avg, exp_avg_sq per parameter
    assert not any(file_backed(t) for _, t in [(k, v) for st in opt_ram.state.values() for k, v in st.items()])
    state_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    assert nvme.bytes_mapped == state_bytes  # each tensor mapped once, then updated in place
    assert len(_mapped_under(tmp_path)) >= 1 and all("(deleted)" in line for line in _mapped_under(tmp_path))
    assert list(tmp_path.iterdir()) == []  # unlinked once mapped: nothing left behind
    # a checkpoint's state loads into RAM tensors; they go to files at once and training stays bitwise the same
    fresh = torch.optim.AdamW(disk.parameters(), lr=0.01)
    NvmeOptimizerState(fresh, tmp_path, rank=0)
    fresh.load_state_dict(copy.deepcopy(opt_ram.state_dict()))  # as from a file: no tensor shared
    assert all(file_backed(v) for st in fresh.state.values() for v in st.values() if v.numel() > 1)
    _train(ram, opt_ram, 2)
    _train(disk, fresh, 2)
    assert all(torch.equal(a, b) for a, b in zip(ram.parameters(), disk.parameters(), strict=True))


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_the_directory_is_checked_and_named(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel.nvme_offload_dir='.*missing' does not exist"):
        check_nvme_dir(tmp_path / "missing")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        NvmeOptimizerState(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1), tmp_path / "f")
    assert check_nvme_dir(tmp_path) == tmp_path
    cfg = load_config(None, [f"parallel.nvme_offload_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="on CUDA needs parallel.cpu_offload=true"):
        resolve(cfg, world_size=1, cuda_available=True)
    resolve(cfg, world_size=1, cuda_available=False)


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_deepspeed_zero_infinity_maps_to_nvme_offload():
    ds = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}}
    m = translate_deepspeed(ds)
    assert m.config["parallel"] == {"strategy": "fsdp", "nvme_offload_dir": "/local_nvme", "cpu_offload": True}
    assert any("offload_param.device='nvme'" in n and "host memory" in n for n in m.notes)
    assert "zero_optimization.offload_optimizer.buffer_count" in m.ignored
    for zero, message in (({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "nvme_path=None is not valid"),
                          ({"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, "stage=1"),
                          ({"stage": 3, "offload_optimizer": {"device": "disk"}}, "use none, cpu or nvme")):
        with pytest.raises(ConfigError, match=message):
            translate_deepspeed({"train_batch_size": 8, "zero_optimization": zero})


TOY = [
    "model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
    "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every_steps=1", "train.eval_every_steps=0",
    "optim.lr=0.01", "optim.warmup_steps=0", "optim.schedule=constant", "log.progress=false",
    "checkpoint.keep_last=null", "diagnostics.preflight=false", "train.max_steps=4", "parallel.strategy=fsdp",
]


def fit(rank: int, out: Path, extra: list[str]) -> tuple[int, bool]:
    from dptrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides(TOY, extra)), out_dir=out)
    trainer.fit()
    nvme = trainer.nvme
    result = (0, False) if nvme is None else (nvme.bytes_mapped, all(file_backed(t) for _, t in nvme.state_tensors()))
    del trainer, nvme
    gc.collect()
    return result


@pytest.mark.timeout(180)
def test_two_fsdp_ranks_with_state_on_the_drive_train_bitwise_as_in_ram(tmp_path):
    (tmp_path / "nvme").mkdir()
    ram = run_ranks(fit, 2, tmp_path / "ram", [], timeout=90)
    disk = run_ranks(fit, 2, tmp_path / "disk", [f"parallel.nvme_offload_dir={tmp_path / 'nvme'}"], timeout=90)
    assert ram == [(0, False), (0, False)]
    assert all(n > 0 and backed for n, backed in disk)  # each rank mapped its own shard of every state tensor

    def losses(run: str) -> list[float]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if "loss" in r]

    assert losses("disk") == losses("ram")
    a, b = (load_file(str(tmp_path / run / "final" / "model.safetensors")) for run in ("ram", "disk"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert list((tmp_path / "nvme").iterdir()) == []
