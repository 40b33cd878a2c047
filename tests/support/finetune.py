"""Fine-tuning examples made on the fly (long-tailed lengths, deterministic) and a Trainer run on them for the
dynamic-padding tests (tests/test_finetune.py)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dptrain.config.load import load_config
from dptrain.train.loss import forward_loss
from dptrain.train.trainer import Trainer
from support import overrides
from support.batch_log import ENV, row_key

__all__ = ["fit_finetune", "recording_unpadded_loss", "write_classify", "write_sft"]

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards box jugs of gold".split()


def _words(r: random.Random, n: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(n))


def write_sft(path: Path, n: int, *, seed: int = 0, longest: int = 12) -> Path:
    """`n` prompt/response examples whose lengths follow a long tail (most short, a few up to `longest` words)."""
    r = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for _ in range(n):
        p, q = (min(longest, 1 + int(r.paretovariate(1.5))) for _ in range(2))
        lines.append(json.dumps({"prompt": _words(r, p) + " ?", "response": " " + _words(r, q)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def write_classify(path: Path, n: int, *, seed: int = 0) -> Path:
    r = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"text": _words(r, r.randint(1, 20)), "label": r.choice(["neg", "pos", "neutral"])} for _ in range(n)]
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return path


RECIPE = [
    "model.factory=dptrain.models.llama:build_llama",
    "model.kwargs={vocab_size: 256, dim: 16, n_layers: 1, n_heads: 2, max_seq_len: 96}",
    "data.kwargs={seq_len: 96, max_tokens: 640, min_rows: 4, sort_window: 32}",
    "train.global_batch_size=4", "train.micro_batch_size=1", "optim.warmup_steps=0", "optim.schedule=constant",
    "train.log_every_steps=1", "train.eval_every_steps=0", "log.progress=false", "parallel.strategy=ddp",
    "checkpoint.keep_last=null",
]


def fit_finetune(rank: int, out: Path, source: Path, over: list[str], log: Path | None = None) -> dict[str, Any]:
    """One rank of a Trainer run of the tiny LLaMA on `source` (data.source); rank 0 returns the final weights."""
    if log is not None:
        os.environ[ENV] = str(log)
    cfg = load_config(None, overrides(RECIPE, [f"data.source={source}"], over))
    trainer = Trainer(cfg, out_dir=out, resume="auto")
    trainer.fit()
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()} if rank == 0 else {}


def recording_unpadded_loss(model: Any, batch: Any, num_items_in_batch: torch.Tensor | None = None) -> torch.Tensor:
    """support.batch_log's recording loss for padded rows: each row's key is that of its unpadded input_ids
    (the bytes tokenizer's text never holds the pad id 0)."""
    if torch.is_grad_enabled():
        rank = dist.get_rank() if dist.is_initialized() else 0
        keys = [row_key(r[: int(r.ne(0).sum())]) for r in batch["input_ids"].cpu()]
        with open(Path(os.environ[ENV]) / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(keys) + "\n")
    return forward_loss(model, batch, num_items_in_batch=num_items_in_batch)
