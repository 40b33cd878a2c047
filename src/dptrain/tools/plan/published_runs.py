"""The published runs `dptrain plan` is checked against (plan/published.py predicts them), each with its source.

- torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024): Llama 3.1 8B, FSDP2 (bf16 parameters, fp32
  reduce), local batch 2 x 8192, op-level selective checkpointing, 8 or 128 H100 96 GB HBM2e at 500 W (hosts of 8,
  400 Gb/s RDMA per GPU); tables 1 and 3; memory is the maximum reserved, GiB.
- Megatron-LM README (2022) "model and hardware FLOPs utilization" table and Korthikanti et al. 2022 ("Reducing
  Activation Recomputation in Large Transformer Models") tables 3 and 4: GPT 22B / 175B / 530B / 1T on A100 80GB,
  sequence 2048, micro-batch 1, tensor parallel 8 with sequence parallelism, pipeline 1 / 8 / 35 / 64, global batch
  4 / 64 / 280 / 512, data parallel 1, selective recompute; MFU 41.5 / 51.4 / 56.0 / 56.3%.
- MosaicML llm-foundry, scripts/train/benchmarking/README.md, "H100 80GB BF16" table (MPT: LayerNorm, GeLU 4h MLP,
  learned positions, tied embeddings, vocabulary 50368, FlashAttention; PyTorch FSDP FULL_SHARD, amp_bf16;
  "Activation Checkpointing True" is full checkpointing, its HFU = 4/3 MFU): every row but the reference
  (plan/published.py: 7b, 2048, 8 GPUs), tokens/s per GPU as published.
- torchtitan, the same file, table 2 (long sequences): Llama 3.1 8B, FSDP + CP + torch.compile + Float8, 8 GPUs,
  local batch 1, full activation checkpointing; FSDP 8 / CP 1 at 32,768 tokens, 4 / 2 at 65,536, 2 / 4 at 131,072,
  1 / 8 at 262,144: 83.9 / 84.2 / 84.0 / 84.5 GiB and 3,890 / 2,540 / 1,071 / 548 tokens/s/GPU. Memory is checked
  (Float8 changes it little: table 1, 77.0 vs 76.8 GiB); the throughput is not: Float8 matmuls are not modelled.
- The Llama 3 Herd of Models (Grattafiori et al. 2024, arXiv:2407.21783) table 4, the long-context row: 405B on
  16,384 H100 80GB with TP 8, CP 16, PP 16, DP 8, sequence 131,072, batch 16 sequences per DP rank (16M tokens),
  380 TFLOPs/GPU, 38% BF16 MFU (the same table shows 400 and 430 TFLOPs/GPU at 8,192 tokens with CP 1). Its CP
  all-gathers K and V and computes the local query chunks' attention (sec. 3.3.2), as dptrain's does. Not published
  and assumed here: the interleaved pipeline's virtual stages per rank (v = 8, one block per virtual stage: 126 blocks
  over 16 ranks; v = 1 would idle 48% of the step), full activation checkpointing, Megatron-style tensor-parallel
  kernels, and 12 * L * d * T attention FLOPs per token in the MFU (the paper does not say whether it halves them
  for the causal mask).
- ZeRO (Rajbhandari et al. 2020) figure 1: 7.5B parameters on 64 GPUs, mixed-precision Adam: 120 / 31.4 / 16.6 /
  1.9 GB per GPU at stages 0-3 (plan/memory.py `zero_states`).
"""

from __future__ import annotations

from dptrain.models.llama import LlamaConfig
from dptrain.tools.plan.efficiency import Dims
from dptrain.tools.plan.gpt import Block, torchtitan_layer_bytes, torchtitan_loss_bytes
from dptrain.tools.plan.llama import block_activation_bytes
from dptrain.tools.plan.published import GIB, Run, overhead

TORCHTITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
MEGATRON = "Megatron-LM README MFU table; Korthikanti et al. 2022 tables 3-4"
MPT = "llm-foundry scripts/train/benchmarking/README.md, H100 80GB BF16"
LLAMA3_PAPER = "The Llama 3 Herd of Models (arXiv:2407.21783) table 4"

LLAMA31_8B = Dims(d=4096, q=4096, kv=1024, f=14336, vocab=128256, layers=32, heads=32)
LLAMA31_8B_PARAMS = 8_030_261_248


def _torchtitan(gpus: int, compiled: bool, tokens: float, memory_gib: float, table: int) -> Run:
    return Run(f"torchtitan Llama 3.1 8B FSDP {gpus} GPUs{' + compile' if compiled else ''}",
               f"{TORCHTITAN} table {table}", LLAMA31_8B, LLAMA31_8B_PARAMS, "H100-96GB", gpus, 8192, 2,
               checkpointing="selective", selective="torchtitan", compiled=compiled, nodes=gpus // 8,
               tokens_per_gpu=tokens, memory=memory_gib * GIB, memory_what="max reserved")


