"""A small LLaMA-style byte-level causal language model.

Plain ``nn.Module`` with no parallelism awareness; the layout (``tok_emb``, ``layers``,
``norm``, ``head``; ``attn.wq/wk/wv/wo`` and ``mlp.w1/w2/w3`` as separate ``nn.Linear``)
is what the FSDP and tensor-parallel strategies rely on, so keep the names stable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.config.fields import LLAMA_RECIPE_KWARGS
from dptrain.models.chunked_loss import is_dtensor, linear_cross_entropy
from dptrain.models.llama_hf import hf_key, llama_kwargs
from dptrain.models.pretrained import meta_parameters, read_config, read_index, source_for


@dataclass
class LlamaConfig:
    """Hyper-parameters of :class:`LlamaLM` (see :func:`build_llama` for defaults)."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    max_seq_len: int = 256
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden is None:
            # LLaMA rule: 2/3 of 4*dim keeps SwiGLU's 3 matrices at the cost of a 4*dim GELU MLP.
            self.ffn_hidden = 32 * math.ceil(int(2 * 4 * self.dim / 3) / 32)
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("head dim must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return float32 ``(cos, sin)`` tables of shape ``[seq_len, head_dim // 2]``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[B, H, T, hd]`` (half-split pairing) by position-dependent angles."""
    # Rotate in float32: bf16 angles lose too much precision at long positions.
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)  # back to the autocast/compute dtype so SDPA sees matching q/k/v dtypes


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool attention mask of packed rows: causal, and only within a document. A document
    starts at the row's start and wherever a position does not follow the one before it."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    seg = starts.cumsum(dim=1)
    T = position_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return ((seg[:, :, None] == seg[:, None, :]) & causal).unsqueeze(1)


