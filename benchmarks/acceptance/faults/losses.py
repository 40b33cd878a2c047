"""`train.loss` factories that inject one fault on rank $FAULT_RANK at step $FAULT_STEP (see faults/__init__.py).

Each is the model's own loss on every other rank and step, so the run trains as the built-in recipe would until
the fault.
"""

from __future__ import annotations

import os
import resource
import signal
import threading
import time

import psutil
import torch
import torch.distributed as dist
from torch import nn

from faults.cgroup import confine
from faults.inject import fault_step, is_culprit, mark, rank, stall_forever, training_step

KILL_AFTER_S = 0.3
"""The culprit is killed this long after entering the step, while it waits in the gradient all-reduce for the
others, which spend PEERS_LATE_S longer in their loss."""
PEERS_LATE_S = 1.0
STRAGGLER_BASE_S = 0.02
"""Every rank's loss takes this long; the straggler's 3x as long (its step is 3x slower)."""
MEMORY_HEADROOM = 512 << 20
"""The culprit's address space is capped at its size at the fault plus this (RLIMIT_AS): only it runs out."""


def kill_mid_collective(model: nn.Module, batch) -> torch.Tensor:
    """The culprit is SIGKILLed while it waits in the backward's gradient all-reduce."""
    if training_step(model) == fault_step():
        if is_culprit():
            def kill() -> None:
                mark()
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Timer(KILL_AFTER_S, kill).start()
        else:
            time.sleep(PEERS_LATE_S)
    return model(batch)


def stuck_in_python(model: nn.Module, batch) -> torch.Tensor:
    """The culprit never returns from its loss (sleeps, as a rank waiting on a lock nobody releases does)."""
    if training_step(model) == fault_step() and is_culprit():
        mark()
        stall_forever()
    return model(batch)


def sync_metrics(first: str) -> None:
    """A user's metric sync: an all-reduce of 4 floats and an all-gather of 4 floats, in the order `first` says."""
    total = torch.ones(4)
    gathered = [torch.zeros(4) for _ in range(dist.get_world_size())]
    if first == "all_reduce":
        dist.all_reduce(total)
        dist.all_gather(gathered, torch.ones(4))
    else:
        dist.all_gather(gathered, torch.ones(4))
        dist.all_reduce(total)


def collectives_out_of_order(model: nn.Module, batch) -> torch.Tensor:
    """At the fault step every rank syncs metrics; the culprit calls the two collectives the other way round."""
    if training_step(model) == fault_step():
        if is_culprit():
            mark()
        sync_metrics("all_gather" if is_culprit() else "all_reduce")
    return model(batch)


def collective_shape_differs(model: nn.Module, batch) -> torch.Tensor:
    """At the fault step every rank all-reduces a counter of 4 floats; the culprit's has 6."""
    if training_step(model) == fault_step():
        if is_culprit():
            mark()
        counts = torch.ones(6 if is_culprit() else 4)
        dist.all_reduce(counts)
    return model(batch)


def pipeline_send_skipped(model: nn.Module, batch) -> torch.Tensor:
    """At the fault step every rank passes 4 floats to the next rank and receives the previous one's (a pipeline's
    activations, in a ring); the culprit never sends its own (a stage that took another branch), so the next rank waits
    in `recv` for ever while the culprit goes on to the gradient all-reduce. gloo's send/recv are not in the flight
    recorder: the desync watchdog reads them from the stacks."""
    if training_step(model) == fault_step():
        if is_culprit():
            mark()
        n, r = dist.get_world_size(), rank()
        sent = None if is_culprit() else dist.isend(torch.ones(4), (r + 1) % n)
        dist.recv(torch.zeros(4), (r - 1) % n)
        if sent is not None:
            sent.wait()
    return model(batch)


def straggler(model: nn.Module, batch) -> torch.Tensor:
    """Every rank's loss takes STRAGGLER_BASE_S; from the fault step on, the culprit's takes 3x as long."""
    slow = training_step(model) >= fault_step() and is_culprit()
    if slow:
        mark()
    time.sleep(STRAGGLER_BASE_S * (3 if slow else 1))
    return model(batch)


def nan_on_one_rank(model: nn.Module, batch) -> torch.Tensor:
    """The culprit's loss is NaN at the fault step (e.g. a corrupt sample, a log of zero)."""
    loss = model(batch)
    if training_step(model) == fault_step() and is_culprit():
        mark()
        return loss * float("nan")
    return loss


def oom_killed(model: nn.Module, batch) -> torch.Tensor:
    """At the fault step the culprit moves into a memory cgroup of its own, capped just above its size, and keeps
    allocating until the kernel's OOM killer ends it with SIGKILL (faults/cgroup.py)."""
    if training_step(model) == fault_step() and is_culprit():
        confine(MEMORY_HEADROOM)
        mark()
        hoard = []
        while True:
            hoard.append(torch.ones(16 << 20))  # 64 MiB, touched
    return model(batch)


def exhaust_host_memory(model: nn.Module, batch) -> torch.Tensor:
    """At the fault step the culprit's address space is capped just above its size, then it keeps allocating
    (as a leak or an oversized batch does) until it runs out. Only the culprit: the cap is its own RLIMIT_AS."""
    if training_step(model) == fault_step() and is_culprit():
        cap = psutil.Process().memory_info().vms + MEMORY_HEADROOM
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
        mark()
        hoard = []
        while True:
            hoard.append(torch.ones(16 << 20))  # 64 MiB, touched
    return model(batch)
