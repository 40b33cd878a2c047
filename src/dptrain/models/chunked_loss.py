"""A causal LM's loss in chunks of tokens: the output projection and the cross-entropy fused, so the whole
``[tokens, vocab]`` logits (and their log-softmax and gradient) never exist at once (`train.loss_chunk_tokens`).

`linear_cross_entropy(hidden, weight, bias, targets)` is the sum of the token losses of
``cross_entropy(hidden @ weight.T + bias, targets, ignore_index=-100, reduction="sum")``, computed chunk by chunk of
tokens: each chunk's logits are turned in place into that chunk's gradient (softmax minus the one-hot target), then
into the gradients of the hidden states, the weight (accumulated in one buffer) and the bias. With a frozen weight
(LoRA) that happens in forward and backward only scales the result; with a trained weight forward keeps each
token's log-sum-exp and backward recomputes the chunk's logits, so the weight's gradient exists only during backward
(one matrix product more per chunk). Same arithmetic as the unchunked path, in another summation
order: loss and gradients agree within float32 rounding (tests/test_chunked_loss.py). The field's reference designs
are Liger-Kernel's fused linear cross-entropy and torchtune's chunked cross-entropy.

`apply_chunked_loss(model, chunk_tokens=)` switches a model's own loss to it, where it applies:

- a transformers causal LM (also inside PEFT's wrapper) whose ``forward`` is the common one (the code of
  ``LlamaForCausalLM.forward``: Llama, Mistral, Qwen2/3, Gemma, Phi-3, OLMo and others), with an ``nn.Linear``
  ``lm_head``: its ``forward`` (an instance attribute) calls the decoder for the hidden states and then ``lm_head``
  with the shifted labels, and ``lm_head``'s ``forward`` computes the loss. The weight is read inside ``lm_head``'s
  own call, so under FSDP2 (where ``lm_head`` is a unit of its own) its parameters are gathered for it and for
  backward as for any forward. The labels follow transformers' rule (``labels = input_ids``, shifted inside:
  ``pad(labels, (0, 1), -100)[..., 1:]``, or the ``shift_labels`` kwarg), the loss its normalisation: the sum over
  ``num_items_in_batch`` when given (dptrain's token rule), else the mean over the valid targets;
- the built-in LLaMA (`LlamaLM.loss_chunk_tokens`): labels already aligned with the predictions.

It is taken only while gradients are on and the labels are given (a training forward): evaluation and generation
keep the model's own path and its logits (the training forward returns ``logits=None``). Tensor-parallel heads
(DTensor weights) keep the model's own path too.
"""

from __future__ import annotations

import ast
import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.models.labels import labels_shifted_by
from dptrain.models.lora import base_of

__all__ = ["CHUNK_BYTES", "IGNORE_INDEX", "apply_chunked_loss", "auto_chunk_tokens", "chunked_loss_problem",
           "is_dtensor",
           "linear_cross_entropy"]

IGNORE_INDEX = -100
CHUNK_BYTES = 32 * 2**20
"""The auto chunk: as many tokens (a power of two) as keep one chunk's float32 logits within 32 MiB."""


def is_dtensor(tensor: Any) -> bool:
    """Whether `tensor` is a DTensor (a tensor-parallel or not-yet-gathered FSDP2 weight)."""
    from torch.distributed.tensor import DTensor  # lazy: the fast commands never import the distributed stack

    return isinstance(tensor, DTensor)


