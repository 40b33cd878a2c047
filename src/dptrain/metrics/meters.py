"""The run's meters, for the trainer: communication (metrics/comm.py), throughput per rank and MFU
(metrics/mfu.py). The trainer makes four calls: `ddp_comm_hook` (before `parallelize`), `attach`
(after it, with the plan), `steps_done` (the steps since the last call, handed over at log steps and
the end: nothing per step) and `record`/`summary` (log steps and the end). Nothing here syncs with
the device per step or issues a collective per step; `attach`
on CPU measures the matmul peak once and averages it over the ranks (one collective, at setup).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dptrain.config import ParallelConfig
from dptrain.config.compression import fsdp_reduce_dtype
from dptrain.config.layout import DataParallelMode
from dptrain.distributed import collectives
from dptrain.distributed.mesh import ParallelMesh
from dptrain.metrics import mfu as mfu_lib
from dptrain.metrics.comm import (
    CommMeter,
    FixedBytes,
    bucket_payload,
    ddp_grad_bytes,
    fsdp_comm_bytes,
    zero1_broadcast_bytes,
)
from dptrain.parallel.fsdp import DTYPES

CommHookPair = tuple[Any, Callable[..., Any]]


def hooks_ddp(*, mode: DataParallelMode, mesh: ParallelMesh) -> bool:
    """The plan will be torch's DDP class (strategies ddp/zero1 without tp or pp): its gradient
    reduction is a hookable, hence measurable, communication hook."""
    return mode.wrapper == "ddp" and mesh.dims.tp == 1 and mesh.dims.pp == 1


class RunMeters:
    """Communication, throughput and MFU of one rank's run."""

    def __init__(self, *, mode: DataParallelMode, mesh: ParallelMesh, device: torch.device, precision: str,
                 flops_per_token: float | None = None, peak_tflops: float | None = None,
                 comm_times: bool = False) -> None:
        self.mode, self.mesh, self.device, self.precision = mode, mesh, device, precision
        self.comm_times = comm_times  # log.comm_times: meter DDP's buckets (a Python hook) for comm_s, exposed_comm_s
        self._flops_override, self._peak_override = flops_per_token, peak_tflops
        self.comm: CommMeter | None = None
        self.flops_per_token: float | None = None
        self.flops_source = ""
        self.peak = mfu_lib.Peak(None, "not measured")
        self.world = mesh.dims.world_size

    # ---------------------------------------------------------------- building
    def ddp_comm_hook(self, custom: Any = None) -> CommHookPair | None:
        """The metered (state, hook) for `parallelize(comm_hook=...)`, or None when the plan is not
        DDP. `custom`: a `CommHook` (`.state`, `.hook`, `.payload_bytes(bucket)`) from
        parallel/comm_hooks.py; None: with `comm_times`, torch's default all-reduce hook (the same
        arithmetic as DDP's built-in reduction: each gradient divided by the world size, then summed),
        else no hook at all (DDP's built-in C++ reduction; `attach` counts the bytes from the gradients)."""
        if not hooks_ddp(mode=self.mode, mesh=self.mesh) or (custom is None and not self.comm_times):
            return None
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        fixed = FixedBytes()
        self.comm = CommMeter(group_size=self.mesh.grad_size, device=self.device, fixed=fixed)
        if custom is None:  # over dp, or dp x cp (the cp ranks' gradients are of different tokens)
            return self.comm.wrap(self.mesh.grad_group, default_hooks.allreduce_hook, bucket_payload)
        self.comm.outside = getattr(custom, "sent_outside", None)
        return self.comm.wrap(custom.state, custom.hook, custom.payload_bytes, collective=custom.collective)

    def attach(self, model: nn.Module, *, cfg: ParallelConfig, seq_len: int | None) -> None:
        """After `parallelize`: analytic bytes (FSDP2, ZeRO-1), FLOPs per token from `model` (the
        plain module; meta is fine), the peak FLOP/s (measured on CPU: every rank, then the mean)."""
        dims = self.mesh.dims
        if self.mode.wrapper == "fsdp" and dims.tp == 1 and dims.pp == 1:
            fixed = fsdp_comm_bytes(
                model,
                shard=dims.dp_shard * dims.cp,  # under cp FSDP2 shards over dp_shard x cp
                replicate=dims.dp_replicate,
                reshard_after_forward=(
                    self.mode.reshard_after_forward
                    if cfg.reshard_after_forward is None  # an int: counted as true
                    else bool(cfg.reshard_after_forward)
                ),
                param_dtype=DTYPES[cfg.fsdp_param_dtype] if cfg.fsdp_param_dtype else None,
                reduce_dtype=DTYPES[rd] if (rd := fsdp_reduce_dtype(cfg)) else None,
            )  # grad_compression fp16/bf16 too
            self.comm = CommMeter(group_size=dims.grad_size, device=self.device, fixed=fixed, timed=False)
        elif self.comm is None and hooks_ddp(mode=self.mode, mesh=self.mesh):  # DDP, no hook: bytes, no times
            self.comm = CommMeter(group_size=dims.grad_size, device=self.device, timed=False,
                                  fixed=FixedBytes(per_sync=ddp_grad_bytes(model, n=dims.grad_size)))
        elif self.comm is None and dims.world_size == 1 and self.mode.wrapper == "none":
            self.comm = CommMeter(group_size=1, device=self.device, timed=False)  # nothing to send
        if self.comm is not None and self.mode.shard_optimizer and hooks_ddp(mode=self.mode, mesh=self.mesh):
            # zero1: each rank broadcasts its updated partition after every step
            broadcast = zero1_broadcast_bytes(model, n=dims.dp_size)
            self.comm.fixed = dataclasses.replace(self.comm.fixed, per_step=broadcast)
        self.flops_per_token, self.flops_source = mfu_lib.model_flops_per_token(
            model, seq_len=seq_len, override=self._flops_override
        )
        self.peak = mfu_lib.peak_flops(
            device=self.device, precision=self.precision, override_tflops=self._peak_override
        )
        if self._peak_override is None and self.device.type == "cpu" and self.peak.flops:
            mean = collectives.all_reduce_mean([self.peak.flops], device=self.device)[0]  # setup only
            self.peak = mfu_lib.Peak(mean, self.peak.source + f", mean over {collectives.world_size()} rank(s)")

    # ---------------------------------------------------------------- per log line
    def steps_done(self, steps: int, *, micro_steps: int, sync_steps: int) -> None:
        """`steps` optimizer steps since the last call, each of `micro_steps` micro-steps, `sync_steps` of which
        reduced gradients (called at log steps and the end, before `record`/`summary`)."""
        if self.comm is not None:
            self.comm.steps_done(steps, micro_steps=micro_steps, sync_steps=sync_steps)

    def record(self, throughput: dict[str, float]) -> dict[str, Any]:
        """Fields for a log record (comm means over the window since the last call) from the
        trainer's total throughput (`samples_per_s`, `tokens_per_s`)."""
        comm: dict[str, Any] = self.comm.window() if self.comm is not None else {}
        if self.comm is None:
            comm = {"comm_bytes": None, "comm_s": None, "exposed_comm_s": None}
        return {**comm, **self.rates(throughput)}

    def rates(self, throughput: dict[str, float]) -> dict[str, Any]:
        """Per-rank throughput (total / world size: every rank, tp and pp included) and MFU."""
        out: dict[str, Any] = {"samples_per_s_per_rank": throughput["samples_per_s"] / self.world}
        tokens = throughput.get("tokens_per_s")
        if tokens is not None:
            out["tokens_per_s_per_rank"] = tokens / self.world
        out["mfu"] = (
            mfu_lib.mfu(
                tokens_per_s=tokens, flops_per_token=self.flops_per_token, devices=self.world, peak=self.peak.flops
            )
            if tokens is not None and self.flops_per_token and self.peak.flops
            else None
        )
        return out

    def summary(self, throughput: dict[str, float]) -> dict[str, Any]:
        """summary.json's fields: run means of the communication, per-rank rates, MFU and its inputs."""
        out: dict[str, Any] = {"comm_bytes": None, "comm_s": None, "exposed_comm_s": None}
        if self.comm is not None:
            self.comm.window()  # fold in the steps after the last log line
            out.update(self.comm.summary())
        out.update(self.rates(throughput))
        out.update(
            flops_per_token=self.flops_per_token,
            flops_per_token_source=self.flops_source,
            peak_flops=self.peak.flops,
            peak_flops_source=self.peak.source,
        )
        return out
