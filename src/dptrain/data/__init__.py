"""Data: the built-in stdlib corpus, the world-size-invariant batch sampler (never-ending for the Trainer,
epoch-bounded for own loops), loaders, and evaluation data sharded without dropping samples."""

from .corpus import (
    EOD_TOKEN,
    VOCAB_SIZE,
    TokenChunks,
    build_stdlib_lm,
    default_cache_root,
    list_stdlib_sources,
    prepare_stdlib_corpus,
)
from .epochs import EpochBatchSampler, EpochLoader
from .eval import EvalBatchSampler, EvalLoader
from .loader import build_dataloader, split_train_val, worker_seed
from .sampler import GlobalBatchSampler

__all__ = [
    "EOD_TOKEN",
    "EpochBatchSampler",
    "EpochLoader",
    "EvalBatchSampler",
    "EvalLoader",
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
