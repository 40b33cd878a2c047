"""Exact parameter counts and activation memory of the built-in LLaMA (`dptrain.models.llama`).

Activations are the bytes autograd saves for backward in one micro-batch's forward (what
`torch.autograd.graph.saved_tensors_hooks` sees, each storage once, parameters excluded), for B
sequences of T tokens, model width d, query heads h, head dim hd, FFN width f, vocabulary V. Counted
from the model's code (tests/test_plan.py checks them against that measurement on this CPU):

fp32, per block: 11*B*T*d (block input, the two norms' normalised x and outputs, q, k, v at h heads
after the GQA repeat, the attention output, its re-laid-out copy (none with one head: the transpose
is then contiguous), the mid residual) + 4*B*T*f (w1, w3, silu outputs and the gated product)
elements + 2*B*T (the norms' rsqrt) + B*h*T (attention logsumexp), 4 bytes each.

bf16/fp16 autocast, per block: the residual stream (block input, mid residual), the norms'
normalised x and rsqrt and the logsumexp stay fp32 (4*B*T*d + 2*B*T + B*h*T at 4 bytes); half
precision, 2 bytes: the cast linear inputs (one copy per linear: 5*B*T*d), q, k, v at h heads
(3*B*T*d), the attention output and its copy (2*B*T*d), 4*B*T*f, and autocast's half copy of every
block weight (the block's linear parameters). GQA does not change either count: attention saves k
and v after the repeat to h heads.

Outside the blocks: the token ids (B*(T+1) int64), targets (B*T int64; a view of the ids, no copy,
when B = 1), the rope tables (max_seq_len*hd fp32: the slices keep the tables alive), the final norm
(last block output, normalised x, rsqrt: fp32; its output cast for the head under autocast, else
fp32), the head weight's half copy under autocast, and the fp32 log-softmax (B*T*V). Activation
checkpointing `full` keeps one block input (B*T*d residual dtype, 4 bytes) per block plus one
block's full set, less that input, while it is recomputed in backward; `selective` is counted as
`none` (an upper bound: the op-level policy is not modelled)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the planner imports no torch (`dptrain --help` stays fast)
    from dptrain.models.llama import LlamaConfig


HALF = ("bf16", "fp16")


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the built-in LLaMA by part; `total` counts a tied matrix once."""

    embedding: int
    block: int
    block_linear: int
    final_norm: int
    head: int
    n_layers: int

    @property
    def total(self) -> int:
        return self.embedding + self.n_layers * self.block + self.final_norm + self.head

    @property
    def largest_unit(self) -> int:
        """The largest FSDP unit (a block, or the root's embedding + norm + head)."""
        return max(self.block, self.embedding + self.final_norm + self.head)


def param_counts(cfg: LlamaConfig) -> ParamCounts:
    """Exact parameter counts of `LlamaLM(cfg)` (no bias anywhere; RMSNorm has one d-vector)."""
    assert cfg.n_kv_heads is not None and cfg.ffn_hidden is not None  # set by __post_init__
    d, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_hidden
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    linear = d * q + 2 * d * kv + q * d + 3 * d * f
    return ParamCounts(
        embedding=cfg.vocab_size * d,
        block=linear + 2 * d,
        block_linear=linear,
        final_norm=d,
        head=0 if cfg.tie_embeddings else cfg.vocab_size * d,
        n_layers=cfg.n_layers,
    )


def block_activation_bytes(cfg: LlamaConfig, *, batch: int, seq: int, precision: str) -> int:
    """Bytes one block saves for backward for a [batch, seq] micro-batch (module docstring)."""
    assert cfg.n_kv_heads is not None and cfg.ffn_hidden is not None
    bt, d, f = batch * seq, cfg.dim, cfg.ffn_hidden
    small = 2 * bt + batch * cfg.n_heads * seq  # rsqrt x 2, logsumexp: fp32
    relaid = 1 if cfg.n_heads > 1 else 0  # one head: the attention output's transpose is already contiguous
    if precision not in HALF:
        return 4 * ((10 + relaid) * bt * d + 4 * bt * f + small)
    full = 4 * (4 * bt * d + small)
    half = 2 * ((9 + relaid) * bt * d + 4 * bt * f + param_counts(cfg).block_linear)
    return full + half


def outside_activation_bytes(cfg: LlamaConfig, *, batch: int, seq: int, precision: str) -> int:
    """Bytes saved outside the blocks: ids, targets, rope tables, final norm, head, log-softmax."""
    bt, d, v = batch * seq, cfg.dim, cfg.vocab_size
    ids = 8 * (batch * (seq + 1) + (bt if batch > 1 else 0))  # one sequence: the targets are a view, no copy
    rope = 4 * cfg.max_seq_len * cfg.head_dim  # the cos/sin slices keep the whole tables alive
    norm = 4 * (2 * bt * d + bt)
    head = 2 * (bt * d + v * d) if precision in HALF else 4 * bt * d
    return ids + rope + norm + head + 4 * bt * v + 4


def activation_bytes(
    cfg: LlamaConfig,
    *,
    batch: int,
    seq: int,
    precision: str,
    checkpointing: str = "none",
    n_layers: int | None = None,
    outside: bool = True,
) -> int:
    """Bytes saved for backward by one micro-batch over `n_layers` blocks (default: all) plus,
    with `outside`, the parts outside the blocks; `checkpointing` none/selective (all kept) or full."""
    layers = cfg.n_layers if n_layers is None else n_layers
    block = block_activation_bytes(cfg, batch=batch, seq=seq, precision=precision)
    if checkpointing == "full":
        kept = 4 * batch * seq * cfg.dim  # a block's fp32 input: the one thing it keeps
        blocks = layers * kept + (block - kept if layers else 0)  # + one block recomputed (its input counted once)
    else:
        blocks = layers * block
    return blocks + (outside_activation_bytes(cfg, batch=batch, seq=seq, precision=precision) if outside else 0)


def param_shapes(cfg: LlamaConfig) -> list[tuple[int, ...]]:
    """Every parameter's shape, in `LlamaLM(cfg).parameters()` order (a tied head is not repeated)."""
    assert cfg.n_kv_heads is not None and cfg.ffn_hidden is not None
    d, f = cfg.dim, cfg.ffn_hidden
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    block = [(d,), (q, d), (kv, d), (kv, d), (d, q), (d,), (f, d), (d, f), (f, d)]
    return [(cfg.vocab_size, d), *block * cfg.n_layers, (d,), *([] if cfg.tie_embeddings else [(cfg.vocab_size, d)])]
