"""Tensor parallelism: the matrices of each block split over the `tp` ranks with PyTorch's DTensor
plans (`torch.distributed.tensor.parallel.parallelize_module`); no collective is written here.

The plan for the built-in `LlamaLM` (`models/llama_parallel.py`: `llama_tp_plan`) is torchtitan's (Megatron-LM's
column-then-row pairing):

| module                    | style                                                     |
|---------------------------|-----------------------------------------------------------|
| `tok_emb`                 | RowwiseParallel (vocab rows split; output Shard(1) under SP, else Replicate) |
| `layers.i.attn_norm`, `mlp_norm`, `norm` | SequenceParallel (norm on a slice of the sequence; only with sequence_parallel) |
| `layers.i.attn`, `mlp`    | PrepareModuleInput -> Replicate (under SP from Shard(1): the all-gather of the sequence) |
| `attn.wq`, `wk`, `wv`     | ColwiseParallel (heads split: each rank attends with n_heads/tp heads) |
| `attn.wo`                 | RowwiseParallel (output Shard(1) under SP: a reduce-scatter; else an all-reduce) |
| `mlp.w1`, `mlp.w3`        | ColwiseParallel (the SwiGLU hidden width split)          |
| `mlp.w2`                  | RowwiseParallel (as `wo`)                                 |
| `head`                    | ColwiseParallel (vocab split; output Replicate, or Shard(-1) for loss parallelism) |

Without sequence parallelism every block does two all-reduces of b·s·h forward (after `wo`
and `w2`) and two backward (before `wq/wk/wv` and `w1/w3`); with it each all-reduce becomes a
reduce-scatter plus an all-gather of the same total volume, and norms and the residual stream
hold only s/tp of the sequence.

Loss parallelism (`loss_parallel`): the head's logits stay sharded over the vocabulary and the
cross-entropy is computed by DTensor without gathering them (`loss_parallel()`, entered by
`ParallelModel.sync_gradients` around forward and backward, and by `loss_context` for
evaluation); see `loss_context`.

A Hugging Face model with its own `config.base_model_tp_plan` (LlamaForCausalLM: q/k/v and
gate/up column-wise, o and down row-wise) is split by that plan, translated into PyTorch's styles
(`apply_hf_tp`; embeddings and LM head replicated; sequence and loss parallelism do not apply).
A PEFT model (LoRA: `model.lora` or a factory's `get_peft_model`) is split by its base model's plan (the built-in
LLaMA's or the Hugging Face one), each entry that names a linear peft wrapped rewritten for the LoRA layer: its base
linear as planned, lora_B column-wise under a column-wise base, lora_A row-wise under a row-wise one, the other
adapter replicated (`models/lora_parallel.py`: `lora_tp_plan`). Every plan runs under `keep_frozen`:
SequenceParallel re-registers a norm's weight as a trainable parameter, which would train a frozen base's norms.
Users' own models name a function `parallel.tp_plan=pkg.mod:fn`; `fn(model, tp_mesh)` applies its
own plan (typically one `parallelize_module` call). A model with neither a plan nor a built-in
one is refused before launch (`tp_problem`). Tied embeddings (`tie_embeddings=true`) are refused:
the embedding is split by rows for its lookup and the head by rows of the same matrix for its
matmul, so the placements agree (Shard(0)), but `parallelize_module` replaces each module's
parameter by its own new DTensor, which silently unties them; re-tying would hand one parameter
two different gradient paths whose hooks (FSDP2's, DDP's) see it twice.
"""  # noqa: E501 (a Markdown table: one row a line)

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from dptrain.config.imports import import_object
from dptrain.models import lora
from dptrain.models.llama_parallel import apply_llama_tp, is_builtin_llama
from dptrain.models.lora_parallel import keep_frozen, lora_tp_plan

TpPlan = Callable[[nn.Module, Any], None]


HF_STYLES = ("colwise", "rowwise")
"""The entries of a Hugging Face `config.base_model_tp_plan` dptrain translates into PyTorch's
ColwiseParallel / RowwiseParallel; a plan with any other entry is refused (its model needs tp_plan)."""