def auto_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk for `vocab_size` when `train.loss_chunk_tokens` is null: the largest power of two whose
    float32 logits fit `CHUNK_BYTES` (256 at a vocabulary of 32,000; 64 at 128,256), at least 1."""
    fit = max(1, CHUNK_BYTES // (4 * max(1, vocab_size)))
    return 1 << (fit.bit_length() - 1)


def _logits_grad(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """d(sum of token losses)/d logits of one chunk, times `scale`: softmax minus the one-hot target for valid
    targets, 0 for ignored ones; computed in place on the float32 `logits`."""
    valid = target != IGNORE_INDEX
    grad = logits.sub_(lse.unsqueeze(1)).exp_()
    grad[torch.arange(grad.size(0), device=grad.device), torch.where(valid, target, 0)] -= 1.0
    return grad.mul_(torch.where(valid, scale.float(), 0.0).unsqueeze(1))


def _chunks(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
            chunk: int, *, grad_h: bool, grad_b: bool) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
    """The forward pass over the chunks (no autograd): the float32 sum of the token losses, each token's log-sum-exp,
    and when asked the gradients of that sum with respect to `hidden` and `bias` (None otherwise)."""
    lse = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if grad_h else None
    db = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if grad_b and bias is not None else None
    one = torch.ones((), device=hidden.device)
    for start in range(0, hidden.size(0), chunk):
        raw = F.linear(hidden[start:start + chunk], weight, bias)
        logits, target = raw.float(), targets[start:start + chunk]
        valid = target != IGNORE_INDEX
        lse_c = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, torch.where(valid, target, 0).unsqueeze(1)).squeeze(1)
        total += torch.where(valid, lse_c - picked, 0.0).sum()
        lse[start:start + chunk] = lse_c
        if dh is not None or db is not None:
            grad_c = _logits_grad(logits, lse_c, target, one).to(raw.dtype)
            if dh is not None:
                dh[start:start + chunk] = (grad_c @ weight.to(grad_c.dtype)).to(hidden.dtype)
            if db is not None:
                db += grad_c.float().sum(0)
        del raw, logits
    return total, lse, dh, db


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum of token cross-entropies of ``hidden @ weight.T + bias`` against `targets`, chunk by chunk.

    A frozen weight (LoRA): the gradients of the hidden states and the bias are made in forward, chunk by chunk
    (two matrix products per chunk, as the unchunked path), and backward only scales them. A trained weight: forward
    keeps each token's log-sum-exp, backward recomputes each chunk's logits (one product more) and accumulates the
    weight's gradient in one buffer, which then exists only during this backward, not from forward on."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk: int) -> torch.Tensor:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        early = not need_w and (need_h or need_b)  # the gradients in forward: nothing to recompute
        total, lse, grad_h, grad_b = _chunks(hidden, weight, bias, targets, chunk, grad_h=early and need_h,
                                             grad_b=early and need_b)
        device_type = hidden.device.type
        ctx.autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))
        ctx.chunk, ctx.early, ctx.bias_dtype = chunk, early, None if bias is None else bias.dtype
        if early:
            ctx.save_for_backward(grad_h, grad_b)
        else:
            ctx.save_for_backward(hidden, weight, bias, targets, lse)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.early:
            grad_h, grad_b = ctx.saved_tensors
            bias_grad = None if grad_b is None else (grad_b * grad_out).to(ctx.bias_dtype)
            return (None if grad_h is None else grad_h * grad_out.to(grad_h.dtype), None, bias_grad, None, None)
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        device_type, dtype, enabled = ctx.autocast
        for start in range(0, hidden.size(0), ctx.chunk):
            h = hidden[start:start + ctx.chunk]
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):  # the forward's matmul precision
                raw = F.linear(h, weight, bias)
            grad_c = _logits_grad(raw.float(), lse[start:start + ctx.chunk], targets[start:start + ctx.chunk],
                                  grad_out).to(raw.dtype)
            del raw
            if grad_h is not None:
                grad_h[start:start + ctx.chunk] = (grad_c @ weight.to(grad_c.dtype)).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(grad_c.t().float(), h.float())
            if grad_b is not None:
                grad_b += grad_c.float().sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, *, chunk_tokens: int) -> torch.Tensor:
    """Float32 sum of ``cross_entropy(F.linear(hidden, weight, bias).float(), targets, ignore_index=-100,
    reduction="sum")`` over chunks of `chunk_tokens` tokens, never holding more than one chunk's logits.
    `hidden`: ``[..., H]``; `targets`: the same leading shape, aligned with the predictions."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be at least 1")
    flat = hidden.reshape(-1, hidden.size(-1))
    return _LinearCrossEntropy.apply(flat, weight, bias, targets.reshape(-1).to(flat.device), chunk_tokens)


def _head_forward(head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor | None = None, *,
                  chunk_tokens: int) -> torch.Tensor:
    """`lm_head`'s forward: the logits (as `nn.Linear`), or with `targets` the sum of the token losses (chunked).

    (A frozen head's loss could leave autograd here, its hidden-state gradient attached after the head, so that
    backward never passes through the head's FSDP2 unit: measured on a 1B LoRA run, that kept a gathered head alive
    through the next forward (FSDP2's backward prefetch of a unit whose backward never runs): 0.26 GB more.)"""
    if targets is None:
        unshard_in_backward = getattr(head, "set_unshard_in_backward", None)
        if unshard_in_backward is not None:
            unshard_in_backward(True)  # the logits' backward reads the weight
        return F.linear(hidden, head.weight, head.bias)
    if is_dtensor(head.weight):  # a tensor-parallel head: the whole logits, as the model's own path
        logits = F.linear(hidden, head.weight, head.bias).float()
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1).to(logits.device),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    total = linear_cross_entropy(hidden, head.weight, head.bias, targets, chunk_tokens=chunk_tokens)
    unshard_in_backward = getattr(head, "set_unshard_in_backward", None)  # the head is an FSDP2 unit
    if unshard_in_backward is not None:
        # a frozen head's hidden-state gradient was made in forward: this backward reads no weight, so FSDP2 need
        # not gather the head again (the whole vocabulary x hidden matrix). Set per call: a plain call (logits,
        # or a trained head) needs it gathered.
        unshard_in_backward(head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad))
    return total


