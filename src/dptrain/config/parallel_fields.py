"""The `parallel` section: how the model is laid out over the ranks (strategy, the device-mesh degrees dp_replicate,
dp_shard, tp, pp, cp, and each technique's settings). A frozen dataclass with one docstring per field, like the rest
of the tree (config/fields.py, which assembles `Config` and re-exports it); `config/layout.py` is the only reader of
`strategy`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    strategy: str = "ddp"
    """single, dp, ddp, zero1, zero2 or fsdp. `dp` is torch's legacy nn.DataParallel (one process drives every local
    GPU; GPUs only; written, not yet run on a GPU), not the data-parallel degree, which is dp_replicate x dp_shard."""
    bucket_cap_mb: float = 5.0
    """DDP gradient bucket size in MiB (5: measured to hide the most communication behind backward,
    docs/results/communication.md, "Overlap and buckets"; PyTorch's own default is 25)."""
    gradient_as_bucket_view: bool = True
    """ddp/zero1: gradients are views into DDP's communication buckets (no copy in or out, less memory)."""
    static_graph: bool = False
    """ddp/zero1: tell DDP the autograd graph and the set of used parameters are the same every step (it may then
    reorder buckets and skip per-step bookkeeping); wrong gradients or errors if the model's control flow varies."""
    sync_each_micro_step: bool = False
    """Reduce gradients on every micro-step instead of only the last (lower memory under FSDP, more traffic)."""
    cpu_offload: bool = False
    """fsdp and zero2: keep parameters, gradients and optimizer state on the CPU (FSDP2 CPUOffloadPolicy)."""
    nvme_offload_dir: str | None = None
    """Keep the optimizer state in memory-mapped files in this existing directory on a drive instead of RAM (DeepSpeed's
    offload_optimizer device nvme, nvme_path); training is bit-identical. On CUDA it needs cpu_offload (the optimizer
    steps on the host). See parallel/nvme_offload.py."""
    dp_replicate: int = 1
    """Data-parallel replicas (DDP, or HSDP's replicate dimension); -1 infers it from the world size. With dp_replicate
    and dp_shard both 1, the strategy's own dimension takes the world: dp_replicate for ddp/zero1, dp_shard for
    zero2/fsdp."""
    dp_shard: int = 1
    """Ranks one FSDP2 shard group spans (zero2/fsdp only); dp_replicate > 1 and dp_shard > 1 together = HSDP (replicate
    across groups, shard within one); -1 infers it."""
    tp: int = 1
    """Tensor-parallel degree: each block's matrices are split over this many ranks (innermost mesh dimension; the ranks
    of one tp group see the same batch); -1 infers it. Composes with ddp, zero2 and fsdp (also HSDP); zero1 and pp > 1
    are refused. The built-in LLaMA and Hugging Face models with a base_model_tp_plan have a plan; other models need
    tp_plan."""
    tp_plan: str | None = None
    """Import path `pkg.mod:fn` of a function fn(model, tp_mesh) that applies your model's tensor-parallel plan in place
    (e.g. torch.distributed.tensor.parallel.parallelize_module); null: the built-in LLaMA plan (q/k/v, w1/w3 and head
    column-wise, wo, w2 and embedding row-wise)."""
    sequence_parallel: bool = True
    """With tp > 1, the built-in LLaMA plan: RMSNorms and the residual stream hold 1/tp of the sequence (each all-reduce
    becomes a reduce-scatter plus an all-gather); the model's input length must be divisible by tp."""
    loss_parallel: bool = False
    """With tp > 1, the built-in LLaMA plan: keep the logits sharded over the vocabulary and compute the cross-entropy
    on the shards (torch.distributed.tensor.parallel.loss_parallel) instead of gathering [batch, seq, vocab] on every
    rank."""
    pp: int = 1
    """Pipeline-parallel degree: ranks the model's layers are split over (built-in LLaMA only; see
    docs/guides/strategies.md, "Pipeline parallelism"); -1 infers it. dp_replicate * dp_shard * cp * tp * pp must equal
    the world size; at most one of them may be -1."""
    cp: int = 1
    """Context-parallel degree: ranks each sequence is split over (built-in LLaMA only; docs/guides/long-sequences.md).
    Each of the cp ranks of a data-parallel rank takes chunks i and 2*cp-1-i of the rows' 2*cp equal chunks (causal load
    balance); attention is exact (cp_attention). Gradients are averaged over dp x cp. Composes with
    ddp, zero2 and fsdp (dp_shard: parameters sharded over dp_shard x cp), tp and pp, and packed rows; zero1 is refused;
    the model's input length must be divisible by 2*cp. dp_replicate * dp_shard * cp * tp * pp = world size. Which
    attention splits the row: cp_attention."""
    cp_attention: str = "auto"
    """cp > 1: how attention sees the whole row. allgather: K/V all-gathered over the cp ranks, each rank's queries
    attend to the whole row's keys (any head count). ulysses: DeepSpeed-Ulysses, q/k/v all-to-all'd from T/cp tokens
    x all heads to all T tokens x 1/cp of the heads, plain causal attention, all-to-all back (less communication per
    rank as cp grows); needs the query and the KV heads of each tp rank (n_heads/tp, n_kv_heads/tp) divisible by cp,
    refused before launch otherwise. auto: ulysses where the heads allow, else allgather. The choice is logged;
    docs/guides/long-sequences.md compares them."""
    pp_schedule: str = "1f1b"
    """pp > 1: the pipeline schedule of torch.distributed.pipelining: gpipe (all forwards, then all backwards), 1f1b
    (one forward, one backward in the steady state; needs pp_microbatches >= pp) or interleaved_1f1b (pp_stages_per_rank
    >= 2 virtual stages per rank)."""
    pp_microbatches: int | None = None
    """pp > 1: pipeline micro-batches each micro-batch is split into (train.micro_batch_size must be divisible by it);
    null: pp. Accumulation runs grad_accum_steps such schedules per optimizer step."""
    pp_microbatch_size: int | None = None
    """pp > 1: rows per pipeline micro-batch instead of a count (DeepSpeed's train_micro_batch_size_per_gpu under its
    pipeline engine): pp_microbatches = micro_batch_size / this, known once the batch is derived; with 1f1b and fewer
    pipeline micro-batches than stages the schedule becomes gpipe. Leave pp_microbatches null with it."""
    pp_stages_per_rank: int = 1
    """pp > 1: pipeline stages per rank (virtual stages; >= 2 only with pp_schedule=interleaved_1f1b, which needs it).
    Rank r holds stages r, r + pp, r + 2*pp, ..."""
    pp_layers: tuple[int, ...] | None = None
    """pp > 1: transformer blocks per stage, first stage first, e.g. [3, 5] (pp * pp_stages_per_rank entries, each >= 1,
    summing to the model's n_layers); null: an even split, the first n_layers % stages stages taking one more. The
    embedding is on the first stage, the final norm and output layer on the last."""
    activation_checkpointing: str = "none"
    """Recompute activations in backward, per block (FSDP units): none, full (keep only each block's input), selective
    (keep every matmul and attention output, recompute the rest: op-level SAC) or selective_torchtitan (torchtitan's
    default op-level SAC: as selective but every second mm of a block is recomputed too; less memory, more
    recompute)."""
    fsdp_param_dtype: str | None = None
    """zero2/fsdp: dtype FSDP2 gathers parameters in for compute (fp32, bf16, fp16; MixedPrecisionPolicy.param_dtype);
    null keeps the parameters' own dtype (fp32: precision.dtype=bf16 then runs autocast over fp32 parameters, the
    default). bf16 with fsdp_reduce_dtype=fp32 is torchtitan's pure-bf16 path (docs/guides/precision-accumulation.md:
    which is the default and why)."""
    fsdp_reduce_dtype: str | None = None
    """zero2/fsdp: dtype of the gradient reduce-scatter (MixedPrecisionPolicy.reduce_dtype); null: the gathered
    parameters' dtype."""
    grad_compression: str = "none"
    """Gradient communication compression (docs/guides/strategies.md, "Gradient compression"): none; fp16 or bf16
    (DDP: torch's
    fp16/bf16_compress_hook; zero2/fsdp: FSDP2's reduce dtype; bf16 needs NCCL); powersgd (torch's PowerSGD hook with
    error feedback, ddp/zero1 only) or onebit (sign bits packed 8 per byte plus one scale per tensor, with error
    feedback, ddp/zero1 only). Needs a data-parallel world size >= 2."""
    powersgd_rank: int = 8
    """grad_compression=powersgd: the rank of the low-rank approximation P Q^T of each gradient matrix (torch's
    matrix_approximation_rank; higher is more exact and sends more). 8: measured on the recipe
    (docs/guides/strategies.md, "Gradient compression"), the lowest rank within 1% of the uncompressed loss from step
    50; rank 1 ends 19% above it."""
    powersgd_start_step: int = 50
    """grad_compression=powersgd: optimizer steps that all-reduce uncompressed before PowerSGD starts (torch's
    start_powerSGD_iter; torch suggests ~10% of training and no less than the warmup); at least 2, since DDP rebuilds
    its buckets after the first step and error feedback and warm start keep per-bucket state."""
    onebit_start_step: int = 50
    """grad_compression=onebit: optimizer steps that all-reduce uncompressed before sign compression starts (the warmup
    stage of 1-bit Adam; from step 0 the recipe's loss ends 38% higher, from 50 3%); 0 compresses from the first step.
    """
    reshard_after_forward: bool | int | None = None
    """zero2/fsdp: FSDP2's reshard_after_forward for every block: true (free the gathered parameters after forward,
    gather again in backward), false (keep them until backward), or an integer N, a divisor of dp_shard with 1 < N <
    dp_shard (after forward keep the parameters sharded over groups of N ranks, so backward's all-gather spans N ranks);
    null: the strategy's (fsdp true, zero2 false)."""
    fsdp_forward_prefetch: int = 0
    """zero2/fsdp: in forward each block explicitly starts the all-gather of the next N blocks
    (FSDPModule.set_modules_to_forward_prefetch); 0 keeps FSDP2's implicit prefetch (one block ahead, issued when the
    next block runs)."""
    fsdp_backward_prefetch: int = 0
    """zero2/fsdp: in backward each block explicitly starts the all-gather of the N blocks before it
    (FSDPModule.set_modules_to_backward_prefetch); 0 keeps FSDP2's implicit backward prefetch of one block."""
    device: str = "auto"
    """cpu, cuda or auto (cuda when available)."""
    backend: str = "auto"
    """Process-group backend: nccl, gloo or auto (nccl on cuda, gloo on cpu). The nccl path is written, not yet run on a
    GPU."""
    timeout_s: float = 600.0
    """Collective and init timeout in seconds."""