def hf_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """A Hugging Face model's own tensor-parallel plan for its base model (`config.base_model_tp_plan`,
    e.g. LlamaForCausalLM's: q/k/v and gate/up column-wise, o and down row-wise), or None."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    return dict(plan) if isinstance(plan, dict) and plan and hasattr(model, "base_model_prefix") else None


def _hf_problem(model: nn.Module, plan: dict[str, str], *, tp: int) -> str | None:
    name = type(model).__name__
    odd = sorted({v for v in plan.values() if v not in HF_STYLES})
    if odd:
        return (
            f"parallel.tp={tp}: {name}'s own tensor-parallel plan uses {', '.join(odd)}, which dptrain does not "
            f"translate (only {', '.join(HF_STYLES)}); name a plan with parallel.tp_plan=pkg.mod:fn"
        )
    config: Any = model.config
    for what in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(config, what, None)
        if isinstance(n, int) and n % tp:
            return (
                f"{name}: config.{what}={n} is not divisible by parallel.tp={tp}: tensor parallelism splits it "
                f"evenly over the tp ranks; choose a tp that divides {n}"
            )
    return None


def apply_hf_tp(model: nn.Module, tp_mesh: Any) -> None:
    """A Hugging Face model split by its own `base_model_tp_plan` (wildcards `layers.*.` expanded),
    translated into PyTorch's ColwiseParallel/RowwiseParallel; embeddings and the LM head stay
    replicated (plain tensors), so the logits and the loss are those of the unsplit model."""
    import fnmatch

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = lora.base_of(model)  # a PEFT model: the model peft wraps, its LoRA layers in place of the linears
    plan = hf_tp_plan(model)
    assert plan is not None
    base = model.get_submodule(str(model.base_model_prefix))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    names = [n for n, _ in base.named_modules() if n]
    expanded = {n: styles[style]() for pattern, style in plan.items() for n in names if fnmatch.fnmatchcase(n, pattern)}
    if not expanded:
        raise ValueError(f"{type(model).__name__}'s tensor-parallel plan matches none of its modules: {plan}")
    parallelize_module(base, tp_mesh, lora_tp_plan(base, expanded))


def load_plan(spec: str) -> TpPlan:
    """The user's `parallel.tp_plan` function from its import path."""

    fn = import_object(spec)
    if not callable(fn):
        raise TypeError(f"parallel.tp_plan={spec!r} is not callable; it must be a function fn(model, tp_mesh)")
    return fn


def tp_problem(
    model: nn.Module, *, tp: int, tp_plan: str | None, sequence_parallel: bool, seq_len: int | None = None
) -> str | None:
    """Why `model` (built on meta) cannot be split over `tp` ranks, in one line naming the numbers;
    None when it can (or tp is 1). `seq_len`: the length of the model's input sequence, when known."""
    if tp <= 1:
        return None
    if tp_plan is not None:
        return None  # the user's plan decides what it splits
    model = lora.base_of(model)  # a PEFT model (LoRA): the plans below are its base model's (models/lora_parallel.py)
    if (hf := hf_tp_plan(model)) is not None:
        return _hf_problem(model, hf, tp=tp)
    if not is_builtin_llama(model):
        return (
            f"parallel.tp={tp}: {type(model).__name__} has no tensor-parallel plan; dptrain has one for its "
            "built-in LLaMA (dptrain.models.llama:build_llama) only. Name yours with parallel.tp_plan=pkg.mod:fn "
            "(fn(model, tp_mesh) applies it, e.g. with torch.distributed.tensor.parallel.parallelize_module)"
        )
    cfg: Any = model.cfg  # LlamaConfig
    if cfg.tie_embeddings:
        return (
            f"parallel.tp={tp} with model.kwargs.tie_embeddings=true is refused: parallelize_module gives the "
            "embedding and the head each its own sharded parameter, which unties them; train with "
            "tie_embeddings=false, or tp=1"
        )
    for what, n in (
        ("n_heads", cfg.n_heads),
        ("n_kv_heads", cfg.n_kv_heads),
        ("ffn_hidden", cfg.ffn_hidden),
        ("vocab_size", cfg.vocab_size),
    ):
        if n % tp:
            return (
                f"model.kwargs.{what}={n} is not divisible by parallel.tp={tp}: tensor parallelism splits it "
                f"evenly over the tp ranks; choose a tp that divides {n} or a {what} divisible by {tp}"
            )
    if sequence_parallel and seq_len is not None and seq_len % tp:
        return (
            f"the model's input sequence length {seq_len} is not divisible by parallel.tp={tp}: sequence "
            "parallelism splits the sequence evenly over the tp ranks; choose a sequence length divisible by "
            f"{tp} (the built-in corpus: data.kwargs.seq_len) or parallel.sequence_parallel=false"
        )
    return None


def apply_tp(
    model: nn.Module,
    tp_mesh: Any,
    *,
    tp_plan: str | None = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
) -> None:
    """Split `model` in place over `tp_mesh`: the user's plan `tp_plan` (import path of
    fn(model, tp_mesh)) when given, else a Hugging Face model's own plan, else the built-in LLaMA plan (for a PEFT
    model: its base model's plan, rewritten for the LoRA layers). Works on the meta device:
    the parameters become meta DTensors that `materialize` fills later."""
    tp = tp_mesh.size()
    if (why := tp_problem(model, tp=tp, tp_plan=tp_plan, sequence_parallel=sequence_parallel)) is not None:
        raise ValueError(why)
    with keep_frozen(model):  # SequenceParallel (a user's plan may use it) would make frozen norms trainable again
        if tp_plan is not None:
            load_plan(tp_plan)(model, tp_mesh)
        elif hf_tp_plan(lora.base_of(model)) is not None:
            apply_hf_tp(model, tp_mesh)
        else:
            apply_llama_tp(lora.base_of(model), tp_mesh, sequence_parallel=sequence_parallel,
                           loss_parallel=loss_parallel)


@contextlib.contextmanager
def loss_context(enabled: bool) -> Iterator[None]:
    """`loss_parallel()` when the logits are vocabulary-sharded DTensors, else nothing. It must cover
    the cross-entropy and its backward."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield
