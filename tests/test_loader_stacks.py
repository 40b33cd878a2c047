"""A rank waiting for its DataLoader names where the worker is (diagnostics/loader_stacks.py): the workers of
`build_dataloader` write their stacks on SIGUSR2 when the hub set the folder; a real worker process, stalled in its
dataset's __getitem__, answers with that line."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from torch.utils.data import Dataset

from dptrain.data import GlobalBatchSampler
from dptrain.data.loader import LOADER_STACKS_ENV, build_dataloader
from dptrain.diagnostics.loader_stacks import innermost_own_line, waits_for_loader, worker_sites

pytestmark = pytest.mark.timeout(60)


class Stalls(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(3600)  # the stalled line
        return torch.zeros(2)


def _line(text: str) -> int:
    return next(n for n, line in enumerate(open(__file__).read().splitlines(), 1) if text in line)


def test_innermost_own_line_skips_the_standard_library_and_torch():
    dump = (f'Current thread 0x1 (most recent call first):\n  File "{threading.__file__}", line 320 in wait\n'
            f'  File "{torch.__file__}", line 1 in f\n  File "/home/u/data.py", line 31 in __getitem__\n'
            '  File "/home/u/train.py", line 9 in <module>\n')
    assert innermost_own_line(dump) == "data.py:31 in __getitem__"
    assert innermost_own_line("Thread 0x1:\n  <no Python frame>\n") is None
    idle = (f'  File "{threading.__file__}", line 1 in get\n'
            '  File "/site/torch/utils/data/_utils/worker.py", line 9 in _worker_loop\n'
            '  File "/home/u/train.py", line 9 in <module>\n')  # below the loop: the parent's frames, copied by fork
    assert innermost_own_line(idle) == "idle (waiting for an index)"


def test_a_stalled_worker_answers_with_its_line_while_the_main_thread_waits_in_the_dataloader(tmp_path, monkeypatch):
    monkeypatch.setenv(LOADER_STACKS_ENV, str(tmp_path))
    sampler = GlobalBatchSampler(dataset_len=64, global_batch_size=4, micro_batch_size=4, grad_accum_steps=1,
                                 dp_rank=0, dp_world_size=1)
    loader = build_dataloader(Stalls(), sampler=sampler, num_workers=1, persistent_workers=False)
    it = iter(loader)
    waiter = threading.Thread(target=lambda: next(it), daemon=True)  # the "training thread", waiting for a batch
    waiter.start()
    try:
        deadline = time.monotonic() + 20
        sites: list[str] = []
        while time.monotonic() < deadline and not any("__getitem__" in s for s in sites):
            time.sleep(0.3)  # the worker imports and starts fetching first
            sites = worker_sites(timeout_s=2.0)
        assert sites == [f"worker pid {it._workers[0].pid} at test_loader_stacks.py:{_line('the stalled line')} "
                         "in __getitem__"], sites
        assert waits_for_loader(sys._current_frames()[waiter.ident])
        assert not waits_for_loader(sys._current_frames()[threading.get_ident()])
    finally:
        it._shutdown_workers()
    monkeypatch.delenv(LOADER_STACKS_ENV)
    assert worker_sites() == []  # no folder set: nothing is signalled
