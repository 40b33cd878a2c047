"""Published training runs predicted the planner's way: memory per GPU and tokens per second per GPU.

A `Run` states what a published run did (model shape, layout, precision path, checkpointing, framework) and what it
reports; `predict_run` predicts it from plan/efficiency.py (compute), plan/timing.py's collectives, the pipeline
bubble, and plan/gpt.py's or plan/memory.py's memory counts. The rows and their sources are plan/published_runs.py;
`benchmarks/planner/plan_published.py` prints the table that docs/results/planner.md shows.

One factor is set from a published reference run, not from the rows checked: `SUSTAINED`, the share of the
roofline (MAMF GEMMs, FlashAttention's measured rate, HBM bandwidth) that a whole training step's kernels
sustain (launch gaps, clocks under load, imperfect overlap). It is what makes MosaicML's MPT-7B run (llm-foundry
scripts/train/benchmarking/README.md, H100 80GB BF16 table: 7b, seq 2048, 8 GPUs, micro-batch 6, no activation
checkpointing: 10,643 tokens/s/GPU, MFU 46.44%) come out exactly (tests/test_plan_published.py derives it
again); that row is not in the checked table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dptrain.metrics.hardware import GpuSpec, gpu_spec
from dptrain.tools.plan.efficiency import SUSTAINED, Dims, micro_batch_time
from dptrain.tools.plan.memory import FRAMEWORK_OVERHEAD, pipeline_bubble
from dptrain.tools.plan.timing import all_reduce_time, gather_time, links

GIB = 2**30


@dataclass(frozen=True)
class Run:
    """One published run: what it did and what it reports (tokens/s per GPU, or MFU; memory per GPU in bytes)."""

    name: str
    source: str
    dims: Dims
    params: float  # parameters, as the run counts them (for MFU and model states)
    gpu: str
    gpus: int
    seq: int
    micro_batch: int  # sequences per pipeline micro-batch (pipeline) or per micro-step (no pipeline)
    accum: int = 1  # micro-steps per optimizer step (no pipeline) / pipeline micro-batches m (pipeline)
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: each row split over cp ranks (within the dp ranks: FSDP shards over them too)
    stages_per_rank: int = 1  # interleaved pipeline: virtual stages per rank (v)
    sp: bool = False
    framework: str = "fsdp"  # fsdp (FSDP2 / PyTorch FSDP full shard) or megatron
    attention: str = "flash"
    checkpointing: str = "none"
    selective: str = "dptrain"  # whose selective policy: dptrain, torchtitan, megatron
    compiled: bool = False
    nodes: int = 1
    tokens_per_gpu: float | None = None
    mfu: float | None = None
    memory: float | None = None  # bytes per GPU as published
    memory_what: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def spec(self) -> GpuSpec:
        return gpu_spec(self.gpu)

    @property
    def dp(self) -> int:
        """Ranks per (tp, pp) position: the FSDP shard group (dp x cp under context parallelism)."""
        return self.gpus // (self.tp * self.pp)

    @property
    def replicas(self) -> int:
        """Model replicas, each taking its own rows: dp / cp."""
        return self.dp // self.cp

    def flops_per_token(self) -> float:
        """6 * N + 12 * L * d * T: the runs' own MFU convention (Megatron: 72*B*s*L*h^2*(1 + s/6h + V/12hL) / tokens
        is the same to within its embedding term)."""
        return 6 * self.params + 12 * self.dims.layers * self.dims.q * self.seq


def _micro(run: Run, layers: float, head: bool) -> float:
    kind = run.selective if run.checkpointing == "selective" else "dptrain"
    parts = micro_batch_time(run.dims, run.spec, batch=run.micro_batch, seq=run.seq // run.cp, tp=run.tp,
                             sequence_parallel=run.sp, attention=run.attention, checkpointing=run.checkpointing,
                             selective=kind, compiled=run.compiled,
                             fused_loss=run.framework == "megatron", layers=layers, head=head, cp=run.cp)
    return parts["total"]


def step_parts(run: Run, sustained: float = SUSTAINED) -> dict[str, float]:
    """Seconds of one optimizer step on the slowest rank, by part."""
    spec = run.spec
    per_node = run.gpus // run.nodes
    layers = run.dims.layers / run.pp
    compute = _micro(run, layers, head=True) / sustained  # the last stage: its blocks and the output layer
    nvlink = links(spec, nodes=1, interconnect="nvlink", spans_nodes=False)
    tp_comm = 0.0
    if run.tp > 1:  # 2 all-reduces (or reduce-scatter + all-gather) forward, 2 backward per layer, not overlapped
        act = 2 * run.micro_batch * run.seq // run.cp * run.dims.d  # the rank's share of the row under cp
        calls = 4 + (2 if run.checkpointing == "full" else 0)
        tp_comm = calls * layers * all_reduce_time(act, run.tp, nvlink)
    per_micro = compute + tp_comm + cp_exchange(run, layers)
    if run.pp > 1:  # 1F1B: (m + p - 1) slots of one micro-batch's time (interleaved: v * m + p - 1 of 1/v)
        busy = run.accum * per_micro
        step = busy / (1 - pipeline_bubble(run.pp, run.accum, run.stages_per_rank))
    else:
        step = run.accum * per_micro
    exposed = 0.0
    if run.framework == "fsdp" and run.dp > 1:  # bf16 all-gathers (forward, backward), fp32 reduce-scatter
        link = links(spec, nodes=run.nodes, interconnect="ib", spans_nodes=run.gpus > per_node, per_node=per_node)
        shard = run.params
        gathers = 2 * gather_time(2 * shard, run.dp, link) + gather_time(4 * shard, run.dp, link)
        exposed = run.accum * max(0.0, gathers - compute) + gather_time(2 * shard / run.dims.layers, run.dp, link)
    states = run.params / (run.tp * run.pp) / (run.dp if run.framework == "fsdp" else 1)
    optimizer = 28 * states / (spec.hbm_gbps * 1e9)  # fp32 AdamW: read param, grad, m, v; write param, m, v
    total = step + exposed + optimizer
    return {"compute": run.accum * compute, "tp_comm": run.accum * tp_comm,
            "cp_comm": run.accum * cp_exchange(run, layers), "bubble": step - run.accum * per_micro,
            "fsdp_exposed": exposed, "optimizer": optimizer, "step": total}


def cp_exchange(run: Run, layers: float) -> float:
    """Seconds of one micro-batch's K/V exchange under context parallelism, exposed (the all-gather CP of the Llama 3
    paper and of dptrain; torchtitan's ring overlaps part of it, not modelled): per layer an all-gather of K and of V
    (bf16, the rank's tp share of the kv heads, the whole row) forward, a reduce-scatter of each backward, and under
    full checkpointing the gathers once more. The cp ranks sit inside a node while tp * cp fits one (NVLink), else
    each GPU's own NIC carries its group's traffic."""
    if run.cp == 1:
        return 0.0
    per_node = run.gpus // run.nodes
    spans = run.tp * run.cp > per_node
    link = links(run.spec, nodes=2 if spans else 1, interconnect="ib", spans_nodes=spans)
    nbytes = 2 * run.micro_batch * run.seq * run.dims.kv / run.tp
    calls = 4 + (2 if run.checkpointing == "full" else 0)
    return layers * calls * gather_time(nbytes, run.cp, link)


def tokens_per_gpu(run: Run, sustained: float = SUSTAINED) -> float:
    """Predicted tokens per second per GPU."""
    tokens = run.micro_batch * run.seq * run.accum * run.replicas  # per optimizer step, all GPUs
    return tokens / step_parts(run, sustained)["step"] / run.gpus


def mfu(run: Run, tokens: float) -> float:
    """Model FLOPs utilisation of `tokens` per second per GPU at the GPU's dense bf16 peak."""
    return tokens * run.flops_per_token() / run.spec.peaks["bf16"]


def sustained_from(run: Run) -> float:
    """The `SUSTAINED` factor that makes `run` predict its published tokens/s exactly (bisection)."""
    assert run.tokens_per_gpu is not None
    lo, hi = 0.05, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if tokens_per_gpu(run, mid) > run.tokens_per_gpu:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def overhead() -> float:
    """The stated allowance for the CUDA context, workspaces and NCCL buffers (plan/memory.py)."""
    return FRAMEWORK_OVERHEAD
