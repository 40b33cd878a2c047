"""Fine-tuning and classification rows from a JSON-lines file: dynamic padding, length-grouped batches.

Each line is one example:

- ``{"prompt": ..., "response": ...}`` (task ``sft``): the row is ``prompt + response + end-of-document``;
  only the response's tokens (and the end of document) are scored, the prompt's and the padding's labels
  are ``-100``;
- ``{"text": ..., "label": ...}`` (task ``classify``): the row is the text's tokens, the label a class
  (an integer, or a string: the sorted distinct strings of the file are the classes 0, 1, ...).

The file is tokenised once, when the factory runs (every rank does it; a local tokenizer: ``bytes``, a
``tokenizer.json`` or a ``from_pretrained`` folder, see :mod:`dptrain.data.tokenizers`), into one flat
token array. Batches come from :class:`~dptrain.data.token_batches.TokenBudgetSampler` (the dataset's
``make_batch_sampler``, which the Trainer uses instead of the fixed-size sampler): rows of similar length
together, at most ``max_tokens`` padded tokens per global batch, the same batches at every world size.
Each micro-batch is padded to its own longest row (``collate``).

The loss must follow the token rule (``dptrain/train/loss.py``) for the step's gradient to be the global
batch's mean when micro-batches hold different numbers of rows and tokens: the built-in LLaMA does (it takes
``num_items_in_batch``); for classification use ``train.loss=dptrain.data.finetune:classification_loss``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from dptrain.config import ConfigError

from .token_batches import TokenBudgetSampler
from .tokenizers import BYTES, load_tokenizer

__all__ = ["FineTuneRows", "build_finetune", "classification_loss", "pad_collate", "read_examples"]

IGNORE_INDEX = -100
TASKS = ("auto", "sft", "classify")


def read_examples(path: str | Path, keys: tuple[str, str]) -> list[tuple[Any, Any]]:
    """(first, second) field of every non-empty line; ConfigError naming the line when one is missing."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"data.kwargs.source={str(path)!r} line {n}: not a JSON line ({e})") from None
            if not isinstance(rec, dict) or any(k not in rec for k in keys):
                has = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                names = "text_key/label_key" if keys[0] == "text" else "prompt_key/response_key"
                raise ConfigError(f"data.kwargs.source={str(path)!r} line {n}: needs the fields {list(keys)} (has "
                                  f"{has}); name yours with data.kwargs.{names}")
            out.append((rec[keys[0]], rec[keys[1]]))
    if not out:
        raise ConfigError(f"data.kwargs.source={str(path)!r} holds no example")
    return out


def _detect_task(path: str, prompt_key: str, text_key: str, label_key: str) -> str:
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        rec = json.loads(first)
    except ValueError as e:
        raise ConfigError(f"data.kwargs.source={path!r}: its first line is not JSON ({e})") from None
    if isinstance(rec, dict) and prompt_key in rec:
        return "sft"
    if isinstance(rec, dict) and text_key in rec and label_key in rec:
        return "classify"
    has = sorted(rec) if isinstance(rec, dict) else rec
    raise ConfigError(f"data.kwargs.source={path!r}: its first line has neither {prompt_key!r} (fine-tuning) nor "
                      f"{text_key!r} + {label_key!r} (classification) (has {has!r}); set data.kwargs.task and the "
                      "key names")


