"""Exact causal attention of a context-parallel rank's query chunks against the gathered K/V, with no ``[T/cp, T]``
mask: blockwise flash attention merged by log-sum-exp (what ring attention computes), as one autograd function.

A cp rank holds two query chunks of ``c = T/(2*cp)`` tokens at block positions ``b`` (``rank`` and ``2*cp-1-rank``,
parallel/context.py). Under a causal mask a query of block ``b`` sees every key of blocks ``0..b-1`` (the fully
visible prefix: no mask) and the keys of its own block causally. So for each chunk:

- one attention call without a mask over the prefix keys, and one causal call over its own diagonal block, each
  returning its output ``o_i`` and the log-sum-exp ``l_i`` of its scores;
- merged exactly: ``l = logaddexp(l_1, l_2)``, ``o = sum_i exp(l_i - l) * o_i`` (fp32, then the compute dtype).

Backward calls each block's flash backward with the MERGED ``o`` and ``l``: the softmax of the whole row is
``exp(s - l)``, and the flash backward's ``D = rowsum(dO * o)`` is the whole row's, so each block's backward returns
exactly its share of the whole attention's gradient (the identity FlashAttention-2 and ring attention use;
tests/test_cp_attention.py checks it against plain SDPA autograd). Only q, the gathered K/V (at the KV heads: GQA's
repeat is redone in backward, not saved), the output and the log-sum-exp are saved; no mask.

Packed rows (document ids given, numbered over the whole row): the same blocks, each with an additive mask built on
the fly from the ids (a query sees keys of its own document; the diagonal block also causally) and never saved; a
query whose document starts inside its own chunk sees nothing of the prefix, whose log-sum-exp is then set to
``-inf`` (the kernel reports 0 for an empty row) so the merge ignores it.

The kernels are torch's own CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward), the ones ``F.scaled_dot_product_attention`` runs on a CPU. On other devices the CUDA flash/efficient
kernels take other arguments (cumulative lengths, RNG state) and are not used here: context.py keeps SDPA with the
gathered-K/V mask there (`blockwise_supported`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["blockwise_attention", "blockwise_supported"]

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def blockwise_supported(q: torch.Tensor) -> bool:
    """Whether `blockwise_attention` runs for queries like `q`: torch's CPU flash kernels, fp32/bf16/fp16."""
    return q.device.type == "cpu" and q.dtype in _DTYPES


def _slots(cp: int, rank: int, c: int) -> tuple[list[torch.Tensor], list[int]]:
    """For each of the rank's two chunks: the gathered-order token indices of its fully visible prefix (the keys of
    blocks before it), and the gathered-order start of its own block. Gathered order is rank order, each rank's two
    chunks in turn: slot ``2*r + j`` holds block ``r`` (j = 0) or ``2*cp-1-r`` (j = 1)."""
    block_of = [r if j == 0 else 2 * cp - 1 - r for r in range(cp) for j in (0, 1)]
    prefixes, starts = [], []
    for j in (0, 1):
        own = 2 * rank + j
        slots = sorted((s for s in range(2 * cp) if block_of[s] < block_of[own]), key=lambda s: block_of[s])
        idx = [torch.arange(s * c, (s + 1) * c) for s in slots]
        prefixes.append(torch.cat(idx) if idx else torch.empty(0, dtype=torch.long))
        starts.append(own * c)
    return prefixes, starts


