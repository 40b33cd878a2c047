"""`parallel.nvme_offload_dir`: the optimizer state in memory-mapped files on a drive (DeepSpeed's
`offload_optimizer: {"device": "nvme", "nvme_path": ...}`, ZeRO-Infinity's optimizer offload).

After every optimizer step (and after a checkpoint's state is loaded) each state tensor of the optimizer that
does not yet live in a file is copied, bit for bit, into a tensor backed by a file under the directory
(`torch.from_file(..., shared=True)`: a MAP_SHARED mapping, so its pages are the file's pages and the kernel
writes them back to the drive instead of holding them in anonymous RAM). The optimizer then updates the mapped
tensors in place, so training is bit-identical to keeping the state in RAM. Under zero2/fsdp the state is DTensor
shards: each rank maps only its own shard (the DTensor is rebuilt around the mapped local tensor). Under zero1
the rank's local optimizer (ZeroRedundancyOptimizer's `optim`) holds the rank's share.

The files are unlinked as soon as they are mapped: the mapping keeps the space until the tensors are freed, and a
crashed run leaves nothing behind (they show in /proc/PID/maps as `... (deleted)`). Scalars (`step`) stay in RAM.
What DeepSpeed does beyond this (asynchronous swapping through libaio with pinned buffers, so the optimizer state
is streamed through a small window of host memory) is not done: the page cache decides which pages are resident.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dptrain.config.nvme import check_nvme_dir


def file_backed(t: torch.Tensor) -> bool:
    """Whether `t` (or a DTensor's local shard) lives in a mapped file."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return bool(getattr(local.untyped_storage(), "filename", None))


class NvmeOptimizerState:
    """Keeps `optimizer`'s state tensors in files under `directory` (hooks on its step and state loading)."""

    def __init__(self, optimizer: torch.optim.Optimizer, directory: str | Path, *, rank: int = 0) -> None:
        self.directory = check_nvme_dir(directory)
        self.optimizer = optimizer
        self.inner: torch.optim.Optimizer = getattr(optimizer, "optim", optimizer)  # zero1: the rank's optimizer
        self.prefix = f"dptrain-optim-r{rank}-p{os.getpid()}"
        self.counter = itertools.count()
        self.bytes_mapped = 0
        optimizer.register_step_post_hook(lambda *_: self.move())
        optimizer.register_load_state_dict_post_hook(lambda *_: self.move())

    def _mapped(self, local: torch.Tensor) -> torch.Tensor:
        path = self.directory / f"{self.prefix}-{next(self.counter)}.bin"
        out = torch.from_file(str(path), shared=True, size=local.numel(), dtype=local.dtype)
        os.unlink(path)  # the mapping keeps the blocks; nothing is left behind after the run
        out = out.view(local.shape).copy_(local)
        self.bytes_mapped += out.numel() * out.element_size()
        return out

    def _to_file(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            local = self._mapped(t.to_local())
            return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride())
        return self._mapped(t)

    @torch.no_grad()
    def move(self) -> None:
        """Every state tensor with more than one element that is not file-backed yet goes to a file."""
        for st in self.inner.state.values():
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.numel() > 1 and not file_backed(v):
                    st[k] = self._to_file(v)

    def state_tensors(self) -> list[tuple[Any, torch.Tensor]]:
        """(key, tensor) of every state tensor with more than one element."""
        return [(k, v) for st in self.inner.state.values() for k, v in st.items()
                if isinstance(v, torch.Tensor) and v.numel() > 1]
