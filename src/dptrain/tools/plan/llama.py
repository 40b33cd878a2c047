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
fp32), the head weight's half copy under autocast, and the fp32 log-softmax (B*T*V).

Pure half-precision parameters (`parallel.fsdp_param_dtype=bf16` under bf16 autocast: FSDP2 gathers
bf16 parameters, autocast casts nothing, as torchtitan's default), per block: the residual stream is
half (2 bytes); each RMSNorm saves its fp32 upcast of x (4*B*T*d), its rsqrt (4*B*T), the half
normalised x and its product with the weight (2 x 2*B*T*d); attention saves q, k, v at h heads, the
output and its re-laid-out copy (2 bytes each) and the logsumexp (fp32); the MLP 4*B*T*f at 2
bytes. No weight copy; rope saves only its tables. Outside: ids, targets, rope tables, the final
norm as above, the fp32 log-softmax.

Activation checkpointing keeps, per block, at the end of forward:
- `full`: the block's input (its residual dtype);
- `selective` (dptrain's op-level policy, parallel/activation_checkpointing.py: outputs of
  mm/addmm/bmm and scaled-dot-product attention are saved, everything else recomputed): the block
  input, the seven linear outputs (q: B*T*d, k and v: B*T*kv at the kv width, wo and w2: B*T*d, w1
  and w3: B*T*f) and the attention output in the compute dtype, its logsumexp in fp32. No weight
  copies (autocast's casts are recomputed).
- `selective_torchtitan` (torchtitan's op-level policy: every second mm of the block recomputed too): the
  block input, the outputs of wq (B*T*q), wv (B*T*kv), w1 (B*T*f) and w2 (B*T*d), the 1st, 3rd, 5th and
  7th mm, and the attention output (B*T*q) in the compute dtype, its logsumexp in fp32; wk, wo and w3 are
  recomputed.
In backward one block at a time is recomputed: its full saved set less what was kept, once per
stage however many micro-batches are in flight (`activation_parts`). tests/test_plan.py checks all
of this against the storages alive after forward on this CPU, for fp32, autocast and pure half.

Context parallelism (`parallel.cp`, parallel/context.py: each rank holds 2 of the row's 2*cp chunks, T/cp tokens, and
all-gathers K and V over the cp ranks before attention, or runs Ulysses' all-to-all on heads): everything above at T/cp
tokens, except (`cp_block_extra`, `cp_outside_extra`) what the attention path keeps, and the ids and labels, separate
tensors of T/cp (8 bytes each), and the rotary tables gathered at the rank's positions (two [B, T/cp, hd/2] fp32). The
attention paths:
- blockwise (on a CPU, parallel/cp_attention.py; `cp_mask` False): the gathered K and V of the whole row at the KV
  heads (T tokens, kv width) instead of the rank's own k and v at h heads; no mask;
- SDPA with the gathered-K/V mask (elsewhere, e.g. CUDA; `cp_mask` True): K and V of the whole row at h heads (GQA's
  repeat is what SDPA saves), and the rank's additive causal mask, [T/cp, T] in the compute dtype, one per rank
  shared by every block and cached for the next step;
- Ulysses (`ulysses`, parallel/ulysses.py: q, k, v all-to-all'd to the whole row at h/cp heads): the attention saves
  q, K, V (GQA's repeat), its output and log-sum-exp of T tokens at h/cp heads, as many elements as one process at
  T/cp tokens and h heads: no extra in the blocks, no mask outside.
Under activation checkpointing the gathered K/V are not kept (the recompute gathers again) and are part of the one
block recomputed at a time. Packed rows' document ids (8 bytes a token of the row, once) are not counted.
tests/test_cp_memory.py checks the blockwise path, tests/test_cp_ulysses_plan.py Ulysses, against cp ranks on gloo."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the planner imports no torch (`dptrain --help` stays fast)
    from dptrain.models.llama import LlamaConfig


HALF = ("bf16", "fp16")
RECOMPUTING = ("full", "selective", "selective_torchtitan")  # the modes that recompute in backward


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


LORA_DEFAULT_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


LORA_ROWWISE = ("wo", "w2")
"""The row-parallel linears of the tensor-parallel plan (the rest are column-parallel)."""


def lora_block_params(cfg: LlamaConfig, *, rank: int, targets: tuple[str, ...] | None = None, tp: int = 1) -> int:
    """Adapter parameters LoRA adds to one block of `LlamaLM(cfg)` on one tp rank: r * (in + out) per targeted linear
    (A is r x in, B out x r; no bias); `targets` null: every attention and MLP linear (model.lora's default). Under
    tp (models/lora_parallel.py) a column-parallel linear's B is split over its out rows and its A replicated
    (r * (in + out / tp)); a row-parallel one's A is split over its in columns and its B replicated."""
    assert cfg.n_kv_heads is not None and cfg.ffn_hidden is not None
    d, f = cfg.dim, cfg.ffn_hidden
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "w1": (d, f), "w3": (d, f), "w2": (f, d)}
    per_rank = {t: (i // tp, o) if t in LORA_ROWWISE else (i, o // tp) for t, (i, o) in shapes.items()}
    return sum(rank * sum(per_rank[t]) for t in (targets or LORA_DEFAULT_TARGETS) if t in per_rank)


def _half(precision: str, param_dtype: str | None) -> tuple[bool, bool]:
    """(autocast to half, half parameters) of a run: half parameters only under half autocast."""
    half = precision in HALF
    return half, half and param_dtype in HALF


def block_activation_bytes(cfg: LlamaConfig, *, batch: int, seq: int, precision: str,
                           param_dtype: str | None = None) -> int:
    """Bytes one block saves for backward for a [batch, seq] micro-batch (module docstring)."""
    assert cfg.n_kv_heads is not None and cfg.ffn_hidden is not None
    bt, d, f = batch * seq, cfg.dim, cfg.ffn_hidden
    small = 2 * bt + batch * cfg.n_heads * seq  # rsqrt x 2, logsumexp: fp32
    relaid = 1 if cfg.n_heads > 1 else 0  # one head: the attention output's transpose is already contiguous
    half, pure = _half(precision, param_dtype)
    if not half:
        return 4 * ((10 + relaid) * bt * d + 4 * bt * f + small)
    if pure:  # norms: fp32 upcast + half normalised x + its product with the weight; attention and MLP half
        return 4 * (2 * bt * d + small) + 2 * ((8 + relaid) * bt * d + 4 * bt * f)
    full = 4 * (4 * bt * d + small)
    half_bytes = 2 * ((9 + relaid) * bt * d + 4 * bt * f + param_counts(cfg).block_linear)
    return full + half_bytes


def kept_block_bytes(cfg: LlamaConfig, *, batch: int, seq: int, precision: str, checkpointing: str,
                     param_dtype: str | None = None) -> int:
    """Bytes a checkpointed block keeps from forward to backward (module docstring)."""
    assert cfg.n_kv_heads is not None and cfg.ffn_hidden is not None
    bt, d = batch * seq, cfg.dim
    half, pure = _half(precision, param_dtype)
    stream = 2 if pure else 4  # the residual stream: the block input's dtype
    if checkpointing == "full":
        return stream * bt * d
    if checkpointing not in RECOMPUTING:
        return block_activation_bytes(cfg, batch=batch, seq=seq, precision=precision, param_dtype=param_dtype)
    q, kv, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    if checkpointing == "selective":
        outputs = bt * (2 * q + 2 * d + 2 * kv + 2 * f)  # wq, sdpa; wo, w2; wk, wv; w1, w3
    else:
        outputs = bt * (2 * q + d + kv + f)  # wq, sdpa; w2; wv; w1
    return stream * bt * d + (2 if half else 4) * outputs + 4 * batch * cfg.n_heads * seq


def replicated_block_bytes(cfg: LlamaConfig, *, batch: int, seq: int, precision: str, checkpointing: str,
                           param_dtype: str | None = None) -> int:
    """Of `kept_block_bytes`, what tensor parallelism without sequence parallelism leaves whole on
    every rank (a model, not measured here: tp needs DTensor ranks): the residual stream and the
    norms' tensors (fp32: input, mid residual, the norms' normalised x and outputs; autocast: the
    fp32 ones and the five cast linear inputs; pure half: the norms' four tensors each), or under
    checkpointing the kept block input. The attention and MLP tensors are split over tp."""
    bt, d = batch * seq, cfg.dim
    half, pure = _half(precision, param_dtype)
    if checkpointing in RECOMPUTING:
        return (2 if pure else 4) * bt * d
    if pure:
        return 16 * bt * d + 8 * bt
    return 4 * (4 * bt * d + 2 * bt) + 10 * bt * d if half else 4 * (6 * bt * d + 2 * bt)


def outside_activation_bytes(cfg: LlamaConfig, *, batch: int, seq: int, precision: str,
                             param_dtype: str | None = None) -> int:
    """Bytes saved outside the blocks: ids, targets, rope tables, final norm, head, log-softmax."""
    bt, d, v = batch * seq, cfg.dim, cfg.vocab_size
    ids = 8 * (batch * (seq + 1) + (bt if batch > 1 else 0))  # one sequence: the targets are a view, no copy
    rope = 4 * cfg.max_seq_len * cfg.head_dim  # the cos/sin slices keep the whole tables alive
    half, pure = _half(precision, param_dtype)
    if pure:  # fp32 upcast, rsqrt, half normalised x and the head's half input; no weight copy
        return ids + rope + 8 * bt * d + 4 * bt + 4 * bt * v + 4
    norm = 4 * (2 * bt * d + bt)
    head = 2 * (bt * d + v * d) if half else 4 * bt * d
    return ids + rope + norm + head + 4 * bt * v + 4


def cp_block_extra(cfg: LlamaConfig, *, batch: int, seq: int, cp: int, precision: str, cp_mask: bool = True,
                   ulysses: bool = False) -> int:
    """Bytes a block saves under context parallelism beyond `block_activation_bytes` at seq/cp tokens (negative when
    less): K and V over the whole row of `seq` tokens in the compute dtype instead of the rank's seq/cp at h heads; at
    the KV heads on the blockwise path, at h heads on the masked SDPA path (`cp_mask`); 0 at cp 1, and 0 under
    Ulysses (`ulysses`: q, K, V, the output and log-sum-exp of the whole row at h/cp heads, as many elements as one
    process saves at seq/cp tokens and h heads)."""
    if cp == 1 or ulysses:
        return 0
    assert cfg.n_kv_heads is not None
    width = cfg.n_heads * cfg.head_dim
    kept = width if cp_mask else cfg.n_kv_heads * cfg.head_dim
    return 2 * (2 if precision in HALF else 4) * batch * (seq * kept - (seq // cp) * width)


def cp_outside_extra(cfg: LlamaConfig, *, batch: int, seq: int, cp: int, precision: str, cp_mask: bool = True,
                     ulysses: bool = False) -> int:
    """Bytes saved outside the blocks under context parallelism beyond `outside_activation_bytes` at seq/cp tokens:
    the ids and labels as two tensors (no shared row), the rotary tables at the rank's positions, and on the masked
    SDPA path (`cp_mask`, not under Ulysses: causal SDPA, no mask) the rank's additive causal mask [seq/cp, seq] in the
    compute dtype (module docstring); 0 at cp 1."""
    if cp == 1:
        return 0
    local = seq // cp
    bt = batch * local
    ids = 16 * bt - 8 * (batch * (local + 1) + (bt if batch > 1 else 0))
    rope = 4 * bt * cfg.head_dim
    mask = (2 if precision in HALF else 4) * local * seq if cp_mask and not ulysses else 0
    return ids + rope + mask


def tp_whole_outside_bytes(cfg: LlamaConfig, *, batch: int, seq: int, cp: int, precision: str,
                           loss_parallel: bool, cp_mask: bool = True, ulysses: bool = False) -> int:
    """Of the bytes saved outside the blocks (`outside_activation_bytes` at seq/cp tokens plus `cp_outside_extra`),
    what tensor parallelism leaves whole on every tp rank: the fp32 log-softmax [B*seq/cp, V] (the head's output is
    gathered over the vocabulary, unless `loss_parallel` keeps it sharded), and under cp the rank's own ids, rotary
    rows and, on the masked path (`cp_mask`), causal mask (`cp_outside_extra`: they belong to the cp rank, not to a tp
    shard)."""
    softmax = 0 if loss_parallel else 4 * batch * (seq // cp) * cfg.vocab_size
    return softmax + cp_outside_extra(cfg, batch=batch, seq=seq, cp=cp, precision=precision, cp_mask=cp_mask,
                                      ulysses=ulysses)


def activation_parts(cfg: LlamaConfig, *, batch: int, seq: int, precision: str, checkpointing: str = "none",
                     n_layers: int | None = None, outside: bool = True,
                     param_dtype: str | None = None, cp: int = 1, cp_mask: bool = True,
                     ulysses: bool = False) -> tuple[int, int]:
    """(bytes one micro-batch keeps from forward to backward over `n_layers` blocks, plus the parts
    outside them with `outside`; the recompute working set of one block in backward, needed once
    per stage: 0 without checkpointing). `cp`: the row of `seq` tokens is split over cp ranks, `cp_mask`: the
    attention path that keeps a mask, `ulysses`: the all-to-all on heads instead of the K/V all-gather (module
    docstring)."""
    layers = cfg.n_layers if n_layers is None else n_layers
    local = seq // cp
    extra = cp_block_extra(cfg, batch=batch, seq=seq, cp=cp, precision=precision, cp_mask=cp_mask, ulysses=ulysses)
    recomputing = checkpointing in RECOMPUTING
    kept = kept_block_bytes(cfg, batch=batch, seq=local, precision=precision, checkpointing=checkpointing,
                            param_dtype=param_dtype) + (0 if recomputing else extra)
    block = block_activation_bytes(cfg, batch=batch, seq=local, precision=precision, param_dtype=param_dtype) + extra
    work = block - kept if recomputing and layers else 0
    rest = outside_activation_bytes(cfg, batch=batch, seq=local, precision=precision,
                                    param_dtype=param_dtype) if outside else 0
    if outside:
        rest += cp_outside_extra(cfg, batch=batch, seq=seq, cp=cp, precision=precision, cp_mask=cp_mask,
                                 ulysses=ulysses)
    return layers * kept + rest, work


def activation_bytes(
    cfg: LlamaConfig,
    *,
    batch: int,
    seq: int,
    precision: str,
    checkpointing: str = "none",
    n_layers: int | None = None,
    outside: bool = True,
    param_dtype: str | None = None,
) -> int:
    """Peak bytes saved for backward by one micro-batch over `n_layers` blocks (default: all) plus,
    with `outside`, the parts outside the blocks: what is kept, plus one block recomputed."""
    kept, work = activation_parts(cfg, batch=batch, seq=seq, precision=precision, checkpointing=checkpointing,
                                  n_layers=n_layers, outside=outside, param_dtype=param_dtype)
    return kept + work


def param_shapes(cfg: LlamaConfig) -> list[tuple[int, ...]]:
    """Every parameter's shape, in `LlamaLM(cfg).parameters()` order (a tied head is not repeated)."""
    assert cfg.n_kv_heads is not None and cfg.ffn_hidden is not None
    d, f = cfg.dim, cfg.ffn_hidden
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    block = [(d,), (q, d), (kv, d), (kv, d), (d, q), (d,), (f, d), (d, f), (f, d)]
    return [(cfg.vocab_size, d), *block * cfg.n_layers, (d,), *([] if cfg.tie_embeddings else [(cfg.vocab_size, d)])]
