"""Transformer memory under other frameworks' conventions: Megatron's GPT (Korthikanti et al. 2022), torchtitan's
LLaMA, and DeepSpeed's model-state estimators (`dptrain plan --params N --convention deepspeed`).

dptrain runs its own LLaMA (plan/llama.py counts exactly what that saves). The published runs the planner is checked
against (plan/published.py) ran other code; what each saves is counted here from that code's own rules:

- Megatron-LM GPT block (LayerNorm, GeLU 4h MLP, learned positions, fp16/bf16 activations, 1-byte dropout masks),
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4: per layer
  s*b*h*(34 + 5*a*s/h) bytes without parallelism; with tensor parallelism t, s*b*h*(10 + 24/t + 5*a*s/(h*t));
  with sequence parallelism too, s*b*h/t*(34 + 5*a*s/h); selective recompute (the attention core) drops the 5*a*s/h
  term: s*b*h*34/t with sequence parallelism; full recompute keeps the layer input, 2*s*b*h (/t with sequence
  parallelism, as the paper's table 2). With 1F1B the first stage holds p micro-batches of L/p layers: L layers'
  worth (sec. 4.2.3), interleaving x (1 + (p-1)/(p*m)) is not used by these runs.
- torchtitan's LLaMA (Llama 3.1, bf16 parameters gathered by FSDP2): per layer the block input and, under its op-level
  selective checkpointing (torchtitan/distributed/activation_checkpoint.py: mm and attention outputs are saved,
  "except every second mm"), the outputs of wq, wv, w1 and w2 (the 1st, 3rd, 5th, 7th mm of the block) and of
  attention with its logsumexp; the loss upcasts the [B*T, V] logits to fp32 and its backward holds three such
  tensors at once (the saved log-softmax, its gradient and the gradient of the logits): 12*B*T*V bytes (8 when
  torch.compile fuses the upcast away).
- Model states. Megatron with its fp32 master weights and fp32 gradient buffer: 2 + 4 + 12 = 18 bytes per
  parameter, all of it per model-parallel rank (no data-parallel sharding in the runs here). torchtitan (FSDP2, fp32
  parameters, gradients and AdamW state, all sharded): 16 bytes per parameter / data-parallel degree.
- DeepSpeed's estimators (deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs,
  stage3.estimate_zero3_model_states_mem_needs): stage 2 on the GPU 4*P + 16*P/N (offload: 2*P); stage 3
  4*L + 18*P/N, L the largest layer's parameters (offload of optimizer and parameters: 4*L; of the optimizer only:
  4*L + 2*P/N).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Block:
    """A transformer's shape: width h, heads a, layers, FFN width, kv width (GQA), vocabulary."""

    h: int
    a: int
    layers: int
    ffn: int
    kv: int
    vocab: int


def megatron_layer_bytes(*, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                         recompute: str = "none") -> float:
    """Korthikanti et al.'s activation bytes of one GPT layer on one tensor-parallel rank (module docstring)."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    attn = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


def megatron_first_stage_bytes(*, s: int, b: int, blk: Block, t: int, p: int, m: int, sp: bool,
                               recompute: str) -> float:
    """Activation bytes of the first pipeline stage under 1F1B: min(p, m) micro-batches in flight over L/p layers."""
    return blk.layers / p * min(p, m) * megatron_layer_bytes(s=s, b=b, h=blk.h, a=blk.a, t=t, sp=sp,
                                                             recompute=recompute)


def torchtitan_layer_bytes(*, s: int, b: int, blk: Block, checkpointing: str) -> float:
    """Bytes one torchtitan LLaMA layer keeps from forward to backward (bf16 parameters; module docstring)."""
    bt = b * s
    if checkpointing == "full":
        return 2 * bt * blk.h
    if checkpointing != "selective":
        raise ValueError(f"torchtitan's layer is counted under selective or full checkpointing, not {checkpointing!r}")
    return 2 * bt * (blk.h + blk.h + blk.kv + blk.ffn + blk.h + blk.h) + 4 * b * blk.a * s  # x, wq, wv, w1, w2, sdpa


def torchtitan_loss_bytes(*, s: int, b: int, blk: Block, compiled: bool) -> float:
    """The loss's peak at the start of backward: three fp32 [B*T, V] tensors (two under torch.compile)."""
    return (8 if compiled else 12) * b * s * blk.vocab


def deepspeed_zero2_gpu_bytes(params: float, gpus: int, *, offload: bool = False) -> float:
    """`estimate_zero2_model_states_mem_needs`' GPU bytes (module docstring)."""
    return 2 * params if offload else 2 * params + int(18 * params / gpus)


def deepspeed_zero3_gpu_bytes(params: float, largest_layer: float, gpus: int, *, offload: str = "none") -> float:
    """`estimate_zero3_model_states_mem_needs`' GPU bytes: offload none, optimizer, or optimizer+params."""
    largest = 4 * largest_layer
    if offload == "optimizer+params":
        return largest
    if offload == "optimizer":
        return largest + int(2 * params / gpus)
    return largest + int(18 * params / gpus)


def megatron_stage_params(blk: Block, *, seq: int, t: int, p: int, stage: int) -> float:
    """Parameters one tensor-parallel rank of pipeline stage `stage` holds in Megatron's GPT: its L/p layers
    (12h^2 + 13h each, the matrices split over t), the word embedding (V*h / t) and learned positions (s*h) on the
    first stage, the final LayerNorm on the last, and, with p > 1, a copy of the tied word embedding on the last
    stage as the output layer (Megatron keeps the two copies equal by all-reducing their gradients between the
    first and last stage: the model's parameters count it once, the GPUs hold it twice)."""
    h = blk.h
    n = blk.layers / p * (12 * h * h / t + 13 * h)
    if stage == 0:
        n += blk.vocab * h / t + seq * h
    if stage == p - 1:
        n += 2 * h + (blk.vocab * h / t if p > 1 else 0)
    return n