def _repeat(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _doc_bias(qdoc: torch.Tensor, kdoc: torch.Tensor, *, causal: bool, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """Additive mask ``[B, 1, Lq, Lk]`` (0 where the query's document is the key's, and, `causal`, the key not after
    it; -inf elsewhere) and ``[B, 1, Lq]``: whether the query sees any key of the block."""
    allowed = qdoc[:, None, :, None] == kdoc[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(qdoc.size(1), kdoc.size(1), dtype=torch.bool, device=qdoc.device).tril()
    bias = torch.zeros(allowed.shape, dtype=dtype, device=qdoc.device).masked_fill_(~allowed, float("-inf"))
    return bias, allowed.any(-1)


class _Blocks:
    """The two blocks (prefix, diagonal) of each query chunk: their keys, values and masks, rebuilt in forward and
    again in backward (nothing here is saved)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None, *, cp: int,
                 rank: int) -> None:
        self.c = q.size(2) // 2
        self.rep = q.size(1) // k.size(1)
        self.k, self.v, self.docs, self.dtype = k, v, docs, q.dtype
        self.prefixes, self.starts = _slots(cp, rank, self.c)

    def __iter__(self):
        """(chunk j, keys, values, additive mask or None, is_causal, rows that see a key or None) per block."""
        c, k, v, docs = self.c, self.k, self.v, self.docs
        for j, (prefix, start) in enumerate(zip(self.prefixes, self.starts, strict=True)):
            qdoc = None if docs is None else docs[:, start:start + c]
            if prefix.numel():
                idx = prefix.to(k.device)
                bias, seen = (None, None) if docs is None or qdoc is None else _doc_bias(qdoc, docs[:, idx],
                                                                                         causal=False, dtype=self.dtype)
                yield j, idx, _repeat(k.index_select(2, idx), self.rep), _repeat(v.index_select(2, idx), self.rep), \
                    bias, False, seen
            own = slice(start, start + c)
            bias = None if qdoc is None else _doc_bias(qdoc, qdoc, causal=True, dtype=self.dtype)[0]
            yield j, own, _repeat(k[:, :, own], self.rep), _repeat(v[:, :, own], self.rep), bias, bias is None, None


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and log-sum-exps of blocks over disjoint keys -> those of their union (fp32 math)."""
    lse = parts[0][1]
    for _, other in parts[1:]:
        lse = torch.logaddexp(lse, other)
    out = sum((torch.exp(l_i - lse).unsqueeze(-1) * o_i.float() for o_i, l_i in parts), torch.zeros(()))
    return out.to(dtype), lse


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None, cp: int,
                rank: int) -> torch.Tensor:
        blocks = _Blocks(q, k, v, docs, cp=cp, rank=rank)
        c = blocks.c
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
        for j, _, kb, vb, bias, causal, seen in blocks:
            out, lse = _FWD(q[:, :, j * c:(j + 1) * c], kb, vb, 0.0, causal, attn_mask=bias)
            if seen is not None:  # a query that sees nothing of this block: lse -inf, so the merge gives it weight 0
                lse = lse.masked_fill(~seen, float("-inf"))
            parts[j].append((out, lse))
        merged = [_merge(p, q.dtype) for p in parts]
        out = torch.cat([o for o, _ in merged], dim=2)
        lse = torch.cat([lse for _, lse in merged], dim=2)
        ctx.save_for_backward(q, k, v, docs, out, lse)
        ctx.cp, ctx.rank = cp, rank
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, docs, out, lse = ctx.saved_tensors
        blocks = _Blocks(q, k, v, docs, cp=ctx.cp, rank=ctx.rank)
        c, rep = blocks.c, blocks.rep
        grad_q = torch.zeros_like(q, dtype=torch.float32)
        grad_k = torch.zeros_like(k, dtype=torch.float32)
        grad_v = torch.zeros_like(v, dtype=torch.float32)
        grad_out = grad_out.contiguous()
        for j, where, kb, vb, bias, causal, _ in blocks:
            rows = slice(j * c, (j + 1) * c)
            gq, gk, gv = _BWD(grad_out[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows], lse[:, :, rows], 0.0,
                              causal, attn_mask=bias)
            grad_q[:, :, rows] += gq.float()
            gk, gv = (g.float().unflatten(1, (k.size(1), rep)).sum(2) for g in (gk, gv))  # GQA: sum each group
            if isinstance(where, slice):
                grad_k[:, :, where] += gk
                grad_v[:, :, where] += gv
            else:
                grad_k.index_add_(2, where, gk)
                grad_v.index_add_(2, where, gv)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp: int, rank: int,
                        docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's queries ``q`` ``[B, H, 2c, hd]`` (its two chunks) against ``k``/``v``
    ``[B, H_kv, 2*cp*c, hd]`` gathered in rank order; `docs` ``[B, 2*cp*c]``: the document ids of the gathered tokens
    (packed rows), or None (plain causal rows). Exact; no mask is saved (module docstring)."""
    return _BlockwiseAttention.apply(q, k, v, docs, cp, rank)
