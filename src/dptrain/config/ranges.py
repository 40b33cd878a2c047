"""The valid range of every numeric config field (`RANGES`, one row each) and the check that refuses a value
outside it (`check_ranges`), naming the value and the range. Checked before any process starts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dptrain.config.fields import ConfigError


@dataclass(frozen=True)
class Range:
    """The valid values of one numeric field: its kind, bounds (open or closed) and whether null is allowed."""

    kind: type  # int or float; floats must also be finite
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    note: str = ""

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a finite number"
        lo, hi = (f"{x:d}" if self.kind is int else f"{x:g}" for x in (self.low or 0, self.high or 0))
        if self.low is not None and self.high is not None:
            rng = f" in {'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'}"
        elif self.low is not None:
            rng = f" {'>' if self.low_open else '>='} {lo}"
        elif self.high is not None:
            rng = f" {'<' if self.high_open else '<='} {hi}"
        else:
            rng = ""
        return what + rng + (" or null" if self.optional else "") + (f" ({self.note})" if self.note else "")

    def accepts(self, v: object) -> bool:
        if v is None:
            return self.optional
        if isinstance(v, bool) or not isinstance(v, int | float) or (self.kind is int and not isinstance(v, int)):
            return False
        if not math.isfinite(v):
            return False
        if self.low is not None and (v < self.low or (self.low_open and v == self.low)):
            return False
        return self.high is None or (v < self.high if self.high_open else v <= self.high)


_SEED_MAX = 2**63 - 1  # torch.manual_seed takes int64; numpy's SeedSequence takes any non-negative int
POS_INT, NONNEG_INT = Range(int, 1), Range(int, 0)
POS_FLOAT, NONNEG_FLOAT = Range(float, 0, low_open=True), Range(float, 0)

_YEAR_S = 365 * 86_400  # the longest timeout that means anything (timedelta and the C++ side overflow far above)

# Every numeric field, by section: one row each. Checked before any process starts.
RANGES: dict[str, dict[str, Range]] = {
    "train": {
        "max_steps": POS_INT,
        "log_every_steps": POS_INT,
        "eval_batches": POS_INT,
        "loss_chunk_tokens": Range(int, 0, optional=True, note="0: off; null: 32 MiB of logits per chunk"),
        "eval_every_steps": Range(int, 0, note="0: only at the start and the end"),
        "global_batch_size": Range(int, 1, optional=True),
        "micro_batch_size": Range(int, 1, optional=True),
        "grad_accum_steps": Range(int, 1, optional=True),
        "seed": Range(int, 0, _SEED_MAX),
        "flops_per_token": Range(float, 0, low_open=True, optional=True, note="null: from the model"),
        "malloc_mmap_threshold_kib": Range(int, 0, 32768, optional=True, note="KiB: glibc's limit is 32 MiB; null: "
                                           "glibc's dynamic threshold"),
    },
    "optim": {
        "lr": POS_FLOAT,
        "weight_decay": NONNEG_FLOAT,
        "momentum": Range(float, 0, 1, high_open=True),
        "eps": POS_FLOAT,
        "base_batch_size": Range(int, 1, optional=True),
        "warmup_steps": NONNEG_INT,
        "freeze_step": Range(int, 1, note="the variance needs at least one full Adam step"),
        "max_coeff": POS_FLOAT,
        "min_coeff": POS_FLOAT,
        "coeff_beta": Range(float, 0, 1, high_open=True),
        "factor_max": POS_FLOAT,
        "factor_min": POS_FLOAT,
        "factor_threshold": Range(float, 0, 1, high_open=True),
        "min_lr_ratio": Range(float, 0, 1),
        "warmup_start_ratio": Range(float, 0, 1),
        "grad_clip": Range(float, 0, low_open=True, optional=True, note="null disables clipping"),
    },
    "parallel": {
        "bucket_cap_mb": Range(float, 0, 1_048_576, low_open=True, note="MiB: at most 1 TiB"),
        "timeout_s": Range(float, 1, _YEAR_S, note="seconds: at least 1, at most a year"),
        "pp_stages_per_rank": POS_INT,
        "pp_microbatches": Range(int, 1, optional=True, note="null: pp"),
        "pp_microbatch_size": Range(int, 1, optional=True),
        "powersgd_rank": POS_INT,
        "onebit_start_step": NONNEG_INT,
        "powersgd_start_step": Range(int, 2, note="DDP rebuilds its buckets after the first step"),
        "fsdp_forward_prefetch": NONNEG_INT,
        "fsdp_backward_prefetch": NONNEG_INT,
    },
    "precision": {
        "init_scale": Range(float, 0, 2.0**64, low_open=True, note="at most 2**64"),
        "growth_interval": POS_INT,
        "hysteresis": POS_INT,
        "min_loss_scale": POS_FLOAT,
        "static_loss_scale": Range(float, 0, 2.0**64, note="0: dynamic; at most 2**64"),
    },
    "launch": {"node_rank": NONNEG_INT, "max_restarts": NONNEG_INT},  # nnodes: config/nodes.py
    "model.lora": {
        "rank": POS_INT,
        "alpha": POS_FLOAT,
        "dropout": Range(float, 0, 1, high_open=True),
    },
    "data": {"num_workers": NONNEG_INT, "prefetch_factor": Range(int, 1, optional=True, note="null: 2")},
    "log": {
        "peak_tflops": Range(float, 0, low_open=True, optional=True, note="null: table or measured"),
        "prometheus_port": Range(int, 0, 65535, note="0 turns the exporter off"),
        "status_every_s": Range(float, 0, 86_400, note="seconds; 0 turns the status files off; at most a day"),
    },
    "checkpoint": {
        "every_steps": Range(int, 0, note="0: only at the end"),
        "keep_last": Range(int, 1, optional=True, note="null keeps all"),
        "snapshot_every_steps": Range(int, 0, optional=True, note="0 turns the in-memory snapshots off; null: auto"),
    },
    "diagnostics": {
        "hang_timeout_s": Range(float, 0, _YEAR_S, optional=True, note="seconds; 0 turns the watchdog off"),
        "desync_after_s": Range(float, 0, _YEAR_S, note="seconds; 0 turns the fast desync verdict off"),
        "collective_check_every_steps": Range(int, 0, note="0 turns it off"),
        "straggler_every_steps": Range(int, 0, note="0 turns it off"),
        "drift_every_steps": Range(int, 0, note="0 turns it off"),
        "rss_every_steps": Range(int, 0, note="0 turns it off"),
        "max_consecutive_skips": POS_INT,
        "rss_window": Range(int, 3),
        "straggler_margin": POS_FLOAT,
        "rss_leak_mb": POS_FLOAT,
    },
}


def check_ranges(section: str, obj: object) -> None:
    """Refuse the first field of `obj` (config section `section`) outside its row of RANGES."""
    for name, rng in RANGES[section].items():
        v = getattr(obj, name)
        if not rng.accepts(v):
            raise ConfigError(f"{section}.{name}={v!r} is not valid; it must be {rng.describe()}")
