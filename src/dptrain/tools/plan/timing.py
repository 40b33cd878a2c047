"""α-β time model of one optimizer step of the built-in LLaMA (a prediction).

- Compute: training FLOPs per token (`LlamaLM.flops_per_token`: 6*N + 12*L*d*T, N the
  non-embedding parameters) x the tokens a rank's model replica processes per step / (tp * pp),
  at the device's dense peak for the precision (fp32 as tf32) x `efficiency`. `efficiency` is
  stated by the user (`--efficiency`) or calibrated from a finished run (`--calibrate RUN_DIR`,
  plan/calibrate.py). Full activation checkpointing adds one forward: x 4/3; selective
  (dptrain's op-level policy keeps every matmul output) recomputes no matmul: x 1;
  selective_torchtitan recomputes the forward of wk, wo and w3: 2*(d*kv + q*d + d*f) FLOPs per token
  and layer more (`recompute_flops_per_token`). The memory-bound ops both selective modes recompute are
  in the modelled efficiency (plan/efficiency.py).
- Pipeline bubble: the compute time / (1 - (p-1)/(m+p-1)), m micro-batches per schedule; the
  fill and drain's stage-to-stage transfers are exposed (`pipeline_p2p_time`). Not modelled: the
  lower efficiency of small kernels when m splits the micro-batch finely (pp rows are optimistic).
- Collectives over N ranks, S bytes, link bandwidth B (bytes/s, one direction), latency α per
  step: ring all-reduce 2(N-1)·α + 2(N-1)/N·S/B; all-gather and reduce-scatter (N-1)·α + (N-1)/N·S/B.
  The data-parallel link is the datasheet's (metrics/hardware.py, INTERCONNECTS) or fitted to a
  `dptrain doctor --comm --json` sweep (`--comm FILE`).
- What each strategy sends per optimizer step (gradients fp32 under dptrain's autocast, or the
  compression's dtype for fp16/bf16; FSDP gathers in `fsdp_param_dtype` and reduces in
  `fsdp_reduce_dtype` when set): ddp all-reduces the gradients once, in DDP's buckets (the first
  1 MiB, then `bucket_cap_mb` each, in reverse parameter order); zero1 as ddp, then all-gathers
  the updated parameters after the optimizer step; zero2 all-gathers the parameters once and fsdp
  twice (forward, backward) per micro-step (under pp once per pipeline micro-batch: `fsdp_gathers`),
  and both reduce-scatter on the last micro-step. cpu_offload adds its host copies and the
  optimizer step on the host (`offload_time`).
  PowerSGD and onebit change what a DDP bucket costs (`compression_cost`); their warm-up steps
  (plain all-reduce before `powersgd_start_step` / `onebit_start_step`) are not modelled: the
  prediction is the steady state.
- Overlap. On a GPU the collectives run beside the compute: DDP's bucket k starts when backward
  has produced its gradients (backward, 2/3 of the last micro-step's compute, produces them at an
  even rate) and the link is free; what runs past the end of backward is exposed. FSDP prefetches
  one unit ahead: the first unit's all-gather and the last unit's reduce-scatter are exposed, and
  whatever of the rest exceeds the compute. zero1's parameter all-gather follows the optimizer
  step: exposed. On the CPU (`--gpu-type cpu`) gloo's collectives need the cores the compute is
  using: nothing overlaps, every collective adds to the step. Tensor-parallel traffic is not
  overlapped.
- Context parallelism (`parallel.cp`): each of the cp ranks of a model replica computes 1/cp of its tokens' FLOPs
  (the load-balanced chunks give every rank the same share of the causal attention); gradients are reduced over
  dp x cp ranks (DDP's group; FSDP2 shards over dp_shard x cp). The exchange (`cp_exchange_time`,
  `cp_exchange_bytes`), per the layout's `cp_attention`: the K/V all-gather, per layer and micro-step an all-gather
  of K and one of V in forward, a reduce-scatter of each gradient in backward, and under activation checkpointing
  one more all-gather of each in the recompute; or Ulysses, 4 all-to-alls (q, k, v, output) of the rank's seq/cp
  tokens in forward, 4 in backward and 4 more in the recompute. Both wait for their result before attention, so none
  of it overlaps with compute: all of it is exposed (a ring that overlaps the exchange with attention, as
  torchtitan's and Megatron's do, would hide most of the all-gather's; not built). With tp (cp x tp) each rank
  exchanges its own heads (n_heads/tp, n_kv_heads/tp) over its cp group, and the tensor-parallel all-reduces carry
  the rank's seq/cp tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dptrain.metrics.hardware import GpuSpec
from dptrain.tools.plan.efficiency import SUSTAINED, Dims, modelled_efficiency
from dptrain.tools.plan.llama import RECOMPUTING, param_counts, param_shapes
from dptrain.tools.plan.memory import Layout, pipeline_bubble

if TYPE_CHECKING:  # annotations only: the planner imports no torch (`dptrain --help` stays fast)
    from dptrain.models.llama import LlamaConfig
    from dptrain.tools.plan.measure import ModelProfile

# Inter-node links, bytes/s per GPU per direction, and α per collective step (stated assumptions:
# the nominal line rate of one NIC per GPU -- 400 Gb/s InfiniBand NDR, 100 Gb/s Ethernet; α a
# typical order of magnitude, not measured here: give `--comm FILE` for a measured link).
INTERCONNECTS = {"ib": (400e9 / 8, 10e-6), "ethernet": (100e9 / 8, 30e-6)}
INTRA_ALPHA = {"nvlink": 5e-6, "pcie": 10e-6}
INTERCONNECT_CHOICES = ("nvlink", "pcie", "ib", "ethernet")
FIRST_BUCKET_BYTES = 2**20  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES: DDP's first bucket
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction
    alpha: float  # seconds per step


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: 2(N-1) steps of latency plus 2(N-1)/N·S/B."""
    return 0.0 if n <= 1 else 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes / link.bandwidth


def gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather or reduce-scatter of S bytes in all: (N-1) steps plus (N-1)/N·S/B."""
    return 0.0 if n <= 1 else (n - 1) * link.alpha + (n - 1) / n * nbytes / link.bandwidth


def bubble_fraction(pp: int, microbatches: int) -> float:
    """Idle share of a pipeline schedule: (p-1)/(m+p-1)."""
    return (pp - 1) / (microbatches + pp - 1)


def links(spec: GpuSpec, *, nodes: int, interconnect: str, spans_nodes: bool, per_node: int = 1) -> Link:
    """The ring's slowest link: inside a node NVLink (or PCIe without it), across nodes the
    interconnect. Datasheet bandwidths are both directions together: halved. Across nodes with
    `per_node` GPUs each holding a NIC, NCCL runs one ring channel per NIC, each carrying 1/per_node
    of the data over its own NIC: the node's NICs together, at most the GPU's intra-node link."""
    if interconnect not in INTERCONNECT_CHOICES:
        raise ValueError(f"unknown interconnect {interconnect!r} (valid: {', '.join(INTERCONNECT_CHOICES)})")
    if nodes > 1 and spans_nodes:
        bw, alpha = INTERCONNECTS.get(interconnect, INTERCONNECTS["ib"])
        if per_node > 1:
            inside = links(spec, nodes=1, interconnect="nvlink", spans_nodes=False).bandwidth
            bw = min(bw * per_node, max(bw, inside))
        return Link(bw, alpha)
    if interconnect == "pcie" or not spec.nvlink_gbps:
        return Link(spec.pcie_gbps * 1e9 / 2, INTRA_ALPHA["pcie"])
    return Link(spec.nvlink_gbps * 1e9 / 2, INTRA_ALPHA["nvlink"])


def ddp_buckets(nbytes: float, cap_mb: float) -> list[float]:
    """DDP's bucket sizes for `nbytes` of gradients, in the order they fill during backward."""
    caps, left = [], float(nbytes)
    cap: float = FIRST_BUCKET_BYTES
    while left > 0:
        caps.append(min(cap, left))
        left -= caps[-1]
        cap = cap_mb * 2**20
    return caps


def bucket_overlap(buckets: list[float], n: int, link: Link, *, backward: float,
                   seconds: Callable[[float], float] | None = None) -> tuple[float, float]:
    """(seconds on the link, seconds exposed past the end of backward) for DDP's buckets, each sent
    once backward has produced it (an even rate over `backward` seconds) and the link is free.
    `seconds(bucket bytes)`: what sending one bucket takes (default: a ring all-reduce of it)."""
    cost = seconds or (lambda size: all_reduce_time(size, n, link))
    total, done, free, busy = sum(buckets), 0.0, 0.0, 0.0
    for size in buckets:
        done += size
        ready = backward * done / total if total else 0.0
        t = cost(size)
        free = max(free, ready) + t
        busy += t
    return busy, max(0.0, free - backward)


