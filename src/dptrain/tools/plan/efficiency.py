"""Compute efficiency from what is computed: GEMM shapes, attention, memory-bound ops, the GPU (a model).

`--efficiency E` states one share of the dense peak for everything; without it the planner derives
one for the layout from the pieces below, each with its source, none fitted to the runs it is
checked against (docs/results/planner.md). Per micro-batch on one rank (its tensor-parallel share):

- GEMMs (the block's linears and the output layer; forward, and backward's two of the same size):
  a roofline per GEMM, max(FLOPs / (peak x MAMF), bytes / HBM bandwidth), so that small widths and
  few tokens per micro-batch reach less of the peak. MAMF: the measured maximum achievable matmul
  share of the GPU (metrics/hardware.py, its source there).
- Attention. `flash` (torch SDPA, FlashAttention-2 kernels): the FLOPs a causal kernel executes,
  7*B*T^2*width (forward 2, backward 5: it recomputes the scores), at FlashAttention-2's measured
  share of the peak: 0.35 on Hopper (Shah et al. 2024, FlashAttention-3, abstract: "FlashAttention-2
  achiev[es] only 35% utilization on the H100"), 0.50 elsewhere (Dao 2023, FlashAttention-2, abstract:
  "50-73% of the theoretical maximum FLOPs/s on A100": its lower end). `unfused` (Megatron-LM 2021/22:
  two batched GEMMs over the whole T x T scores plus a fused scale-mask-softmax and dropout): the
  GEMMs at MAMF, the T^2 scores read and written at HBM bandwidth (forward 9 bytes per score at fp16:
  softmax in/out, dropout in/out and its 1-byte mask; backward 11).
- Memory-bound ops at HBM bandwidth, bytes per token per block counted from the block's ops (forward;
  backward twice that): a LLaMA block in eager PyTorch (two RMSNorms computed in fp32 with their
  up- and down-casts, rope in fp32 on q and k, two residual adds, SiLU and the gate product, the
  layout copies around attention) 76*d + 20*kv + 10*f bytes; under torch.compile (fused: each norm
  reads x once and writes once, rope and the gate fused) 16*d + 4*kv + 6*f. A GPT block with
  Megatron's fused kernels (LayerNorm x 2, bias-dropout-add x 2, bias-GeLU on 4d, q/k/v layout)
  50*d. Without sequence parallelism the norms' and residual's share is done whole on every
  tensor-parallel rank. The loss: 40 bytes per logit (fp32 log-softmax forward and backward, eager),
  16 with a fused vocabulary-parallel cross-entropy (Megatron).
- Selective checkpointing recomputes: dptrain's policy the memory-bound ops once more (forward),
  torchtitan's (dptrain's `selective_torchtitan`) those and the forward of every second GEMM of the block
  (wk, wo, w3 of a LLaMA block), Megatron's (Korthikanti et al. 2022) the attention core (its GEMMs and the
  score traffic); full checkpointing the block's forward (a third of its time).

efficiency = (the layout's model FLOPs at the dense peak) / (the sum above) x SUSTAINED. The sum is a
roofline; SUSTAINED is the share of it a whole training step's kernels sustain (launch gaps, clocks
under load, imperfect overlap), set once from a published reference run that is not among the runs
checked (plan/published.py: MosaicML's MPT-7B on 8 H100, 10,643 tokens/s per GPU; tests derive it
again). Communication and the pipeline bubble are timing.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.metrics.hardware import GpuSpec

HOPPER = ("H100", "H200")
SUSTAINED = 0.667  # plan/published.py `sustained_from(MPT_REFERENCE)`: 0.6668
# Llama 3 paper (Dubey et al. 2024, table 4): 38-43% BF16 MFU training on 8K-16K H100s; the lower end. The share
# stated for a measured model (its kernels are not known by shape) and for the CPU as a device.
MEASURED_EFFICIENCY = 0.38
ELEMENTWISE = {"llama": (76, 20, 10), "llama-compiled": (16, 4, 6)}  # bytes/token: (x d, x kv, x f), forward
GPT_ELEMENTWISE = 50  # x d, forward (Megatron's fused kernels)
NORM_SHARE = {"llama": 56 + 12, "llama-compiled": 8 + 4, "gpt": 8 + 14}  # of the d term: norms + residual adds


@dataclass(frozen=True)
class Dims:
    """What the model computes per block: width d, query width q, kv width, FFN width f, gated (SwiGLU: three
    FFN matrices) or not (GeLU: two, with biases), vocabulary, layers."""

    d: int
    q: int
    kv: int
    f: int
    vocab: int
    layers: int
    heads: int
    gated: bool = True
    kind: str = "llama"  # llama / gpt: which memory-bound op count


def attention_efficiency(spec: GpuSpec) -> float:
    """FlashAttention-2's share of the dense peak on this GPU (module docstring)."""
    return 0.35 if spec.key.startswith(HOPPER) else 0.50


def gemm_time(n: float, k: float, m: float, spec: GpuSpec, peak: float, bpe: int) -> float:
    """Roofline seconds of one [n, k] x [k, m] GEMM: compute at peak x MAMF, or its operands at HBM bandwidth."""
    flops = 2 * n * k * m / (peak * spec.mamf)
    traffic = bpe * (n * k + k * m + n * m) / (spec.hbm_gbps * 1e9) if spec.hbm_gbps else 0.0
    return max(flops, traffic)


