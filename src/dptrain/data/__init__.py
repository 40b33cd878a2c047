"""Data: the built-in stdlib corpus, the world-size-invariant batch sampler, loaders."""

from .corpus import (
    EOD_TOKEN,
    VOCAB_SIZE,
    TokenChunks,
    build_stdlib_lm,
    default_cache_root,
    list_stdlib_sources,
    prepare_stdlib_corpus,
)
from .loader import build_dataloader, split_train_val, worker_seed
from .sampler import GlobalBatchSampler

__all__ = [
    "EOD_TOKEN",
    "VOCAB_SIZE",
    "GlobalBatchSampler",
    "TokenChunks",
    "build_dataloader",
    "build_stdlib_lm",
    "default_cache_root",
    "list_stdlib_sources",
    "prepare_stdlib_corpus",
    "split_train_val",
    "worker_seed",
]