def compression_cost(shapes: list[tuple[int, ...]] | None, lay: Layout, n: int,
                     link: Link) -> Callable[[float], float] | None:
    """Seconds to send one DDP bucket of `b` fp32 gradient bytes under `lay.grad_compression`
    (None: plain all-reduce). The model's totals are spread evenly over the buckets.

    - powersgd (torch's powerSGD_hook, rank r, min_compression_rate 2): an m x n gradient (its
      shape[0] x the rest) whose r(m+n)*2 < mn travels as P (m x r) and Q (n x r), fp32; the others
      uncompressed. Three all-reduces per bucket: the uncompressed tensors, P, Q.
    - onebit (parallel/onebit.py): ceil(numel/8) bytes of signs + 4 per tensor from every rank, by
      all_gather: the ring moves n times that message.
    """
    if lay.grad_compression not in ("powersgd", "onebit") or not shapes:
        return None  # shapes None: a measured model's tensors are not known by shape (sent uncompressed)
    numel = sum(math.prod(s) for s in shapes)
    if lay.grad_compression == "onebit":
        per_elem = (numel / 8 + 4 * len(shapes)) / (4 * numel)  # message bytes per fp32 gradient byte
        return lambda b: gather_time(n * b * per_elem, n, link)
    r, sent = lay.powersgd_rank, 0
    for s in shapes:
        rows, cols = s[0], math.prod(s[1:]) if len(s) > 1 else 1
        sent += r * (rows + cols) if len(s) > 1 and r * (rows + cols) * 2 < rows * cols else rows * cols
    ratio = sent / numel
    return lambda b: all_reduce_time(b * ratio, n, link) + 2 * all_reduce_time(0.0, n, link)


def _dp_comm(lay: Layout, *, params: float, units: float, shapes: list[tuple[int, ...]] | None, dp: int, link: Link,
             compute_micro: float, accum: int, overlap: bool) -> tuple[float, float]:
    """(seconds the data-parallel collectives take, seconds of them exposed) per optimizer step, for
    `params` parameters per replica (the rank's stage and tensor-parallel share) in `units` FSDP units."""
    grad_b = DTYPE_BYTES.get(lay.grad_dtype or "fp32", 4)
    if lay.strategy in ("ddp", "zero1"):
        buckets = ddp_buckets(grad_b * params, lay.bucket_cap_mb)
        busy, exposed = bucket_overlap(buckets, dp, link, backward=2 / 3 * compute_micro,
                                       seconds=compression_cost(shapes, lay, dp, link))
        if not overlap:
            exposed = busy
        if lay.strategy == "zero1":  # the updated parameters, after the optimizer step
            gather = gather_time(4 * params, dp, link)
            busy, exposed = busy + gather, exposed + gather
        return busy, exposed
    param_b = DTYPE_BYTES.get(lay.param_dtype or "fp32", 4)
    reduce_b = DTYPE_BYTES.get(lay.reduce_dtype or lay.param_dtype or "fp32", 4)
    per_micro = fsdp_gathers(lay) * gather_time(param_b * params, dp, link)
    last_rs = gather_time(reduce_b * params, dp, link)
    busy = accum * per_micro + last_rs
    if not overlap:
        return busy, busy
    first = gather_time(param_b * params / units, dp, link) + gather_time(reduce_b * params / units, dp, link)
    exposed = accum * max(first, per_micro - compute_micro) + max(0.0, last_rs - 2 / 3 * compute_micro)
    return busy, exposed


def fsdp_gathers(lay: Layout) -> float:
    """All-gathers of the parameters per micro-step. zero2: 1 (kept from forward to backward); fsdp:
    2 (forward, backward). fsdp under pp: torch.distributed.pipelining runs the stage once per
    pipeline micro-batch and keeps reshard-after-backward off until the last one
    (`PipelineStage.backward_maybe_with_nosync`), so each forward after a reshard gathers again:
    1F1B on the worst (first) stage min(m, pp) warm-up forwards + m backwards = m + min(m, pp) - 1
    per schedule, gpipe m + 1."""
    if lay.strategy != "fsdp":
        return 1
    if lay.pp == 1:
        return 2
    m = max(1, lay.pp_microbatches)
    return m + 1 if lay.pp_schedule == "gpipe" else m + min(m, lay.pp) - 1