def block_gemms(dims: Dims, tp: int) -> list[tuple[float, float]]:
    """(k, m) of each linear of one block on one tensor-parallel rank."""
    if dims.gated:
        return [(dims.d, dims.q / tp), (dims.d, dims.kv / tp), (dims.d, dims.kv / tp), (dims.q / tp, dims.d),
                (dims.d, dims.f / tp), (dims.d, dims.f / tp), (dims.f / tp, dims.d)]
    return [(dims.d, (dims.q + 2 * dims.kv) / tp), (dims.q / tp, dims.d), (dims.d, dims.f / tp), (dims.f / tp, dims.d)]


def micro_batch_time(dims: Dims, spec: GpuSpec, *, batch: int, seq: int, tp: int = 1, sequence_parallel: bool = True,
                     precision: str = "bf16", attention: str = "flash", checkpointing: str = "none",
                     selective: str = "dptrain", compiled: bool = False, fused_loss: bool = False,
                     layers: float | None = None, head: bool = True, cp: int = 1) -> dict[str, float]:
    """Seconds of one micro-batch's forward and backward on one rank over `layers` blocks (default all) and, with
    `head`, the output layer and loss; by part (module docstring). `cp`: context parallelism, `seq` is this rank's
    share of a row of cp * seq tokens: its flash attention is 1/cp of the row's (load-balanced chunks), cp times
    that of `seq` tokens alone."""
    dtype = precision if precision != "fp32" else "tf32"
    peak = spec.peaks.get(dtype) or spec.peaks["fp32"]
    bw = spec.hbm_gbps * 1e9 if spec.hbm_gbps else float("inf")
    bpe = 2 if precision in ("bf16", "fp16") else 4
    n_layers = dims.layers if layers is None else layers
    n = batch * seq
    gemms = [gemm_time(n, k, m, spec, peak, bpe) for k, m in block_gemms(dims, tp)]
    gemm = 3 * sum(gemms)
    heads_width = dims.q / tp
    if attention == "flash":
        attn = 7 * batch * seq * (cp * seq) * heads_width / (peak * attention_efficiency(spec))
        attn_recompute = 0.0
    else:  # per head: [T, hd] x [hd, T] scores and [T, T] x [T, hd], forward; backward twice that
        heads = batch * dims.heads / tp
        hd = dims.q / dims.heads
        bmm = heads * (gemm_time(seq, hd, seq, spec, peak, bpe) + gemm_time(seq, seq, hd, spec, peak, bpe))
        scores = heads * seq * seq
        attn = 3 * bmm + 20 * scores / bw
        attn_recompute = bmm + 9 * scores / bw  # Megatron's selective: the core's forward once more
    kind = "gpt" if dims.kind == "gpt" else ("llama-compiled" if compiled else "llama")
    if kind == "gpt":
        per_token = GPT_ELEMENTWISE * dims.d * bpe / 2
    else:
        cd, ckv, cf = ELEMENTWISE[kind]
        per_token = (cd * dims.d + ckv * dims.kv + cf * dims.f) * bpe / 2
    whole = NORM_SHARE[kind] * dims.d * bpe / 2  # the norms' and residual's part: whole without sequence parallelism
    split = per_token - whole
    fwd_bytes = n * (split / tp + (whole / tp if sequence_parallel or tp == 1 else whole))
    elementwise = 3 * fwd_bytes / bw
    recompute = 0.0
    if checkpointing == "selective":
        recompute = attn_recompute if selective == "megatron" else fwd_bytes / bw
        if selective == "torchtitan":  # every second mm of the block: its forward once more
            recompute += sum(gemms[1::2])
    elif checkpointing == "full":  # the whole block's forward once more
        recompute = (gemm + attn + elementwise) / 3
    block = gemm + attn + elementwise + recompute
    out = {"gemm": n_layers * gemm, "attention": n_layers * attn, "memory_bound": n_layers * elementwise,
           "recompute": n_layers * recompute, "head": 0.0}
    if head:
        out["head"] = 3 * gemm_time(n, dims.d, dims.vocab / tp, spec, peak, bpe) + n * dims.vocab / tp * (
            16 if fused_loss else 40) / bw
    out["total"] = n_layers * block + out["head"]
    return out


def modelled_efficiency(dims: Dims, spec: GpuSpec, *, flops_per_token: float, batch: int, seq: int,
                        **kw: object) -> tuple[float, dict[str, float]]:
    """(the share of the dense peak the layout's model FLOPs reach, `micro_batch_time`'s parts) for one micro-batch
    on one rank (all layers; tensor parallelism divides FLOPs and time alike)."""
    parts = micro_batch_time(dims, spec, batch=batch, seq=seq, **kw)  # type: ignore[arg-type]
    precision = str(kw.get("precision", "bf16"))
    peak = spec.peaks.get(precision if precision != "fp32" else "tf32") or spec.peaks["fp32"]
    tp = int(kw.get("tp", 1))  # type: ignore[call-overload]
    ideal = batch * seq * flops_per_token / tp / peak
    return ideal / parts["total"], parts
