"""parallel/cp_attention.py: the blockwise attention of a context-parallel rank (flash blocks merged by log-sum-exp,
backward through the merged output and log-sum-exp) equals plain SDPA autograd over the whole row, for plain causal
rows and packed rows, fp32 and bf16, with GQA; it saves no mask. The cp ranks are simulated in one process: each
rank's queries against the keys gathered in rank order, the key gradients summed over the ranks (the all-gather's
backward)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dptrain.models.llama import document_mask
from dptrain.parallel.context import GatheredKVAttention, chunk_positions, document_ids
from dptrain.parallel.cp_attention import blockwise_attention

pytestmark = pytest.mark.timeout(60)

B, H, HKV, T, D = 2, 4, 2, 48, 8


def packed_positions() -> torch.Tensor:
    """Row 0: documents at 0, 10 and 30 (with cp 4, block 5 = tokens 30-35 sees nothing of its prefix); row 1: 0, 3."""
    row0 = torch.cat([torch.arange(10), torch.arange(20), torch.arange(T - 30)])
    row1 = torch.cat([torch.arange(3), torch.arange(T - 3)])
    return torch.stack([row0, row1])


def whole_row(q, k, v, grad, pos):
    """Plain SDPA over the whole row (GQA by repeat): output and the q, k, v gradients."""
    rep = q.size(1) // k.size(1)
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if pos is None:
        out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=document_mask(pos))
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def split_over_ranks(q, k, v, grad, pos, *, cp, attend=None):
    """The same through `attend` (default `blockwise_attention`) on each of `cp` simulated ranks."""
    order = torch.cat([chunk_positions(T, cp=cp, rank=r) for r in range(cp)])
    docs = None if pos is None else document_ids(pos)[:, order]
    out = torch.zeros_like(q)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for r in range(cp):
        mine = chunk_positions(T, cp=cp, rank=r)
        qr = q.detach()[:, :, mine].requires_grad_()
        kg, vg = k.detach()[:, :, order].requires_grad_(), v.detach()[:, :, order].requires_grad_()
        o = (attend or blockwise_attention)(qr, kg, vg, cp=cp, rank=r, docs=docs)
        gq, gk, gv = torch.autograd.grad(o, (qr, kg, vg), grad[:, :, mine])
        out[:, :, mine] = o.detach()
        grads[0][:, :, mine] += gq
        grads[1][:, :, order] += gk  # the all-gather's backward: each rank's K/V gradient summed over the ranks
        grads[2][:, :, order] += gv
    return (out, *grads)


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, HKV, T, D, generator=g).to(dtype) for _ in range(2))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


@pytest.mark.fast
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_blockwise_attention_equals_sdpa_over_the_whole_row_fp32(cp, packed):
    q, k, v, grad = inputs(torch.float32)
    pos = packed_positions() if packed else None
    for got, want in zip(split_over_ranks(q, k, v, grad, pos, cp=cp), whole_row(q, k, v, grad, pos), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True])
def test_blockwise_attention_in_half_is_as_close_to_fp32_as_sdpa_in_half(dtype, packed):
    """Half precision rounds differently blockwise (each block's output is rounded before the merge): no further from
    the fp32 result than SDPA's own kernel in the same dtype, within 2x its largest error."""
    pos = packed_positions() if packed else None
    exact = whole_row(*inputs(torch.float32), pos)
    sdpa = whole_row(*inputs(dtype), pos)
    blocks = split_over_ranks(*inputs(dtype), pos, cp=4)
    for got, ref, want in zip(blocks, sdpa, exact, strict=True):
        assert got.dtype == dtype
        assert (got.float() - want).abs().max() <= 2 * (ref.float() - want).abs().max() + 1e-3


@pytest.mark.fast
def test_blockwise_attention_saves_q_the_gathered_kv_the_output_and_lse_only():
    """No mask and no GQA repeat is kept for backward: exactly q, K and V (at the KV heads), the output and the
    fp32 log-sum-exp."""
    q, k, v, _ = inputs(torch.float32)
    cp, rank = 4, 1
    qr = q.detach()[:, :, chunk_positions(T, cp=cp, rank=rank)].requires_grad_()
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blockwise_attention(qr, k, v, cp=cp, rank=rank)
    local = T // cp
    assert sorted(saved) == sorted([4 * B * H * local * D, 4 * B * HKV * T * D, 4 * B * HKV * T * D,
                                    4 * B * H * local * D, 4 * B * H * local])


@pytest.mark.fast
@pytest.mark.parametrize("packed", [False, True])
def test_the_sdpa_fallback_with_the_gathered_mask_equals_the_whole_row(packed):
    """The path kept for devices without the CPU flash kernels: SDPA over the gathered keys with a [T/cp, T] mask
    (restricted to each query's document for packed rows)."""
    q, k, v, grad = inputs(torch.float32)
    pos = packed_positions() if packed else None

    def sdpa(qr, kg, vg, *, cp, rank, docs):
        return GatheredKVAttention(None, cp=cp, rank=rank)._sdpa_attention(qr, kg, vg, docs)

    for got, want in zip(split_over_ranks(q, k, v, grad, pos, cp=2, attend=sdpa), whole_row(q, k, v, grad, pos),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
