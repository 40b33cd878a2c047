"""Context parallelism (`parallel.cp`): one sequence split over the cp ranks of a data-parallel rank, attention exact.

- **The split** (`ContextParallel.shard`): each row of ``T`` input tokens is cut into ``2*cp`` equal chunks; cp rank
  ``r`` takes chunks ``r`` and ``2*cp-1-r`` (torchtitan's and Megatron's causal load balance: under a causal mask the
  early chunks attend to little and the late ones to much, so every rank gets one of each). Its labels are split the
  same way, and its ``position_ids`` are the global positions of its tokens, so rotary embeddings rotate by where each
  token is in the whole row.
- **Attention**, one of two (`parallel.cp_attention`, chosen by `apply_cp`): Ulysses (parallel/ulysses.py: q/k/v
  all-to-all'd to whole rows of 1/cp of the heads, where the heads divide by cp) or the K/V all-gather:
- **The K/V all-gather** (`GatheredKVAttention`, swapped in for the built-in LLaMA's `CoreAttention`): K and V
  (after rotary, before GQA's repeat) are all-gathered over the cp group with torch's autograd-aware functional
  collective `all_gather_single_autograd` (its backward sends each rank the sum of the gradients of its K/V), and
  every local query attends to the gathered keys at global positions not after its own: exactly the causal attention of
  the whole row. This is ring attention's result with one all-gather instead of cp-1 ring steps (Megatron's
  all-gather CP); it runs on gloo. On a CPU the attention is blockwise with no mask (parallel/cp_attention.py: per
  query chunk a call over its fully visible prefix and a causal call over its own block, merged by log-sum-exp);
  elsewhere (CUDA: the flash/efficient kernels take other arguments, not wired here) SDPA over the gathered keys with a
  ``[T/cp, T]`` additive mask, one per rank. The path is logged once per process. torch's `context_parallel`
  (torch.distributed.tensor.experimental) is not used: it dispatches on the flash/efficient SDPA kernels and fails on
  the MATH kernel, the only one on a CPU in float32 (pytorch/pytorch#147793).
- **Packed rows** (a batch with ``position_ids``, data/packed.py): the documents are found on the whole row's
  positions (every cp rank holds the whole row before `shard`), numbered into ``document_ids`` and split like the
  tokens; `GatheredDocuments` (swapped in for the model's `DocumentMask`) gathers them once per forward, and each
  query attends to keys of its own document only (Ulysses: the whole row's document mask, as one process). Rotary
  uses the positions within each document, as one process.
- **Loss and gradients**: the token rule counts every token once (each token is on one cp rank) over the dp x cp ranks
  (`ParallelMesh.grad_group`), DDP all-reduces and FSDP2 reduce-scatters gradients over the same ranks, so the step's
  gradient is the global batch's token mean (train/loss.py).

The cp ranks of a dp rank load the same rows (the sampler takes the dp rank) and each keeps its chunks.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.config import ConfigError
from dptrain.config.context import check_seq_len, choose_cp_attention
from dptrain.distributed import collectives
from dptrain.models.llama import Attention, DocumentMask
from dptrain.parallel.cp_attention import blockwise_attention, blockwise_supported
from dptrain.parallel.ulysses import UlyssesAttention

__all__ = ["ContextParallel", "GatheredDocuments", "GatheredKVAttention", "apply_cp", "chunk_positions"]

log = logging.getLogger(__name__)


def chunk_positions(seq_len: int, *, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions cp rank `rank` holds of a row of `seq_len` tokens: chunks rank and 2*cp-1-rank of 2*cp."""
    check_seq_len(seq_len=seq_len, cp=cp)
    size = seq_len // (2 * cp)
    first, second = rank * size, (2 * cp - 1 - rank) * size
    return torch.cat([torch.arange(first, first + size, device=device),
                      torch.arange(second, second + size, device=device)])


@functools.lru_cache(maxsize=4)
def _causal_bias(local_len: int, cp: int, rank: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[local_len, cp*local_len]`` additive mask in the queries' dtype: 0 where this rank's query may see a gathered
    key (keys in rank order), -inf elsewhere. One tensor per rank, shared by every layer and kept for the next step
    (cached): SDPA saves its mask for backward, and given a bool mask it converts it to this float form on every call,
    so each layer would save a copy of its own (``n_layers x T^2/cp`` elements instead of ``T^2/cp``; the results are
    bit-identical)."""
    seq_len = local_len * cp
    mine = chunk_positions(seq_len, cp=cp, rank=rank, device=device)
    keys = torch.cat([chunk_positions(seq_len, cp=cp, rank=r, device=device) for r in range(cp)])
    allowed = keys[None, :] <= mine[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


class GatheredKVAttention(nn.Module):
    """Attention of this rank's query chunks against the K/V of the whole row, all-gathered over the cp group.

    `mask`: None (plain causal rows) or the document ids of the gathered row ``[B, T]`` (packed rows, from
    `GatheredDocuments`). On a CPU in fp32/bf16/fp16, blockwise flash attention merged by log-sum-exp, no mask saved
    (parallel/cp_attention.py); elsewhere SDPA over the gathered keys with a ``[T/cp, T]`` mask (`_sdpa_attention`).
    Which one runs is logged once per process."""

    def __init__(self, group: Any, *, cp: int, rank: int) -> None:
        super().__init__()
        self.group, self.cp, self.rank = group, cp, rank

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        k, v = _gather_seq(k, self.group), _gather_seq(v, self.group)  # [B, H_kv, cp*T_local, hd], rank order
        if blockwise_supported(q):
            _say_path("blockwise flash attention merged by log-sum-exp (no mask saved)")
            return blockwise_attention(q, k, v, cp=self.cp, rank=self.rank, docs=mask)
        _say_path(f"SDPA over the gathered keys with a [T/cp, T] mask ({q.device.type}, {q.dtype})")
        return self._sdpa_attention(q, k, v, mask)

    def _sdpa_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        docs: torch.Tensor | None) -> torch.Tensor:
        if k.size(1) != q.size(1):  # GQA: repeat after the exchange (the fewer heads travel)
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        bias = _causal_bias(q.size(2), self.cp, self.rank, q.device, q.dtype)
        if docs is not None:  # packed rows: within the query's document too
            mine = docs[:, _own_slots(q.size(2), self.cp, self.rank, q.device)]
            bias = bias.masked_fill(mine[:, None, :, None] != docs[:, None, None, :], float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


class GatheredDocuments(nn.Module):
    """Swapped in for the built-in LLaMA's `DocumentMask` under cp: the "mask" handed to every block's
    `GatheredKVAttention` is the document ids of the whole row in gathered (rank) order, all-gathered once per
    forward from each rank's `document_ids` (`ContextParallel.shard` numbers them over the whole row), or None for
    plain rows (no `document_ids`: the position ids then only rotate)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, position_ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        if document_ids is None:
            return None
        from torch.distributed._functional_collectives import all_gather_tensor

        return all_gather_tensor(document_ids.contiguous(), gather_dim=1, group=self.group)


@functools.cache
def _say_path(what: str) -> None:
    """One log line per process and attention path (cached: the first call logs)."""
    log.info("parallel.cp: attention is %s", what)


def _own_slots(local_len: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """Indices of this rank's tokens in the gathered (rank-order) row."""
    return torch.arange(rank * local_len, (rank + 1) * local_len, device=device)


def _gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`x` ``[B, H, T_local, hd]`` of every cp rank, concatenated along the sequence in rank order; autograd sends
    each rank the gradient of its own slice summed over the ranks (a reduce-scatter). torch's functional collective,
    whose autograd is exact on gloo; `torch.distributed.nn.functional.all_gather` (deprecated) gave wrong K/V
    gradients here on gloo. It gathers along dim 0 only, hence the sequence moved to the front and back."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    gathered = all_gather_single_autograd(x.movedim(2, 0).contiguous(), gather_dim=0, group=group)
    return gathered.movedim(0, 2)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` document number of every token of whole rows from their position ids: a document starts at the row's
    start and wherever a position does not follow the one before it (`dptrain.models.llama.document_mask`'s rule)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.cumsum(dim=1)


def apply_cp(model: nn.Module, *, group: Any, cp: int, rank: int, attention: str = "auto", tp: int = 1) -> str:
    """Swap every built-in LLaMA attention's core for the cp attention (in place) and return its name: `attention`
    (`parallel.cp_attention`) resolved on the model's heads and `tp` (config/context.py `choose_cp_attention`):
    `UlyssesAttention` (parallel/ulysses.py) or `GatheredKVAttention`. A model without one is refused (config/context.py
    refuses it before launch; this catches a factory that hides it)."""
    cores = [m for m in model.modules() if isinstance(m, Attention)]
    if not cores:
        raise ConfigError(f"parallel.cp={cp}: the model ({type(model).__name__}) has no built-in LLaMA attention to "
                          "split over the sequence; use dptrain.models.llama:build_llama, or parallel.cp=1")
    first = cores[0]  # nn.Linear keeps its global out_features under tp's DTensor weights
    chosen = choose_cp_attention(attention, n_heads=first.wq.out_features // first.head_dim,
                                 n_kv_heads=first.wk.out_features // first.head_dim, tp=tp, cp=cp)
    for attn in cores:
        attn.core = (UlyssesAttention(group, cp=cp, rank=rank) if chosen == "ulysses"
                       else GatheredKVAttention(group, cp=cp, rank=rank))
    for module in model.modules():
        if isinstance(getattr(module, "doc_mask", None), DocumentMask):  # packed rows: ids over the whole row
            module.doc_mask = GatheredDocuments(group)
    return chosen


class ContextParallel:
    """This rank's share of every batch (`shard`) and the validation loss of a split row (`eval_loss`)."""

    def __init__(self, group: Any, *, cp: int, rank: int) -> None:
        self.group, self.cp, self.rank = group, cp, rank

    def shard(self, batch: Any) -> dict[str, torch.Tensor]:
        """`{input_ids, labels, position_ids}` of this rank's chunks of a batch: a LongTensor ``[B, T+1]`` (inputs
        ``[:, :-1]``, targets ``[:, 1:]``), an ``(input_ids, labels)`` pair or a mapping with those keys. A mapping
        with ``position_ids`` too (packed rows, data/packed.py): the rank's slice of them (positions within each
        document, for rotary) and ``document_ids``, each token's document numbered over the whole row (a document
        starts at the row's start and where a position does not follow the one before, as `document_mask`)."""
        docs = None
        if isinstance(batch, Mapping):
            extra = sorted(set(batch) - {"input_ids", "labels", "position_ids"})
            if extra:
                raise ConfigError(f"parallel.cp={self.cp}: a batch with {extra} (padding masks) cannot be split over "
                                  "the sequence yet; use rows of input_ids and labels (and position_ids for packed "
                                  "rows), or parallel.cp=1")
            idx, labels = batch["input_ids"], batch["labels"]
            docs = batch.get("position_ids")
        elif isinstance(batch, torch.Tensor):
            idx, labels = batch[:, :-1], batch[:, 1:]
        elif isinstance(batch, Sequence) and len(batch) == 2:
            idx, labels = batch
        else:
            raise ConfigError(f"parallel.cp={self.cp}: cannot split a {type(batch).__name__} batch over the sequence; "
                              "give a [B, T+1] LongTensor, an (input_ids, labels) pair or a mapping with those keys")
        pos = chunk_positions(idx.size(1), cp=self.cp, rank=self.rank, device=idx.device)
        mine = {"input_ids": idx[:, pos], "labels": labels[:, pos], "position_ids": pos.expand(idx.size(0), -1)}
        if docs is not None:  # packed rows: documents found on the whole row, then split like the tokens
            mine["position_ids"], mine["document_ids"] = docs[:, pos], document_ids(docs)[:, pos]
        return mine

    @torch.no_grad()
    def eval_loss(self, module: nn.Module, batch: Any, *, loss_fn: Any) -> torch.Tensor:
        """The token mean over the whole rows of `batch`, the same on every cp rank: each rank's summed token losses
        divided by the rows' count of valid targets, summed over the cp group."""
        mine = self.shard(batch)
        count = (mine["labels"] != -100).sum().to(torch.float32)
        collectives.all_reduce_sum_(count, group=self.group)
        loss = loss_fn(module, mine, num_items_in_batch=count.clamp_min(1)).detach().clone()
        collectives.all_reduce_sum_(loss, group=self.group)
        return loss
