"""Byte-level sampling from a trained LM and loading a model back from a run directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import yaml
from torch import nn

from dptrain.build import import_object

DEFAULT_MODEL_FACTORY = "dptrain.models.llama:build_llama"


def _max_seq_len(model: nn.Module) -> int | None:
    cfg = getattr(model, "cfg", None)
    return getattr(cfg, "max_seq_len", None) or getattr(model, "max_seq_len", None)


@torch.no_grad()
def generate_bytes(
    model: nn.Module,
    prompt: bytes | str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
) -> bytes:
    """Sample exactly ``max_new_tokens`` bytes continuing ``prompt`` (the prompt is not included).

    ``model.logits(idx[1, T]) -> [1, T, V]`` is used; ``temperature <= 0`` means greedy and
    ``top_k`` of ``None``/``0`` disables top-k filtering. An empty prompt starts from ``b"\\n"``.
    """
    data = prompt.encode("utf-8") if isinstance(prompt, str) else bytes(prompt)
    data = data or b"\n"
    device = next(model.parameters()).device
    # A private generator keeps sampling reproducible without touching the global RNG.
    gen = torch.Generator(device=device).manual_seed(seed)
    ctx = _max_seq_len(model)
    idx = torch.tensor([list(data)], dtype=torch.long, device=device)
    out: list[int] = []
    # nn.Module's stub types any attribute as Tensor | Module; `logits` is a method of LM models.
    logits_of = cast(Callable[[torch.Tensor], torch.Tensor], model.logits)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            cond = idx if ctx is None else idx[:, -ctx:]
            logits = logits_of(cond)[0, -1].float()
            logits = logits[:256]  # only byte ids can be decoded
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
            out.append(nxt)
            idx = torch.cat([idx, idx.new_tensor([[nxt]])], dim=1)
    finally:
        model.train(was_training)
    return bytes(out)


def generate(
    model: nn.Module,
    prompt: bytes | str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
) -> str:
    """Sample a continuation of ``prompt`` and decode it as UTF-8 (``errors="replace"``).

    Returns only the generated text. Invalid byte sequences become U+FFFD and valid
    multi-byte sequences merge, so the string can be shorter than ``max_new_tokens``.
    """
    raw = generate_bytes(
        model, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
    )
    return raw.decode("utf-8", errors="replace")


def _fill_shared_keys(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    # safetensors refuses to store aliased tensors, so savers often drop one name of a
    # tied pair (e.g. head.weight == tok_emb.weight); restore it from its alias.
    groups: dict[tuple, list[str]] = {}
    for name, t in model.state_dict().items():
        if t.numel():  # empty tensors may all report data_ptr 0
            groups.setdefault((t.data_ptr(), tuple(t.shape)), []).append(name)
    for names in groups.values():
        present = [n for n in names if n in state]
        if present and len(names) > 1:
            for n in names:
                state.setdefault(n, state[present[0]])


def load_model_from_run(run_dir: str | Path, *, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the model of a finished run from ``config.yaml`` and ``final/model.safetensors``.

    ``config.yaml`` must hold ``model: {factory: "pkg.mod:fn", kwargs: {...}}``; the factory
    defaults to :data:`DEFAULT_MODEL_FACTORY`. Weights are loaded with ``strict=True``.
    """
    from safetensors.torch import load_file

    run_dir = Path(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    model_cfg = cfg.get("model") or {}
    factory = import_object(model_cfg.get("factory") or DEFAULT_MODEL_FACTORY)
    model = factory(**(model_cfg.get("kwargs") or {}))
    state = load_file(str(run_dir / "final" / "model.safetensors"))
    # Checkpoints taken from a DDP- or compile-wrapped module carry a wrapper prefix.
    for prefix in ("module.", "_orig_mod."):
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    _fill_shared_keys(model, state)
    model.load_state_dict(state, strict=True)
    return model.to(device).eval()
