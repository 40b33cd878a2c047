"""The reference every benchmark compares against: a hand-written raw PyTorch DDP loop.

It is the loop the field's guides teach, nothing of dptrain's step machinery: DDP, `no_sync` on
all but the last micro-step, loss / accum, backward, clip, step, zero_grad. What it shares with a
dptrain run is the *recipe*, so that both train the same thing: the same model (built under the
same seed), the same micro-batches (dptrain's `GlobalBatchSampler`, which is only a deterministic
index order), the same loss function and the same optimizer and learning-rate schedule
(`optim.param_groups`/`optimizer_spec`/`build_scheduler`: plain torch.optim objects). Used by
`dptrain bench` and benchmarks/perf/overhead.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from dptrain.config import Config, resolve
from dptrain.data import GlobalBatchSampler
from dptrain.train.build import align_labels, build_collate, build_datasets, build_loss_fn, build_model, to_device
from dptrain.train.optim import build_scheduler, optimizer_spec, param_groups

__all__ = ["RawDDP"]


class RawDDP:
    """A raw DDP training loop for `cfg` on this rank (call inside the process group)."""

    def __init__(self, cfg: Config, *, device: torch.device, steps: int, bucket_cap_mb: float = 25.0) -> None:
        import torch.distributed as dist

        res = resolve(cfg, world_size=dist.get_world_size())
        self.accum, self.device, self.cfg = res.grad_accum_steps, device, cfg
        self.ddp = DDP(build_model(cfg.model, seed=cfg.train.seed).to(device), bucket_cap_mb=bucket_cap_mb,
                       gradient_as_bucket_view=True, device_ids=[device.index] if device.type == "cuda" else None)
        cls, kw = optimizer_spec(cfg.optim, lr=res.lr)
        self.opt = cls(param_groups(self.ddp.module, weight_decay=cfg.optim.weight_decay), **kw)
        self.scheduler = build_scheduler(self.opt, cfg=cfg.optim, max_steps=cfg.train.max_steps)
        self.loss_fn = build_loss_fn(cfg.train.loss)
        train_ds, _ = build_datasets(align_labels(cfg.data, self.ddp.module))  # as the Trainer: labels per model
        self.tokens_per_sample: int | None = getattr(train_ds, "seq_len", None)
        sampler = GlobalBatchSampler(
            dataset_len=len(train_ds), global_batch_size=res.global_batch_size, micro_batch_size=res.micro_batch_size,
            grad_accum_steps=res.grad_accum_steps, dp_rank=dist.get_rank(), dp_world_size=dist.get_world_size(),
            seed=cfg.train.seed, shuffle=cfg.data.shuffle,
        )
        index_batches = [mb for s in range(steps) for mb in sampler.micro_batches(s)]
        collate = build_collate(cfg.data)  # data.collate (+ collate_kwargs), or torch's default
        self.batches: Iterator[Any] = iter(DataLoader(train_ds, batch_sampler=index_batches, collate_fn=collate))
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.dtype)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=cfg.precision.init_scale,
                                           growth_interval=cfg.precision.growth_interval,
                                           enabled=self.dtype is torch.float16)

    @property
    def module(self) -> torch.nn.Module:
        return self.ddp.module

    def step(self) -> torch.Tensor:
        """One optimizer step; this rank's loss (its mean over ranks is the global batch's loss)."""
        total = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            batch = to_device(next(self.batches), self.device)
            if micro < self.accum - 1:
                with self.ddp.no_sync():
                    loss = self._loss(batch)
                    self.scaler.scale(loss).backward()
            else:
                loss = self._loss(batch)
                self.scaler.scale(loss).backward()  # DDP all-reduces the gradients here
            total += loss.detach()
        self.scaler.unscale_(self.opt)
        if self.cfg.optim.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), self.cfg.optim.grad_clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.scheduler.step()
        self.opt.zero_grad(set_to_none=True)
        return total

    def _loss(self, batch: Any) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            return self.loss_fn(self.ddp, batch) / self.accum