# cpu_offload's optimizer step on the host, parameters per second per rank: an assumption. torch's
# foreach AdamW reached 1.3e8/s on one core of this machine; 5e8 supposes about four host cores per GPU.
HOST_OPTIMIZER_PARAMS_PER_S = 5e8


def offload_time(replica_params: float, lay: Layout, spec: GpuSpec, *, accum: int) -> float:
    """Seconds `cpu_offload` (FSDP2's CPUOffloadPolicy, zero2/fsdp) adds per step, not overlapped (an
    upper bound: FSDP2 issues the copies with its all-gathers): the rank's fp32 parameter shard
    copied in before every all-gather, its gradient shard copied out once, over the host link (PCIe,
    half the datasheet's bidirectional figure), and the optimizer step on the host."""
    if not lay.cpu_offload or lay.strategy not in ("zero2", "fsdp"):
        return 0.0
    params = replica_params / max(1, lay.dp_shard)
    copies = accum * fsdp_gathers(lay) * 4 * params + 4 * params
    on_link = copies / (spec.pcie_gbps * 1e9 / 2) if spec.pcie_gbps else 0.0  # the CPU as device: no copies
    return on_link + params / HOST_OPTIMIZER_PARAMS_PER_S


def pipeline_p2p_time(cfg: LlamaConfig, lay: Layout, spec: GpuSpec, *, gpus: int, nodes: int, interconnect: str,
                      accum: int, comm: Link | None = None) -> float:
    """Exposed seconds of the activations and their gradients sent between pipeline stages: one
    [micro-batch / m, seq / cp, dim] tensor in the compute dtype per pipeline micro-batch and boundary,
    each way (under cp each stage holds the rank's share of the row). The steady state overlaps with other
    micro-batches' compute; the fill and the drain do
    not: 2 (pp - 1) transfers per schedule are exposed. The stages sit on one node while tp * pp
    fits one, else the inter-node link carries them."""
    if lay.pp == 1:
        return 0.0
    m = max(1, lay.pp_microbatches)
    nbytes = DTYPE_BYTES.get(lay.precision, 4) * lay.micro_batch / m * (lay.seq // lay.cp) * cfg.dim
    per_node = max(1, gpus // nodes)
    link = comm if comm and lay.tp * lay.pp > per_node else links(
        spec, nodes=nodes, interconnect=interconnect, spans_nodes=lay.tp * lay.pp > per_node)
    return accum * 2 * (lay.pp - 1) * (link.alpha + nbytes / link.bandwidth)


def cp_exchange_bytes(cfg: LlamaConfig, lay: Layout, *, recompute: bool = False) -> tuple[int, float]:
    """(collectives, bytes one rank sends) per layer and micro-step of context parallelism's exchange (module
    docstring), in the compute dtype, each rank's own heads under tp. Forward and backward, plus the recompute's
    forward under activation checkpointing (`recompute`):
    - allgather: K and V ``[micro-batch, seq, kv heads/tp x head dim]`` once gathered; an all-gather of each in
      forward, a reduce-scatter of each in backward, each sending (cp-1)/cp of the whole row's K or V: the bytes per
      rank do not fall with cp;
    - ulysses: q, k, v and the attention output, each the rank's ``[micro-batch, seq/cp, heads/tp x head dim]`` (KV
      heads for k and v), one all-to-all each in forward and in backward, each sending (cp-1)/cp of it: the bytes per
      rank fall as 1/cp."""
    if lay.cp == 1:
        return 0, 0.0
    assert cfg.n_kv_heads is not None
    width = DTYPE_BYTES.get(lay.precision, 4) * lay.micro_batch * cfg.head_dim / lay.tp
    share = (lay.cp - 1) / lay.cp
    if lay.ulysses:
        local = lay.seq / lay.cp
        forward = 2 * local * width * (cfg.n_heads + cfg.n_kv_heads)  # q and output, k and v
        passes = 3 if recompute else 2
        return 4 * passes, passes * share * forward
    kv = lay.seq * width * cfg.n_kv_heads
    calls = 4 + (2 if recompute else 0)
    return calls, calls * share * kv


def cp_exchange_time(cfg: LlamaConfig, lay: Layout, spec: GpuSpec, *, gpus: int, nodes: int, interconnect: str,
                     accum: int, comm: Link | None = None) -> float:
    """Exposed seconds per step of context parallelism's exchange (module docstring): per layer and micro-step the
    collectives and bytes of `cp_exchange_bytes`, each collective (cp-1) steps of the link's latency (a ring
    all-gather or reduce-scatter, a pairwise all-to-all), the bytes at its bandwidth. The cp ranks sit next to each
    other in the mesh (only tp is inner): one node's link while cp * tp fits a node, else the interconnect (or the
    measured link `comm`)."""
    if lay.cp == 1:
        return 0.0
    per_node = max(1, gpus // nodes)
    spans = lay.cp * lay.tp > per_node
    # a CPU has no table link: the measured one (as the data-parallel link)
    link = comm if comm and (spans or spec.key == "cpu") else links(spec, nodes=nodes, interconnect=interconnect,
                                                                      spans_nodes=spans)
    calls, nbytes = cp_exchange_bytes(cfg, lay, recompute=lay.checkpointing in RECOMPUTING)
    return accum * cfg.n_layers * (calls * (lay.cp - 1) * link.alpha + nbytes / link.bandwidth)


def layout_efficiency(cfg: LlamaConfig, lay: Layout, spec: GpuSpec, *, flops_per_token: float) -> float:
    """The share of the dense peak a micro-batch of the built-in LLaMA reaches on `spec` under `lay`, from
    plan/efficiency.py (GEMM shapes, attention, memory-bound ops) x `SUSTAINED` (plan/published.py)."""
    assert cfg.n_kv_heads is not None and cfg.ffn_hidden is not None
    if not spec.hbm_gbps:  # the CPU as a device, or a GPU without the table's bandwidth: no model, state one
        raise ValueError(f"{spec.name} has no memory bandwidth in metrics/hardware.py: give --efficiency or "
                         "--calibrate")
    dims = Dims(d=cfg.dim, q=cfg.n_heads * cfg.head_dim, kv=cfg.n_kv_heads * cfg.head_dim, f=cfg.ffn_hidden,
                vocab=cfg.vocab_size, layers=cfg.n_layers, heads=cfg.n_heads)
    batch = max(1, lay.micro_batch // max(1, lay.pp_microbatches))
    eff, _ = modelled_efficiency(dims, spec, flops_per_token=flops_per_token, batch=batch, seq=lay.seq, tp=lay.tp,
                                 sequence_parallel=lay.sequence_parallel, precision=lay.precision,
                                 checkpointing="selective" if lay.checkpointing.startswith("selective") else "none")
    return eff * SUSTAINED


def recompute_flops_per_token(cfg: LlamaConfig, checkpointing: str) -> float:
    """Matmul FLOPs per token that `checkpointing` runs again in backward beyond the model's 6*N + 12*L*d*T: the
    forward of every second mm of a block under selective_torchtitan (wk, wo, w3); full's x 4/3 is `step_time`'s."""
    if checkpointing != "selective_torchtitan":
        return 0.0
    assert cfg.n_kv_heads is not None and cfg.ffn_hidden is not None
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return 2.0 * cfg.n_layers * (cfg.dim * kv + q * cfg.dim + cfg.dim * cfg.ffn_hidden)


def step_time(cfg: LlamaConfig, lay: Layout, spec: GpuSpec, *, gpus: int, nodes: int, interconnect: str,
              accum: int, efficiency: float | None, comm: Link | None = None) -> dict[str, float]:
    """Predicted seconds per optimizer step, its parts, and tokens/s over all GPUs. `comm`: a
    measured data-parallel link (plan/calibrate.py) instead of the datasheet's. `efficiency` None:
    modelled (`layout_efficiency`); the result's "efficiency" says which was used."""
    c = param_counts(cfg)
    nonemb = c.total - (0 if cfg.tie_embeddings else c.embedding)
    fpt = 6 * nonemb + 12 * cfg.n_layers * cfg.dim * lay.seq
    dtype = lay.precision if lay.precision != "fp32" else "tf32"
    peak = spec.peaks.get(dtype) or spec.peaks["fp32"]
    if efficiency is None:  # modelled from what is computed (plan/efficiency.py)
        efficiency = layout_efficiency(cfg, lay, spec, flops_per_token=fpt)
    if not efficiency > 0:  # a calibrated one may exceed 1 slightly (plan/calibrate.py); --efficiency is (0, 1]
        raise ValueError(f"efficiency={efficiency} must be > 0")
    tokens = lay.micro_batch * lay.seq * accum  # per model replica per step
    compute = tokens * fpt / (lay.tp * lay.pp * lay.cp) / (peak * efficiency)
    if lay.checkpointing == "full":
        compute *= 4 / 3
    compute *= 1 + recompute_flops_per_token(cfg, lay.checkpointing) / fpt
    m = max(1, lay.pp_microbatches)
    compute /= 1 - pipeline_bubble(lay.pp, m, lay.pp_stages_per_rank)
    dp = gpus // (lay.tp * lay.pp * lay.cp)  # model replicas; gradients are reduced over their dp x cp ranks
    grad_ranks = dp * lay.cp
    per_node = max(1, gpus // nodes)
    overlap = spec.key != "cpu"
    dp_link = comm or links(spec, nodes=nodes, interconnect=interconnect, spans_nodes=gpus > per_node,
                            per_node=per_node)
    replica = c.total / (lay.tp * lay.pp)  # parameters of one replica's share of the model
    dp_comm, exposed = _dp_comm(lay, params=replica, units=c.n_layers / lay.pp + 1, shapes=param_shapes(cfg),
                                dp=grad_ranks, link=dp_link, compute_micro=compute / accum, accum=accum,
                                overlap=overlap) if grad_ranks > 1 else (0.0, 0.0)
    act = (2 if lay.precision != "fp32" else 4) * lay.micro_batch * lay.seq // lay.cp * cfg.dim  # the cp rank's share
    # a CPU has no table link: the measured one (as the data-parallel link)
    tp_link = links(spec, nodes=1, interconnect="nvlink", spans_nodes=False) if lay.tp > 1 and spec.key != "cpu" \
        else dp_link
    tp_comm = accum * 4 * cfg.n_layers / lay.pp * all_reduce_time(act, lay.tp, tp_link)
    offload = offload_time(replica, lay, spec, accum=accum)
    pp_comm = pipeline_p2p_time(cfg, lay, spec, gpus=gpus, nodes=nodes, interconnect=interconnect, accum=accum,
                                comm=comm)
    cp_comm = cp_exchange_time(cfg, lay, spec, gpus=gpus, nodes=nodes, interconnect=interconnect, accum=accum,
                               comm=comm)
    step = compute + exposed + tp_comm + offload + pp_comm + cp_comm
    return {"compute": compute, "dp_comm": dp_comm, "exposed_comm": exposed, "tp_comm": tp_comm, "pp_comm": pp_comm,
            "cp_comm": cp_comm, "offload": offload,
            "step": step,
            "tokens_per_s": tokens * dp / step, "flops_per_token": fpt, "mfu": tokens * dp * fpt / step / gpus / peak,
            "efficiency": efficiency}


def profile_step_time(prof: ModelProfile, lay: Layout, spec: GpuSpec, *, gpus: int, nodes: int, interconnect: str,
                      accum: int, efficiency: float, comm: Link | None = None) -> dict[str, float]:
    """`step_time` for a measured model (plan/measure.py; tp = pp = 1): compute is the measured
    training FLOPs of one micro-batch (full checkpointing: the blocks' forward once more) x `accum`
    at the dense peak x `efficiency`; the data-parallel traffic and its overlap follow `step_time`'s
    rules for the measured parameter count (gradients fp32; PowerSGD/onebit not modelled: a measured
    model's tensors are known by size only). Samples/s, and tokens/s when the dataset has a `seq_len`."""
    if not efficiency > 0:
        raise ValueError(f"efficiency={efficiency} must be > 0")
    dtype = lay.precision if lay.precision != "fp32" else "tf32"
    peak = spec.peaks.get(dtype) or spec.peaks["fp32"]
    flops = accum * prof.training_flops(lay.checkpointing)  # per rank per step
    compute = flops / (peak * efficiency)
    per_node = max(1, gpus // nodes)
    link = comm or links(spec, nodes=nodes, interconnect=interconnect, spans_nodes=gpus > per_node, per_node=per_node)
    dp_comm, exposed = _dp_comm(lay, params=prof.params, units=max(1, prof.units), shapes=None, dp=gpus, link=link,
                                compute_micro=compute / accum, accum=accum,
                                overlap=spec.key != "cpu") if gpus > 1 else (0.0, 0.0)
    offload = offload_time(prof.params, lay, spec, accum=accum)
    step = compute + exposed + offload
    samples = lay.micro_batch * accum * gpus / step
    return {"compute": compute, "dp_comm": dp_comm, "exposed_comm": exposed, "tp_comm": 0.0, "pp_comm": 0.0,
            "offload": offload, "step": step, "samples_per_s": samples,
            "tokens_per_s": samples * prof.seq_len if prof.seq_len else 0.0, "flops_per_step": flops,
            "mfu": flops / step / peak}
