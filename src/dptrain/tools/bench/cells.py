"""What `dptrain bench` runs: the variants, the world sizes, the batch of each scaling mode, and
which (variant, world, mode) cells the config refuses (reported as skipped, with the reason).

Pure config work, before anything launches: every cell's Config is built and resolved here, so
a bad option or a refused variant is known before the first torchrun starts.

Variants: `raw` (the hand-written DDP loop of bench/raw_ddp.py, the reference; always run),
the strategies `single dp ddp zero1 zero2 fsdp`, and `ddp-<c>` for each gradient compression
`c` (`parallel.grad_compression`: fp16, bf16, powersgd, onebit). The one-process strategies (single, dp)
run only in the world-1 launch (dp drives every GPU from that one process).

Scaling modes: at world 1 one `base` cell per variant (the recipe's own batch resolved at world
1). `strong`: the same global batch at every world size (accumulation shrinks); `weak`: the same
per-rank batch (micro x accum), so the global batch grows with the world. `none`: only world N,
the recipe's batch as given.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dptrain.config import Config, ConfigError, resolve

REFERENCE = "raw"
STRATEGY_VARIANTS = ("single", "dp", "ddp", "zero1", "zero2", "fsdp")
ONE_PROCESS = ("single", "dp")
COMPRESSIONS = ("fp16", "bf16", "powersgd", "onebit")
SCALING = ("none", "strong", "weak", "both")


def all_variants() -> tuple[str, ...]:
    return (REFERENCE, *STRATEGY_VARIANTS, *(f"ddp-{c}" for c in COMPRESSIONS))


@dataclass(frozen=True)
class BenchOptions:
    steps: int = 20
    """Timed steps per variant (after the warm-up)."""
    warmup: int = 3
    """Steps per variant before timing starts (excluded from every number but the loss)."""
    nproc: int = 2
    """The largest world size N; scaling runs 1..N."""
    scaling: str = "both"
    variants: tuple[str, ...] = field(default_factory=all_variants)
    chunk: int = 2
    """Steps a variant runs before the next one takes over (round-robin)."""


def parse_options(*, steps: int, warmup: int, nproc: int, scaling: str, variants: str | None,
                  chunk: int = 2) -> BenchOptions:
    """Checked options (ConfigError naming the value and what is valid)."""
    if steps < 1:
        raise ConfigError(f"--steps={steps} is not valid; use a positive integer (timed steps per variant)")
    if warmup < 0:
        raise ConfigError(f"--warmup={warmup} is not valid; use an integer >= 0 (untimed steps per variant)")
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} is not valid; use a positive integer (the largest world size)")
    if scaling not in SCALING:
        raise ConfigError(f"--scaling={scaling!r} is not valid; choose one of: {', '.join(SCALING)}")
    known = all_variants()
    chosen = known
    if variants is not None:
        chosen = tuple(v.strip() for v in variants.split(",") if v.strip())
        bad = [v for v in chosen if v not in known]
        if bad or not chosen:
            raise ConfigError(
                f"--variants={variants!r}: unknown variant(s) {', '.join(map(repr, bad)) or '(none given)'}; "
                f"choose from: {', '.join(known)}"
            )
        if REFERENCE not in chosen:
            chosen = (REFERENCE, *chosen)  # the reference every ratio is taken against
    return BenchOptions(steps=steps, warmup=warmup, nproc=nproc, scaling=scaling, variants=chosen, chunk=chunk)


@dataclass(frozen=True)
class Cell:
    """One variant at one world size in one scaling mode."""

    variant: str
    world: int
    mode: str
    config: Config | None = None
    skipped: str | None = None
    """Why the config refuses this cell (None: it runs)."""

    @property
    def label(self) -> str:
        return f"{self.variant}-w{self.world}-{self.mode}"


def variant_config(cfg: Config, variant: str) -> Config:
    """`cfg` with the variant's strategy (and compression); `raw` trains the ddp config."""
    strategy, _, compression = variant.partition("-")
    parallel: dict[str, Any] = {"strategy": "ddp" if strategy == REFERENCE else strategy}
    if compression:
        parallel["grad_compression"] = compression
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))


def _batch(cfg: Config, *, mode: str, world: int, base: tuple[int, int, int]) -> Config:
    """The train section of a scaling mode: base = (global, micro, accum) resolved at world 1."""
    g, m, a = base
    if mode == "strong":
        train = dataclasses.replace(cfg.train, global_batch_size=g, micro_batch_size=m, grad_accum_steps=None)
    elif mode in ("weak", "base"):
        train = dataclasses.replace(cfg.train, global_batch_size=g * world, micro_batch_size=m, grad_accum_steps=a)
    else:  # none: the recipe's own batch fields
        return cfg
    return dataclasses.replace(cfg, train=train)


def _bench_settings(cfg: Config, *, opts: BenchOptions) -> Config:
    """What the bench fixes in every variant: its step count, no evaluation or periodic saves inside
    the timed steps, no live progress line (rank 0 prints the table instead)."""
    train = dataclasses.replace(cfg.train, max_steps=opts.warmup + opts.steps, eval_every_steps=0)
    return dataclasses.replace(
        cfg,
        train=train,
        log=dataclasses.replace(cfg.log, progress=False),
        checkpoint=dataclasses.replace(cfg.checkpoint, every_steps=0),
    )


def _cell(cfg: Config, *, variant: str, world: int, mode: str, base: tuple[int, int, int]) -> Cell:
    try:
        c = _batch(variant_config(cfg, variant), mode=mode, world=world, base=base)
        resolve(c, world_size=world)
    except ConfigError as e:
        return Cell(variant, world, mode, skipped=str(e))
    return Cell(variant, world, mode, config=c)


def plan_cells(cfg: Config, *, opts: BenchOptions) -> list[Cell]:
    """Every cell, world by world; raises ConfigError when the recipe itself is invalid."""
    cfg = _bench_settings(cfg, opts=opts)
    try:
        base_res = resolve(variant_config(cfg, "ddp"), world_size=1)
    except ConfigError as e:
        raise ConfigError(f"the recipe does not resolve at world size 1 (the scaling baseline): {e}") from None
    base = (base_res.global_batch_size, base_res.micro_batch_size, base_res.grad_accum_steps)
    if opts.scaling == "none":
        worlds_modes = [(opts.nproc, ["none"])]
    else:
        modes = ["strong", "weak"] if opts.scaling == "both" else [opts.scaling]
        worlds_modes = [(1, ["base"])] + [(w, modes) for w in range(2, opts.nproc + 1)]
    cells = []
    for world, modes in worlds_modes:
        for mode in modes:
            for variant in opts.variants:
                if variant in ONE_PROCESS and world > 1:
                    continue  # one process drives the job: only the world-1 launch runs it
                cells.append(_cell(cfg, variant=variant, world=world, mode=mode, base=base))
    return cells
