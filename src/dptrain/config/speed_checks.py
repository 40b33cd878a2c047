"""Checks of the speed switches, before any process starts: torch.compile (backend, a C++
compiler for inductor on the CPU, no pipeline), the DataLoader's prefetching, FSDP2's prefetch
and `reshard_after_forward`, and the profiler's step range. torch is not imported here.
"""

from __future__ import annotations

import os
import shutil

from dptrain.config.fields import Config, ConfigError, DataConfig, ParallelConfig, TrainConfig

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def parse_profile_steps(text: str | None, *, max_steps: int | None = None) -> tuple[int, int] | None:
    """`"A-B"` (or `"A"`) -> (A, B), 1-based and inclusive; None -> None. ConfigError naming the value
    when it is not a range of positive integers, A > B, or B is beyond `max_steps`."""
    if text is None:
        return None
    parts = str(text).strip().split("-")
    valid = 'write it as "A-B" (steps A to B, 1-based, inclusive; e.g. "10-12") or one step "A"'
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"diagnostics.profile_steps={text!r} is not valid; {valid}")
    first, last = int(parts[0]), int(parts[-1])
    if first < 1 or last < first:
        raise ConfigError(f"diagnostics.profile_steps={text!r} is not valid: the first step must be >= 1 and not after "
                          f"the last; {valid}")
    if max_steps is not None and last > max_steps:
        raise ConfigError(f"diagnostics.profile_steps={text!r} ends after train.max_steps={max_steps}: that step is "
                          f"never trained; profile steps within 1-{max_steps}")
    return first, last


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would call on the CPU ($CXX, else torch's default g++, else c++), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def validate_compile(train: TrainConfig, *, device: str, pp: int) -> None:
    """train.compile: a known backend, no pipeline stages, and for inductor on the CPU a C++ compiler."""
    if train.compile_backend not in COMPILE_BACKENDS:
        raise ConfigError(f"train.compile_backend={train.compile_backend!r} is not valid; choose one of: "
                          f"{', '.join(COMPILE_BACKENDS)}")
    if not train.compile:
        return
    if pp > 1:
        raise ConfigError(f"train.compile=true is not supported with parallel.pp={pp} (pipeline stages are not "
                          "compiled yet); set train.compile=false or parallel.pp=1")
    if train.compile_backend == "inductor" and device == "cpu" and cxx_compiler() is None:
        raise ConfigError(
            "train.compile=true with train.compile_backend=inductor on the CPU needs a C++ compiler, and none was "
            "found (looked for $CXX, g++, c++, clang++ on PATH); install one (Debian: apt-get install g++), or use "
            "train.compile_backend=aot_eager (no code generation), or train.compile=false"
        )


def validate_data_loading(data: DataConfig) -> None:
    """prefetch_factor is a worker setting: refused without workers, and positive."""
    pf = data.prefetch_factor
    if pf is None:
        return
    if isinstance(pf, bool) or not isinstance(pf, int) or pf < 1:
        raise ConfigError(f"data.prefetch_factor={pf!r} is not valid; it must be an integer >= 1 or null")
    if data.num_workers == 0:
        raise ConfigError(
            f"data.prefetch_factor={pf} needs data.num_workers > 0 (it is the number of batches each worker loads "
            "ahead; with num_workers=0 batches load in the training process, one at a time); set data.num_workers "
            "or leave prefetch_factor null"
        )


def validate_fsdp_tuning(p: ParallelConfig, *, wrapper: str, dp_shard: int | None = None) -> None:
    """FSDP2 prefetch counts and reshard_after_forward: only under zero2/fsdp; an int reshard size a
    non-trivial divisor of dp_shard (checked once the layout is known: `dp_shard`)."""
    for name in ("fsdp_forward_prefetch", "fsdp_backward_prefetch"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"parallel.{name}={v!r} is not valid; it must be an integer >= 0 (0: FSDP2's implicit "
                              "prefetch)")
        if v and wrapper != "fsdp":
            raise ConfigError(f"parallel.{name}={v} applies to FSDP2 only; it needs parallel.strategy=zero2 or fsdp "
                              f"(got {p.strategy!r})")
    r = p.reshard_after_forward
    if r is None:
        return
    if wrapper != "fsdp":
        raise ConfigError(f"parallel.reshard_after_forward={r!r} applies to FSDP2 only; it needs "
                          f"parallel.strategy=zero2 or fsdp (got {p.strategy!r})")
    if isinstance(r, bool) or dp_shard is None:
        return
    divisors = [d for d in range(2, dp_shard) if dp_shard % d == 0]
    if r not in divisors:
        valid = (f"valid sizes at dp_shard={dp_shard}: {', '.join(map(str, divisors))}" if divisors else
                 f"dp_shard={dp_shard} has none, so use true or false")
        raise ConfigError(
            f"parallel.reshard_after_forward={r} is not valid: an integer is the group size parameters stay sharded "
            f"over after forward and must divide dp_shard with 1 < N < dp_shard ({valid}); or use true/false"
        )


def validate_speed(cfg: Config, *, wrapper: str) -> None:
    """The world-size-free speed checks (`validate` calls it)."""
    validate_data_loading(cfg.data)
    validate_fsdp_tuning(cfg.parallel, wrapper=wrapper)
    parse_profile_steps(cfg.diagnostics.profile_steps, max_steps=cfg.train.max_steps)
    if cfg.train.compile_backend not in COMPILE_BACKENDS:
        validate_compile(cfg.train, device="cpu", pp=1)  # names the valid backends