class DocumentMask(nn.Module):
    """The attention mask of packed rows, passed to every block's attention core: from `position_ids`
    (`document_mask`), or from `document_ids` ``[B, T]`` (each token's document, numbered over the row: attention
    within equal ids, causal) when the caller gives them. A module of its own (no parameters) so that a parallelism
    can replace it with its core: context parallelism (dptrain.parallel.context) swaps in one that gathers the
    document ids of the whole row, which one rank's positions alone cannot tell."""

    def forward(self, position_ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        if document_ids is None:
            return document_mask(position_ids)
        T = document_ids.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
        return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal).unsqueeze(1)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()  # as PyTorch's layers do: meta init replays it

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class CoreAttention(nn.Module):
    """Scaled dot-product attention of rotated ``q`` ``[B, H, T, hd]`` and ``k``/``v`` ``[B, H_kv, T, hd]``: a module
    of its own (no parameters) so that a parallelism can replace it; context parallelism
    (dptrain.parallel.context) swaps in one that all-gathers K/V over the ranks holding the rest of the sequence."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if k.size(1) != q.size(1):  # GQA: share each KV head across a group of query heads
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    """Causal multi-head attention with rotary embeddings and optional grouped KV heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        assert cfg.n_kv_heads is not None  # set by LlamaConfig.__post_init__
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.core: nn.Module = CoreAttention()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`cos`/`sin`: ``[T', hd/2]`` tables (T' >= T) or per-row ``[B, 1, T, hd/2]`` (position ids); `mask`:
        ``[B, 1, T, T]`` bool, True where a query may attend (None: plain causal)."""
        B, T, _ = x.shape
        if cos.dim() == 2:
            cos, sin = cos[:T], sin[:T]  # tables may be longer (a pipeline stage passes max_seq_len's)
        # Head counts come from the tensors (-1), not the config, so a tensor-parallel
        # column split of wq/wk/wv (fewer local heads) works without touching this code.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then SwiGLU MLP (the FSDP sharding unit)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        assert cfg.ffn_hidden is not None  # set by LlamaConfig.__post_init__
        self.mlp = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.attn_norm(x)
        # The mask only as a keyword when there is one: the tensor-parallel plan's PrepareModuleInput on `attn`
        # lays out exactly its three positional inputs.
        x = x + (self.attn(h, cos, sin) if mask is None else self.attn(h, cos, sin, mask=mask))
        return x + self.mlp(self.mlp_norm(x))


class LlamaLM(nn.Module):
    """Byte-level LLaMA-style causal LM whose ``forward(batch)`` returns the CE loss (see ``forward``)."""

    shifts_labels = False
    """Its ``labels`` are aligned with the predictions: the data shifts them (``dptrain.models.labels``)."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of a training forward's loss (``dptrain.models.chunked_loss``, set by the Trainer from
    ``train.loss_chunk_tokens``): the head and the cross-entropy fused, no whole logits; None: the whole logits."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.doc_mask: nn.Module = DocumentMask()
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        # Non-persistent: derived from the config, so they stay out of checkpoints.
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise all weights and the rope tables: ``init_submodule`` for every module in
        ``named_modules()`` order (the constructor's last step)."""
        for name, mod in self.named_modules():
            self.init_submodule(name, mod)

    @torch.no_grad()
    def init_submodule(self, name: str, mod: nn.Module) -> None:
        """Initialise ``mod``'s own parameters and buffers (not its children's); ``name`` is its
        path in this model. Meta-device init (``dptrain.parallel.materialize``) replays this
        module by module, so it must touch nothing else."""
        if mod is self:
            self._refresh_rope(self.rope_cos.device)
        elif isinstance(mod, nn.Linear | nn.Embedding):
            # Output projections feed the residual stream once per block; scaling keeps
            # the stream's variance independent of depth (GPT-2 / LLaMA practice).
            out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
            std = out_std if name.endswith(("attn.wo", "mlp.w2")) else 0.02
            nn.init.normal_(mod.weight, mean=0.0, std=std)
        elif isinstance(mod, RMSNorm):
            mod.reset_parameters()

    def _refresh_rope(self, device: torch.device) -> None:
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device)
        self.rope_cos, self.rope_sin = cos, sin

    def _rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={self.cfg.max_seq_len}")
        # Rebuild lazily if the tables are on the wrong device, were left on meta by a
        # deferred init, or were cast by model.to(dtype) (they must stay float32).
        c = self.rope_cos
        if c.device != device or c.is_meta or c.dtype != torch.float32:
            self._refresh_rope(device)
        return self.rope_cos[:seq_len], self.rope_sin[:seq_len]

    def logits(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None,
               document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits ``[B, T, V]`` for token ids ``idx`` of shape ``[B, T]`` (see :meth:`hidden_states`).

        Under FSDP2 call ``register_fsdp_forward_method(model, "logits")`` first so the
        parameters get all-gathered (only ``__call__``/``forward`` trigger the hooks).
        """
        return self.head(self.hidden_states(idx, position_ids, document_ids))

    def hidden_states(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output ``[B, T, dim]`` for token ids ``idx`` of shape ``[B, T]``: the head's input.

        ``position_ids`` ``[B, T]`` (packed rows): each token's position in its document; a document starts
        where the position does not follow the one before (``0`` after a document's end), and attention
        stays inside each document (a block-diagonal causal mask), so every document of a packed row gets
        the logits it would get alone. ``document_ids`` ``[B, T]`` (with ``position_ids``, which then only
        rotate): each token's document, numbered over the whole row; attention stays within equal ids (context
        parallelism passes them: a rank holds chunks of the row, see :class:`DocumentMask`).

        Under FSDP2 call ``register_fsdp_forward_method(model, "logits")`` first so the
        parameters get all-gathered (only ``__call__``/``forward`` trigger the hooks).
        """
        x = self.tok_emb(idx)
        mask = None
        if position_ids is None:
            cos, sin = self._rope(idx.size(1), x.device)
        else:
            cos, sin = self._rope(self.cfg.max_seq_len, x.device)  # positions index the whole table (no host sync)
            cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)  # [B, 1, T, hd/2]
            mask = self.doc_mask(position_ids, document_ids)
        for layer in self.layers:
            x = layer(x, cos, sin) if mask is None else layer(x, cos, sin, mask=mask)
        return self.norm(x)

    def forward(
        self, batch: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | None = None, *,
        input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None, position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Cross-entropy loss of a batch: the mean over its valid targets, or, given
        ``num_items_in_batch`` (dptrain's token rule, Hugging Face's loss kwarg), their sum divided
        by it.

        The batch is a LongTensor ``[B, T+1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``), an
        ``(input_ids, labels)`` pair, a mapping with those keys, or keyword arguments ``input_ids=`` and ``labels=`` (a
        mapping batch under the default loss, ``model(**batch)``). ``labels`` are aligned with the
        predictions: ``labels[:, t]`` is the target after ``input_ids[:, :t+1]``; ``-100`` is
        ignored (padding, prompts), so every label that is not ``-100`` is scored. ``position_ids`` (also a
        mapping's key) and ``document_ids`` (likewise): packed rows, see :meth:`logits`.
        """
        if batch is None:
            if input_ids is None or labels is None:
                raise TypeError("LlamaLM.forward needs a batch, or both input_ids= and labels=")
            idx, targets = input_ids, labels
        elif isinstance(batch, Mapping):  # model(batch) with a mapping batch, as in one's own loop
            idx, targets = batch["input_ids"], batch["labels"]
            position_ids = batch.get("position_ids", position_ids)
            document_ids = batch.get("document_ids", document_ids)
        elif isinstance(batch, Sequence):
            idx, targets = batch
        else:
            idx, targets = batch[:, :-1], batch[:, 1:]
        chunk = self.loss_chunk_tokens
        # more than one chunk of tokens (a batch within one chunk: the plain path below, bit for bit)
        if chunk and targets.numel() > chunk and torch.is_grad_enabled() and not is_dtensor(self.head.weight):
            hidden = self.hidden_states(idx, position_ids, document_ids)
            total = linear_cross_entropy(hidden, self.head.weight, self.head.bias, targets,
                                         chunk_tokens=chunk)  # float32, never whole logits
            return total / (num_items_in_batch if num_items_in_batch is not None else (targets != -100).sum())
        logits = self.logits(idx, position_ids, document_ids)
        # float32 CE even under bf16 autocast: log-softmax over the vocab is precision-sensitive.
        flat_logits, flat_targets = logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1)
        if num_items_in_batch is None:
            return F.cross_entropy(flat_logits, flat_targets, ignore_index=-100)
        return F.cross_entropy(flat_logits, flat_targets, ignore_index=-100, reduction="sum") / num_items_in_batch

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Number of (unique) parameters; optionally without the input embedding table.

        With tied embeddings the shared matrix is always counted, since the output
        projection is a real matmul. Works on FSDP2 DTensors (``numel`` is global).
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding and not self.cfg.tie_embeddings:
            n -= self.tok_emb.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) at context length ``seq_len``.

        ``6*N + 12*L*d*T`` (PaLM appendix B convention): ``6N`` for the matmuls of the ``N``
        non-embedding parameters (2 FLOPs per multiply-add, x3 for forward + backward), plus
        ``12*L*d*T`` for the attention score and value matmuls (``QK^T`` and ``AV``), counted
        without discounting the causal mask. Used as the numerator of MFU.
        """
        n = self.num_params(exclude_embedding=True)
        return 6 * n + 12 * self.cfg.n_layers * self.cfg.dim * seq_len


def build_llama(
    *,
    vocab_size: int | None = None,
    dim: int | None = None,
    n_layers: int | None = None,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    ffn_hidden: int | None = None,
    max_seq_len: int | None = None,
    tie_embeddings: bool | None = None,
    rope_theta: float | None = None,
    norm_eps: float | None = None,
    pretrained: str | None = None,
) -> LlamaLM:
    """Build a :class:`LlamaLM` (deterministic given ``torch.manual_seed``). A kwarg left at None takes
    :class:`LlamaConfig`'s default (vocab 256, dim 128, 4 layers, 4 heads, context 256, rope theta 1e4).

    ``pretrained``: a local Hugging Face Llama folder (config.json + model.safetensors). The dimensions come
    from its config.json (a kwarg given as well must agree; ``max_seq_len`` may be shorter) and the model is
    built with its parameters on the meta device, to be loaded from the folder, each rank its own shards,
    once parallelised (see ``dptrain.models.pretrained``)."""
    given: dict[str, Any] = {
        "vocab_size": vocab_size, "dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads,
        "ffn_hidden": ffn_hidden, "max_seq_len": max_seq_len, "tie_embeddings": tie_embeddings,
        "rope_theta": rope_theta, "norm_eps": norm_eps,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if pretrained is None:
        return LlamaLM(LlamaConfig(**given))
    return _build_pretrained(pretrained, given)


def llama_config(kwargs: Mapping[str, object]) -> LlamaConfig:
    """The :class:`LlamaConfig` ``build_llama(**kwargs)`` builds (reads a ``pretrained`` folder's config.json)."""
    given = {k: v for k, v in kwargs.items() if v is not None and k != "pretrained"}
    if kwargs.get("pretrained") is None:
        return LlamaConfig(**given)  # type: ignore[arg-type]
    folder = str(kwargs["pretrained"])
    # the built-in recipe's dimensions (model.kwargs' defaults) are not the user's: the folder's config.json sets them
    given = {k: v for k, v in given.items() if k not in LLAMA_RECIPE_KWARGS or LLAMA_RECIPE_KWARGS[k] != v}
    return LlamaConfig(**llama_kwargs(read_config(folder), folder=folder, given=given))


def _build_pretrained(folder: str, given: dict[str, Any]) -> LlamaLM:
    """A LlamaLM shaped by a HF Llama folder, parameters on meta, with the folder attached as its source."""
    index = read_index(folder)  # the folder's checks first: a missing folder is named as such
    cfg = llama_config({**given, "pretrained": folder})
    with meta_parameters():
        model = LlamaLM(cfg)
    # the built-in keeps float32 weights: bf16/fp16 files are converted exactly on load
    source_for(model, folder, index, key_of=hf_key, cast=True)
    return model
