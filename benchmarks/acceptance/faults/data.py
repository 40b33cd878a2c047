"""A `data.factory` whose DataLoader worker stalls on rank $FAULT_RANK (see faults/__init__.py)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, get_worker_info

from dptrain.models.toy import build_regression_data
from faults.inject import is_culprit, mark, stall_forever


class StallingData(Dataset):
    """The toy regression data; on the culprit rank, DataLoader worker 0 stalls forever in its item number
    `stall_after_items` + 1 (a read from a hung network file system looks the same)."""

    def __init__(self, inner: Dataset, stall_after_items: int) -> None:
        self.inner, self.stall_after_items, self.loaded = inner, stall_after_items, 0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        worker = get_worker_info()
        if worker is not None and worker.id == 0 and is_culprit():
            self.loaded += 1
            if self.loaded > self.stall_after_items:
                mark()
                stall_forever()
        return self.inner[i]


def stalling_data(*, stall_after_items: int, **kwargs) -> Dataset:
    return StallingData(build_regression_data(**kwargs), stall_after_items)