def _torchtitan_cp(cp: int, tokens: float, memory_gib: float) -> Run:
    """Table 2: FSDP 8/cp x CP cp, 32,768 * cp tokens per row, torch.compile + Float8, full checkpointing."""
    return Run(f"torchtitan Llama 3.1 8B FSDP {8 // cp} x CP {cp} at {32768 * cp:,} tokens", f"{TORCHTITAN} table 2",
               LLAMA31_8B, LLAMA31_8B_PARAMS, "H100-96GB", 8, 32768 * cp, 1, cp=cp, checkpointing="full",
               compiled=True, memory=memory_gib * GIB, memory_what="max reserved",
               extra={"published_tokens_per_gpu": tokens})


LLAMA3_405B = Dims(d=16384, q=16384, kv=1024, f=53248, vocab=128256, layers=126, heads=128)
LLAMA3_405B_PARAMS = 405_853_388_800


def llama3_cp16() -> Run:
    """The Llama 3 paper's long-context row (module docstring: what is assumed)."""
    return Run("Llama 3 405B CP 16 at 131,072 tokens on 16,384 H100", LLAMA3_PAPER, LLAMA3_405B, LLAMA3_405B_PARAMS,
               "H100-SXM", 16384, 131072, 1, accum=16, tp=8, pp=16, cp=16, stages_per_rank=8, sp=True,
               framework="megatron", checkpointing="full", nodes=2048, mfu=380e12 / 989e12)


def _megatron(name: str, h: int, a: int, layers: int, pp: int, batch: int, mfu: float) -> Run:
    params = 12 * layers * h * h * (1 + 13 / (12 * h) + (51200 + 2048) / (12 * layers * h))
    dims = Dims(d=h, q=h, kv=h, f=4 * h, vocab=51200, layers=layers, heads=a, gated=False, kind="gpt")
    return Run(f"Megatron GPT {name} on {8 * pp} A100", MEGATRON, dims, params, "A100-80GB", 8 * pp, 2048, 1,
               accum=batch, tp=8, pp=pp, sp=True, framework="megatron", attention="unfused",
               checkpointing="selective", selective="megatron", nodes=pp, mfu=mfu)


MPT_SHAPES = {"760m": (1536, 12, 24), "1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32),
              "13b": (5120, 40, 40), "30b": (7168, 64, 48), "70b": (8192, 64, 80)}
# (model, seq, gpus, micro-batch, accumulation, activation checkpointing, tokens/s/GPU, parameters) as published
MPT_ROWS = [
    ("70b", 2048, 64, 8, 4, True, 1039, 64862437376), ("70b", 2048, 32, 2, 16, True, 882, 64862437376),
    ("30b", 8192, 8, 1, 21, True, 1384, 30019254272), ("30b", 4096, 8, 1, 21, True, 1802, 29989894144),
    ("30b", 2048, 32, 14, 3, True, 2308, 29975214080), ("30b", 2048, 16, 10, 3, True, 2263, 29975214080),
    ("30b", 2048, 8, 3, 21, True, 2002, 29975214080), ("30b", 1024, 8, 6, 21, True, 2084, 29967874048),
    ("13b", 32768, 8, 1, 3, True, 1976, 13011240960), ("13b", 16384, 8, 3, 3, True, 2985, 12927354880),
    ("13b", 4096, 8, 10, 3, True, 4717, 12864440320), ("13b", 2048, 64, 2, 1, False, 4800, 12853954560),
    ("13b", 2048, 32, 2, 1, False, 4811, 12853954560), ("13b", 2048, 16, 2, 1, False, 4767, 12853954560),
    ("13b", 2048, 8, 2, 1, False, 4792, 12853954560), ("13b", 1024, 8, 40, 3, True, 5502, 12848711680),
    ("7b", 65536, 8, 1, 2, True, 1956, 6918905856), ("7b", 32768, 8, 2, 2, True, 3318, 6784688128),
    ("7b", 8192, 8, 8, 2, True, 6935, 6684024832), ("7b", 4096, 8, 16, 2, True, 8611, 6667247616),
    ("7b", 1024, 8, 64, 2, True, 10203, 6654664704),
    ("3b", 65536, 8, 1, 2, True, 3262, 2814366720), ("3b", 32768, 8, 3, 6, True, 5873, 2730480640),
    ("3b", 16384, 8, 1, 6, False, 11152, 2688537600), ("3b", 8192, 8, 3, 6, False, 16578, 2667566080),
    ("3b", 4096, 8, 5, 6, False, 20964, 2657080320), ("3b", 2048, 64, 6, 3, False, 22525, 2651837440),
    ("3b", 2048, 32, 6, 3, False, 23021, 2651837440), ("3b", 2048, 16, 10, 3, False, 24142, 2651837440),
    ("3b", 1024, 8, 20, 6, False, 27046, 2649216000), ("3b", 512, 8, 40, 6, False, 27965, 2647905280),
    ("1b", 65536, 8, 1, 2, True, 5506, 1445974016), ("1b", 32768, 8, 1, 4, False, 12025, 1378865152),
    ("1b", 16384, 8, 2, 4, False, 19649, 1345310720), ("1b", 8192, 8, 3, 4, False, 29157, 1328533504),
    ("1b", 4096, 8, 7, 4, False, 38535, 1320144896), ("1b", 2048, 64, 20, 1, False, 44402, 1315950592),
    ("1b", 2048, 32, 20, 1, False, 45130, 1315950592), ("1b", 2048, 16, 20, 1, False, 46037, 1315950592),
    ("1b", 2048, 8, 14, 1, False, 45455, 1315950592), ("1b", 1024, 8, 18, 4, False, 48910, 1313853440),
    ("1b", 512, 8, 56, 4, False, 52275, 1312804864),
    ("760m", 32768, 8, 1, 2, False, 16291, 807656448), ("760m", 16384, 8, 3, 2, False, 27815, 782490624),
    ("760m", 8192, 8, 6, 2, False, 41825, 769907712), ("760m", 4096, 8, 12, 2, False, 55459, 763616256),
    ("760m", 2048, 32, 24, 1, False, 67971, 760470528), ("760m", 2048, 16, 24, 1, False, 68551, 760470528),
    ("760m", 2048, 8, 24, 2, False, 63147, 760470528), ("760m", 1024, 8, 48, 2, False, 78581, 758897664),
    ("760m", 512, 8, 96, 2, False, 83749, 758111232),
]
MPT_REFERENCE = ("7b", 2048, 8, 6, 1, False, 10643, 6658859008)


