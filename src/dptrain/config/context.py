"""`parallel.cp` (context parallelism): what it composes with, checked before any process starts (plain data, no
torch). The split itself is parallel/context.py; docs/guides/long-sequences.md says what works and what is refused."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dptrain.config.fields import ConfigError

if TYPE_CHECKING:
    from dptrain.config.dims import ParallelDims
    from dptrain.config.fields import Config
    from dptrain.config.layout import DataParallelMode

CP_MODEL = "dptrain.models.llama:build_llama"
"""The one model whose attention context parallelism knows how to split."""

PACKED_DATA = "dptrain.data.packed:build_packed"
CORPUS_DATA = "dptrain.data.corpus:build_stdlib_lm"

CP_ATTENTIONS = ("auto", "allgather", "ulysses")
"""`parallel.cp_attention`'s values (parallel/context.py: `GatheredKVAttention`, `UlyssesAttention`)."""

LLAMA_DEFAULT_HEADS = 4
"""`dptrain.models.llama.LlamaConfig.n_heads`'s default (config may not import models; a test keeps them equal)."""


def choose_cp_attention(choice: str, *, n_heads: int, n_kv_heads: int, tp: int, cp: int) -> str:
    """The cp attention that runs: ``allgather`` or ``ulysses``. Ulysses' all-to-all hands each cp rank whole rows
    of 1/cp of the rank's local heads (after tp), so both the query heads and the KV heads per tp rank must divide by
    cp; ``auto`` picks ulysses then and the K/V all-gather otherwise, an explicit ``ulysses`` that cannot split is a
    ConfigError naming the numbers and the fix."""
    if choice not in CP_ATTENTIONS:
        raise ConfigError(f"parallel.cp_attention={choice!r} is not valid; choose one of: {', '.join(CP_ATTENTIONS)}")
    if choice == "allgather" or cp == 1:
        return "allgather"
    q, kv = n_heads // tp, n_kv_heads // tp
    if q % cp == 0 and kv % cp == 0:
        return "ulysses"
    if choice == "auto":
        return "allgather"
    raise ConfigError(f"parallel.cp_attention='ulysses' needs the heads each tp rank holds to split over cp: n_heads="
                      f"{n_heads} and n_kv_heads={n_kv_heads} over tp={tp} leave {q} query and {kv} KV heads, not both "
                      f"divisible by cp={cp}; use parallel.cp_attention=allgather (or auto), a cp dividing {q} and "
                      f"{kv}, or more KV heads")


def validate_context_parallel(cfg: Config, *, dims: ParallelDims, mode: DataParallelMode) -> None:
    """Refuse what cp > 1 does not support, naming the value and the fix (nothing to check at cp 1)."""
    cp = dims.cp
    if cp == 1:
        choose_cp_attention(cfg.parallel.cp_attention, n_heads=1, n_kv_heads=1, tp=1, cp=1)  # the value only
        return
    where = f"parallel.cp={cp} ({dims.describe()})"
    if dims.tp > 1 and cfg.parallel.tp_plan is not None:
        raise ConfigError(f"{where}: parallel.tp_plan={cfg.parallel.tp_plan!r} is not supported with cp > 1: context "
                          "parallelism composes with the built-in LLaMA's own tensor-parallel plan (its attention "
                          "must see plain local heads); drop parallel.tp_plan, or use parallel.cp=1")
    if mode.shard_optimizer:
        raise ConfigError(f"{where}: parallel.strategy={cfg.parallel.strategy!r} is not supported with cp > 1; use "
                          "parallel.strategy=ddp, zero2 or fsdp")
    if cfg.model.factory != CP_MODEL or cfg.model.kwargs.get("pretrained") is not None:
        raise ConfigError(f"{where}: model.factory={cfg.model.factory!r} cannot be split over the sequence; context "
                          f"parallelism supports the built-in LLaMA ({CP_MODEL}, no pretrained folder) only: use it, "
                          "or parallel.cp=1")
    if cfg.train.loss is not None:
        raise ConfigError(f"{where}: train.loss={cfg.train.loss!r} would see only this rank's chunks of each row; drop "
                          "train.loss (the model's own token loss is exact under cp), or use parallel.cp=1")
    if cfg.train.eval_fn is not None:
        raise ConfigError(f"{where}: train.eval_fn={cfg.train.eval_fn!r} would see only this rank's chunks of each "
                          "row; drop train.eval_fn (the validation loss is exact under cp), or use parallel.cp=1")
    if cfg.parallel.grad_compression != "none":
        raise ConfigError(f"{where}: parallel.grad_compression={cfg.parallel.grad_compression!r} is not supported "
                          "with cp > 1; use parallel.grad_compression=none, or parallel.cp=1")
    try:
        cp_attention_of(cfg, tp=dims.tp, cp=cp)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    seq = cfg.data.kwargs.get("seq_len")  # built-in corpus and packed rows: seq_len inputs (other data: per batch)
    if cfg.data.factory in (CORPUS_DATA, PACKED_DATA) and isinstance(seq, int) and seq % (2 * cp):
        raise ConfigError(f"{where}: data.kwargs.seq_len={seq} is not divisible by 2*cp={2 * cp} (each cp rank takes "
                          f"two of 2*cp equal chunks); use a seq_len that is a multiple of {2 * cp}")
    if cfg.data.factory == CORPUS_DATA and isinstance(seq, int) and dims.tp > 1 and cfg.parallel.sequence_parallel:
        try:  # sequence parallelism splits each cp rank's seq/cp tokens over the tp ranks
            check_seq_len(seq_len=seq, cp=cp, sp=dims.tp)
        except ConfigError as e:
            raise ConfigError(f"{where}: data.kwargs.seq_len={seq}: {e}") from None


def cp_attention_of(cfg: Config, *, tp: int, cp: int) -> str:
    """`choose_cp_attention` for the built-in LLaMA of `cfg` (its model.kwargs' n_heads and n_kv_heads, the model's
    defaults where absent) on `tp` x `cp` ranks: what `dptrain run` and `dptrain plan` take."""
    heads = cfg.model.kwargs.get("n_heads", LLAMA_DEFAULT_HEADS)
    kv_heads = cfg.model.kwargs.get("n_kv_heads") or heads
    return choose_cp_attention(cfg.parallel.cp_attention, n_heads=heads, n_kv_heads=kv_heads, tp=tp, cp=cp)


def check_seq_len(*, seq_len: int | None, cp: int, sp: int = 1) -> None:
    """A row's input length must split into 2*cp equal chunks, and under sequence parallelism (`sp` = tp) each cp
    rank's share (two chunks, seq_len/cp tokens) evenly over the tp ranks (ConfigError naming the numbers); None: not
    known yet."""
    if seq_len is None:
        return
    if seq_len % (2 * cp):
        raise ConfigError(f"a row of {seq_len} input tokens cannot be split into 2*cp={2 * cp} equal chunks "
                          f"(parallel.cp={cp}); make the model's input length a multiple of {2 * cp}")
    if sp > 1 and (seq_len // cp) % sp:
        good = 2 * cp * sp // math.gcd(2, sp)
        raise ConfigError(f"a row of {seq_len} input tokens leaves each of the cp={cp} ranks {seq_len // cp}, which "
                          f"sequence parallelism cannot split evenly over tp={sp}; make the model's input length a "
                          f"multiple of {good}, or set parallel.sequence_parallel=false")