def _causal_lm_forward(model: Any, *args: Any, labels: torch.Tensor | None = None,
                       num_items_in_batch: torch.Tensor | int | None = None, chunk_tokens: int, **kwargs: Any) -> Any:
    """A transformers causal LM's forward with the chunked loss: a training forward (gradients on, labels given,
    keyword arguments only) of more than one chunk of tokens calls the decoder, then `lm_head` with the shifted
    labels; anything else, and a trained head within one chunk, is the class's own forward (its own loss).
    """
    keep = kwargs.get("logits_to_keep", 0)
    # a trained head within one chunk keeps the model's own loss, bit for bit; a frozen head (LoRA) is always
    # chunked: its hidden-state gradient is made in forward, so backward never gathers its weight again
    small = labels is not None and labels.numel() <= chunk_tokens and model.lm_head.weight.requires_grad
    plain = (args or labels is None or not torch.is_grad_enabled() or kwargs.get("return_dict") is False
             or not isinstance(keep, int) or keep != 0 or small)
    if plain:
        extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
        return type(model).forward(model, *args, labels=labels, **extra, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast  # lazy: the optional hf extra

    kwargs.pop("logits_to_keep", None)
    shifted = kwargs.pop("shift_labels", None)
    outputs = model.model(**kwargs)
    if shifted is None:  # transformers' rule: tokens < n predict n, the last position has no target
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # type: ignore[arg-type]
    total = model.lm_head(outputs.last_hidden_state, targets=shifted)
    if num_items_in_batch is None:
        loss = total / (shifted != IGNORE_INDEX).sum().to(total.device)
    else:
        n = num_items_in_batch.to(total.device) if isinstance(num_items_in_batch, torch.Tensor) else num_items_in_batch
        loss = total / n
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(outputs, "hidden_states", None),
                                  attentions=getattr(outputs, "attentions", None))


def _function_body(fn: Any) -> str | None:
    """The code of `fn`'s body without its docstring, normalised by `ast.unparse`; None without source."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    tree = ast.parse("if 1:\n" + source if source[:1].isspace() else source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return "\n".join(ast.unparse(s) for s in body)


def _common_forward(cls: Any) -> bool:
    """Whether `cls.forward` is transformers' common causal-LM forward (the code of LlamaForCausalLM's)."""
    import transformers  # lazy: the optional hf extra (only called for a transformers model)

    body = _function_body(cls.forward)
    return body is not None and body == _function_body(transformers.LlamaForCausalLM.forward)


def chunked_loss_problem(model: nn.Module) -> str | None:
    """Why `model`'s loss cannot be chunked (a sentence), or None when `apply_chunked_loss` applies to it."""
    base: Any = base_of(model)
    if hasattr(type(base), "loss_chunk_tokens"):  # the built-in LLaMA
        return None
    if labels_shifted_by(base) is not True:
        return f"{type(base).__name__} is neither the built-in LLaMA nor a transformers causal LM"
    if not _common_forward(type(base)):
        return (f"{type(base).__name__}'s forward is not transformers' common causal-LM forward (the code of "
                "LlamaForCausalLM.forward), so its loss is its own")
    head = getattr(base, "lm_head", None)
    if type(head) is not nn.Linear:
        return f"{type(base).__name__}.lm_head is a {type(head).__name__}, not an nn.Linear (e.g. a LoRA layer)"
    return None


def apply_chunked_loss(model: nn.Module, *, chunk_tokens: int | None) -> str | None:
    """Make `model`'s training loss the chunked one (see the module docstring), `chunk_tokens` tokens per chunk
    (None: `auto_chunk_tokens` of the vocabulary). Call it on the plain model, before any parallel wrapper.
    Returns None when applied, else the reason it does not apply (the model keeps its own loss)."""
    problem = chunked_loss_problem(model)
    if problem is not None:
        return problem
    base: Any = base_of(model)
    if hasattr(type(base), "loss_chunk_tokens"):
        base.loss_chunk_tokens = chunk_tokens or auto_chunk_tokens(base.head.out_features)
        return None
    head = base.lm_head
    chunk = chunk_tokens or auto_chunk_tokens(head.out_features)
    # instance attributes: nn.Module.__call__ (and FSDP2's hooks around it, PEFT's call of `model.forward`) find them
    head.forward = functools.partial(_head_forward, head, chunk_tokens=chunk)
    # under activation checkpointing the head is no block to recompute: it keeps no logits for backward, and a
    # recompute would run every chunk's forward again
    head.skip_activation_checkpointing = True
    base.forward = functools.partial(_causal_lm_forward, base, chunk_tokens=chunk)
    return None
