"""Ulysses attention (DeepSpeed-Ulysses' all-to-all sequence parallelism) for context parallelism: `parallel.cp` with
`parallel.cp_attention=ulysses` (or auto where the heads allow; config/context.py `choose_cp_attention`).

A cp rank holds ``T/cp`` tokens of each row (its load-balanced chunks ``r`` and ``2*cp-1-r``, parallel/context.py)
for all of its local heads (after tp). Attention needs whole rows, but each head is independent, so:

1. q, k and v ``[B, H, T/cp, hd]`` are cut into cp groups of heads and exchanged by one all-to-all each over the cp
   group: rank ``g`` receives head group ``g`` of every rank's tokens, ``[B, H/cp, T, hd]`` in rank order;
2. the row is put back in its natural order (`gathered_positions`: the global position of each received token);
3. plain causal attention over the whole row (``is_causal=True``, no mask; packed rows: the single-process document
   mask on the whole row, from the document ids `GatheredDocuments` gathers); GQA repeats the KV heads locally (rank
   ``g``'s query heads use exactly its KV head group: both are split in contiguous groups);
4. back to rank order, and one all-to-all returns each rank its own tokens for all heads.

Exact: every head sees its whole row, as in one process. The all-to-alls are torch's autograd-aware functional
collective (`all_to_all_single`: its backward is the reverse all-to-all), which runs on gloo. Per layer forward 4
all-to-alls (q, k, v, output), each sending ``(cp-1)/cp`` of the rank's ``T/cp x heads x hd`` elements, and as many
in backward: the bytes per rank fall as 1/cp, where the K/V all-gather's stay at ``(cp-1)/cp`` of the whole row's K/V
(tools/plan/timing.py `cp_exchange_time`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["UlyssesAttention", "gathered_positions"]

log = logging.getLogger(__name__)


def gathered_positions(seq_len: int, *, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """The global position of each token of a row gathered in cp-rank order (rank ``r``'s chunks ``r`` and
    ``2*cp-1-r`` in turn, as `dptrain.parallel.context.chunk_positions` hands them out)."""
    c = seq_len // (2 * cp)
    ranks = torch.arange(cp, device=device)
    blocks = torch.stack([ranks, 2 * cp - 1 - ranks], dim=1).flatten()  # [2*cp] in rank order
    return (blocks[:, None] * c + torch.arange(c, device=device)).flatten()


@functools.cache
def _natural_order(seq_len: int, cp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(``to_natural``, ``to_gathered``): index the rank-order row with the first to get natural order, the natural
    row with the second to get rank order back."""
    to_gathered = gathered_positions(seq_len, cp=cp, device=device)
    return torch.argsort(to_gathered), to_gathered


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Split `x` along dim 0 into cp equal parts, part ``g`` to rank ``g``; the result holds rank ``r``'s part at
    position ``r`` of dim 0. Autograd: the reverse all-to-all."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x.contiguous(), None, None, group)


class UlyssesAttention(nn.Module):
    """Exact causal attention of a cp rank's tokens via two all-to-alls on heads (module docstring). `mask`: None
    (plain causal rows) or the document ids of the whole row in rank order ``[B, T]`` (packed rows, from
    `dptrain.parallel.context.GatheredDocuments`)."""

    def __init__(self, group: Any, *, cp: int, rank: int) -> None:
        super().__init__()
        self.group, self.cp, self.rank = group, cp, rank

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        _say_once(q.size(1), k.size(1), self.cp)
        B, H, local, hd = q.shape
        seq_len = local * self.cp
        to_natural, to_gathered = _natural_order(seq_len, self.cp, q.device)
        q, k, v = (self._heads_to_row(x, to_natural) for x in (q, k, v))  # [B, H/cp, T, hd], natural order
        if k.size(1) != q.size(1):  # GQA: this rank's query heads use exactly its KV head group
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # packed rows: within each document, causal (the single-process DocumentMask on the whole row)
            docs = mask[:, to_natural]
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
            allowed = (docs[:, :, None] == docs[:, None, :]) & causal
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1))
        out = out.index_select(2, to_gathered).view(B, H // self.cp, self.cp, local, hd)
        out = _all_to_all(out.permute(2, 0, 1, 3, 4), self.group)  # [cp (head group), B, H/cp, T/cp, hd]
        return out.permute(1, 0, 2, 3, 4).reshape(B, H, local, hd)

    def _heads_to_row(self, x: torch.Tensor, to_natural: torch.Tensor) -> torch.Tensor:
        """``[B, h, T/cp, hd]`` of this rank's tokens, all its heads -> ``[B, h/cp, T, hd]``: its head group's whole
        row, in natural order."""
        B, h, local, hd = x.shape
        x = _all_to_all(x.view(B, self.cp, h // self.cp, local, hd).transpose(0, 1), self.group)
        row = x.permute(1, 2, 0, 3, 4).reshape(B, h // self.cp, self.cp * local, hd)  # rank order
        return row.index_select(2, to_natural)


@functools.cache
def _say_once(heads: int, kv_heads: int, cp: int) -> None:
    """One log line per process (cached), like the K/V all-gather's."""
    log.info("parallel.cp: attention is Ulysses all-to-all on heads (%d query / %d KV heads a rank, %d / %d after the "
             "all-to-all, whole rows, causal SDPA)", heads, kv_heads, heads // cp, kv_heads // cp)