def pad_collate(rows: list[dict[str, torch.Tensor]], *, pad_id: int, attention_mask: bool,
                pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Rows padded to the longest of THIS batch (or to `pad_to`: fixed padding): ``input_ids`` with `pad_id`,
    token ``labels`` with -100 (class labels stay one per row), and a 0/1 ``attention_mask`` when asked. The
    ``[B, T]`` tensors are views of ONE int64 tensor: a DataLoader worker hands the batch over in one
    shared-memory storage (as :meth:`~dptrain.data.packed.PackedTokens.collate` does)."""
    longest = max(len(r["input_ids"]) for r in rows) if pad_to is None else int(pad_to)
    token_labels = rows[0]["labels"].ndim == 1
    keys = ["input_ids", *(["labels"] if token_labels else []), *(["attention_mask"] if attention_mask else [])]
    fill = {"input_ids": pad_id, "labels": IGNORE_INDEX, "attention_mask": 0}
    buf = torch.empty((len(keys), len(rows), longest), dtype=torch.long)
    for k, key in enumerate(keys):
        buf[k].fill_(fill[key])
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        buf[0, i, :n] = r["input_ids"]
        if token_labels:
            buf[1, i, :n] = r["labels"]
        if attention_mask:
            buf[-1, i, :n] = 1
    out = {key: buf[k] for k, key in enumerate(keys)}
    if not token_labels:
        out["labels"] = torch.stack([r["labels"] for r in rows])
    return out


def classification_loss(model: nn.Module, batch: dict[str, torch.Tensor],
                        num_items_in_batch: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of a sequence-classification model's ``logits`` (``model(**batch)`` minus ``labels``)
    against ``labels``: the sum over the rows divided by `num_items_in_batch` (the token rule, every row one
    item), so uneven micro-batches still give the global batch's mean; the plain mean without it."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    logits = getattr(out, "logits", out)
    if num_items_in_batch is None:
        return F.cross_entropy(logits.float(), batch["labels"])
    return F.cross_entropy(logits.float(), batch["labels"], reduction="sum") / num_items_in_batch


class FineTuneRows(Dataset):
    """Tokenised rows of one task (see the module). ``lengths[i]``: the tokens row ``i`` feeds the model."""

    def __init__(self, rows: list[list[int]], *, task: str, scored_from: list[int] | None = None,
                 classes: list[int] | None = None, pad_id: int, shift: bool, attention_mask: bool,
                 batching: dict[str, Any] | None, vocab_size: int, bytes_per_token: int, num_labels: int = 0,
                 pad_to: int | None = None) -> None:
        self.task, self.shift, self.pad_id = task, bool(shift), int(pad_id)
        self.offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
        self.tokens = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(self.offsets[-1]))
        self.scored_from = np.asarray(scored_from if scored_from is not None else [], dtype=np.int64)
        self.classes = np.asarray(classes if classes is not None else [], dtype=np.int64)
        full = np.diff(self.offsets)
        self.lengths = full - 1 if task == "sft" and self.shift else full
        self.batching = batching
        self.vocab_size, self.bytes_per_token, self.num_labels = int(vocab_size), int(bytes_per_token), int(num_labels)
        self.collate = functools.partial(pad_collate, pad_id=self.pad_id, attention_mask=attention_mask, pad_to=pad_to)
        if batching is None:  # fixed padding: the config's fixed-size batches (GlobalBatchSampler)
            self.make_batch_sampler = None  # type: ignore[assignment]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        row = torch.from_numpy(self.tokens[self.offsets[i] : self.offsets[i + 1]].copy())
        if self.task == "classify":
            return {"input_ids": row, "labels": torch.tensor(int(self.classes[i]))}
        scored = int(self.scored_from[i])  # the first position of `row` that is a target
        if self.shift:  # labels aligned with the predictions (the built-in LLaMA)
            labels = row[1:].clone()
            labels[: max(0, scored - 1)] = IGNORE_INDEX
            return {"input_ids": row[:-1], "labels": labels}
        labels = row.clone()  # the model shifts (Hugging Face *ForCausalLM)
        labels[:scored] = IGNORE_INDEX
        return {"input_ids": row, "labels": labels}

    def make_batch_sampler(self, *, grad_accum_steps: int, dp_rank: int, dp_world_size: int, seed: int,
                           shuffle: bool, start_step: int, **_fixed_batch: Any) -> TokenBudgetSampler:
        """The Trainer's batch sampler for these rows: token-budget, length-grouped (the fixed batch sizes of
        the config do not apply)."""
        return TokenBudgetSampler(self.lengths, grad_accum_steps=grad_accum_steps, dp_rank=dp_rank,
                                  dp_world_size=dp_world_size, seed=seed, shuffle=shuffle, start_step=start_step,
                                  **(self.batching or {}))

    def __repr__(self) -> str:
        return f"FineTuneRows(task={self.task}, rows={len(self)}, tokens={int(self.lengths.sum())})"


def build_finetune(
    *, source: str, tokenizer: str = BYTES, task: str = "auto", seq_len: int | None = None,
    max_tokens: int = 4096, min_rows: int = 8, sort_window: int = 1024, val_fraction: float = 0.0,
    padding: str = "dynamic", shift: bool = True, attention_mask: bool | None = None, prompt_key: str = "prompt",
    response_key: str = "response", text_key: str = "text", label_key: str = "label", eos_token: str | None = None,
) -> tuple[FineTuneRows, FineTuneRows | None]:
    """Data factory for a JSON-lines file of fine-tuning or classification examples (see the module).

    ``seq_len``: rows are cut to this many tokens (the model's context; None: not cut). ``max_tokens``: padded
    tokens per global batch; ``min_rows``: rows per global batch at least (>= grad_accum_steps x data-parallel
    ranks, kept when the world size changes); ``sort_window``: rows sorted by length together. ``shift``:
    labels aligned with the predictions (the built-in LLaMA) or equal to the inputs (a model that shifts them,
    Hugging Face's ``*ForCausalLM``); a run sets it from its model (``dptrain.train.build.align_labels``), the
    default applies to direct calls. ``attention_mask``: add one (default: for classification, and without
    shift). ``val_fraction``: the file's last fraction of examples is the validation split. ``padding``:
    ``dynamic`` (the token budget above) or ``max``: fixed-size batches of the config's batch sizes in random
    order, every row padded to ``seq_len`` (static shapes; what dynamic padding is measured against).
    """
    if padding not in ("dynamic", "max"):
        raise ConfigError(f"data.kwargs.padding={padding!r}; valid: 'dynamic' (token budget) or 'max' (to seq_len)")
    if padding == "max" and seq_len is None:
        raise ConfigError("data.kwargs.padding='max' pads every row to data.kwargs.seq_len: set it")
    if task not in TASKS:
        raise ConfigError(f"data.kwargs.task={task!r}; valid: {', '.join(TASKS)}")
    if not Path(source).is_file():
        raise ConfigError(f"data.kwargs.source={source!r}: no such file (a JSON-lines file of examples)")
    if seq_len is not None and int(seq_len) < 2:
        raise ConfigError(f"data.kwargs.seq_len={seq_len}: rows need at least 2 tokens")
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ConfigError(f"data.kwargs.val_fraction={val_fraction} is outside [0, 1)")
    if task == "auto":
        task = _detect_task(source, prompt_key, text_key, label_key)
    tok = load_tokenizer(tokenizer, eos_token=eos_token)
    eos, cut = tok.eos_id, (int(seq_len) + (1 if shift and task == "sft" else 0)) if seq_len else None
    rows: list[list[int]] = []
    scored: list[int] = []
    classes: list[int] = []
    num_labels = 0
    if task == "sft":
        pairs = read_examples(source, (prompt_key, response_key))
        prompts = tok.encode_batch([str(p) for p, _ in pairs])
        responses = tok.encode_batch([str(r) for _, r in pairs])
        for p, r in zip(prompts, responses, strict=True):
            rows.append([*p, *r, eos][:cut])
            scored.append(len(p))
    else:
        pairs = read_examples(source, (text_key, label_key))
        raw = [lab for _, lab in pairs]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in raw):
            classes = [int(v) for v in raw]
            if min(classes) < 0:
                raise ConfigError(f"data.kwargs.source={source!r}: class labels must be >= 0, found {min(classes)}")
            num_labels = max(classes) + 1
        else:
            names = sorted({str(v) for v in raw})
            classes, num_labels = [names.index(str(v)) for v in raw], len(names)
        rows = [ids[:cut] if ids else [eos] for ids in tok.encode_batch([str(t) for t, _ in pairs])]
    if task == "sft":
        useful = [i for i, (row, s) in enumerate(zip(rows, scored, strict=True)) if len(row) > max(s, 1)]
        if not useful:
            raise ConfigError(f"data.kwargs.source={source!r}: every example's response is cut away (seq_len={seq_len} "
                              "is shorter than the prompts); raise seq_len")
        rows, scored = [rows[i] for i in useful], [scored[i] for i in useful]
    mask = (task == "classify" or not shift) if attention_mask is None else bool(attention_mask)
    batching = {"max_tokens": int(max_tokens), "min_rows": int(min_rows), "sort_window": int(sort_window)}
    common: dict[str, Any] = {
        "task": task, "pad_id": eos, "shift": shift, "attention_mask": mask, "vocab_size": tok.vocab_size,
        "bytes_per_token": 1 if tok.kind == BYTES else 0, "num_labels": num_labels,
        "batching": batching if padding == "dynamic" else None,
        "pad_to": int(seq_len) if padding == "max" and seq_len is not None else None,
    }
    n_val = int(round(len(rows) * float(val_fraction)))
    if val_fraction > 0 and n_val == 0:
        raise ConfigError(f"data.kwargs.val_fraction={val_fraction} of {len(rows)} examples is none; raise it or use 0")
    n = len(rows) - n_val

    def part(a: int, b: int) -> FineTuneRows:
        return FineTuneRows(rows[a:b], scored_from=scored[a:b] if scored else None,
                            classes=classes[a:b] if classes else None, **common)

    return part(0, n), (part(n, len(rows)) if n_val else None)