def mpt(row: tuple) -> Run:
    model, seq, gpus, mb, accum, ac, tokens, params = row
    d, heads, layers = MPT_SHAPES[model]
    dims = Dims(d=d, q=d, kv=d, f=4 * d, vocab=50368, layers=layers, heads=heads, gated=False, kind="gpt")
    return Run(f"MPT-{model} seq {seq} on {gpus} H100{' (full AC)' if ac else ''}", MPT, dims, params, "H100-SXM",
               gpus, seq, mb, accum=accum, checkpointing="full" if ac else "none", nodes=max(1, gpus // 8),
               tokens_per_gpu=tokens)


def runs() -> list[Run]:
    """Every checked throughput/memory row (the reference run excluded)."""
    return [
        _torchtitan(8, False, 5762, 82.4, 1), _torchtitan(8, True, 6667, 77.0, 1),
        _torchtitan(128, False, 5605, 67.0, 3), _torchtitan(128, True, 6514, 62.0, 3),
        _megatron("22B", 6144, 64, 48, 1, 4, 0.415), _megatron("175B", 12288, 96, 96, 8, 64, 0.514),
        _megatron("530B", 20480, 128, 105, 35, 280, 0.560), _megatron("1T", 25600, 160, 128, 64, 512, 0.563),
        *[mpt(r) for r in MPT_ROWS],
        _torchtitan_cp(1, 3890, 83.9), _torchtitan_cp(2, 2540, 84.2), _torchtitan_cp(4, 1071, 84.0),
        _torchtitan_cp(8, 548, 84.5), llama3_cp16(),
    ]


def checked_throughput(run: Run) -> bool:
    """Whether a row's throughput is held against the prediction (torchtitan's table 2 is not: Float8)."""
    return run.tokens_per_gpu is not None or run.mfu is not None


def torchtitan_memory(run: Run) -> float:
    """Bytes per GPU of a torchtitan FSDP run: fp32 parameters, gradients and AdamW state sharded (16 bytes per
    parameter / dp), every layer's kept activations (plan/gpt.py), the loss's peak, the working set of the block in
    backward (its recomputed tensors and their gradients: one block's whole saved set with bf16 parameters, as
    plan/llama.py counts it), FSDP2's buffers (two gathered bf16 blocks, one fp32 block gradient) and the stated
    overhead. Under CP (FSDP over dp x cp: `run.dp`) all of it at the rank's seq/cp tokens, and the block in backward
    also holds K and V of the whole row (bf16, kv heads)."""
    d = run.dims
    blk = Block(h=d.d, a=d.heads, layers=d.layers, ffn=d.f, kv=d.kv, vocab=d.vocab)
    seq = run.seq // run.cp
    states = 16 * run.params / run.dp
    acts = d.layers * torchtitan_layer_bytes(s=seq, b=run.micro_batch, blk=blk, checkpointing=run.checkpointing)
    loss = torchtitan_loss_bytes(s=seq, b=run.micro_batch, blk=blk, compiled=run.compiled)
    cfg = LlamaConfig(vocab_size=d.vocab, dim=d.d, n_layers=1, n_heads=d.heads, n_kv_heads=d.heads * d.kv // d.q,
                      ffn_hidden=d.f, max_seq_len=seq)
    working = block_activation_bytes(cfg, batch=run.micro_batch, seq=seq, precision="bf16", param_dtype="bf16")
    if run.cp > 1:
        working += 2 * 2 * run.micro_batch * run.seq * d.kv
    block_params = 2 * d.d * (d.q + d.kv) + 3 * d.d * d.f
    buffers = 2 * 2 * block_params + 4 * block_params
    return states + acts + loss + working + buffers + overhead()
