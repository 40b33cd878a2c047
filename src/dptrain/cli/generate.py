"""Sampling from a trained LM (bytes, or a prepared corpus's tokenizer); loading a model back from a run directory."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO, cast

import torch
from torch import nn

from dptrain.config import ConfigError
from dptrain.config.datasource import FINETUNE_FACTORY, PACKED_FACTORY
from dptrain.config.imports import import_object
from dptrain.config.load import load_yaml
from dptrain.data.packed import load_manifest
from dptrain.data.tokenizers import BYTES, LocalTokenizer, load_tokenizer

DEFAULT_MODEL_FACTORY = "dptrain.models.llama:build_llama"


def _max_seq_len(model: nn.Module) -> int | None:
    cfg = getattr(model, "cfg", None)
    return getattr(cfg, "max_seq_len", None) or getattr(model, "max_seq_len", None)


@torch.no_grad()
def sample_ids(
    model: nn.Module,
    ids: list[int],
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
    progress: TextIO | None = None,
    vocab_limit: int | None = None,
    unit: str = "tokens",
) -> list[int]:
    """Sample exactly ``max_new_tokens`` token ids continuing ``ids`` (not included in the result).

    ``model.logits(idx[1, T]) -> [1, T, V]`` is used; ``temperature <= 0`` means greedy and
    ``top_k`` of ``None``/``0`` disables top-k filtering; only ids below ``vocab_limit`` are sampled.
    The model sees at most its context (``max_seq_len``) of the latest ids: past it, the window
    slides, so any length can be sampled. With ``progress``, a line every 2 s says how far it is.
    """
    device = next(model.parameters()).device
    # A private generator keeps sampling reproducible without touching the global RNG.
    gen = torch.Generator(device=device).manual_seed(seed)
    ctx = _max_seq_len(model)
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    out: list[int] = []
    # nn.Module's stub types any attribute as Tensor | Module; `logits` is a method of LM models.
    logits_of = cast(Callable[[torch.Tensor], torch.Tensor], model.logits)
    was_training = model.training
    model.eval()
    last = start = time.monotonic()
    try:
        for i in range(max_new_tokens):
            if progress is not None and time.monotonic() - last >= 2.0:
                last = time.monotonic()
                rate = i / (last - start)
                progress.write(f"generate: {i}/{max_new_tokens} {unit} ({rate:.0f}/s, "
                               f"eta {(max_new_tokens - i) / max(rate, 1e-9):.0f} s)\n")
                progress.flush()
            cond = idx if ctx is None else idx[:, -ctx:]
            logits = logits_of(cond)[0, -1].float()
            if vocab_limit is not None:
                logits = logits[:vocab_limit]  # only the tokenizer's ids can be decoded
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
    return out


def generate_bytes(
    model: nn.Module,
    prompt: bytes | str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
    progress: TextIO | None = None,
) -> bytes:
    """Sample exactly ``max_new_tokens`` bytes continuing ``prompt`` (the prompt is not included):
    :func:`sample_ids` over byte ids. An empty prompt starts from ``b"\\n"``."""
    data = prompt.encode("utf-8") if isinstance(prompt, str) else bytes(prompt)
    out = sample_ids(model, list(data or b"\n"), max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                     seed=seed, progress=progress, vocab_limit=256, unit="bytes")
    return bytes(out)


def generate(
    model: nn.Module,
    prompt: bytes | str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
    progress: TextIO | None = None,
    tokenizer: LocalTokenizer | None = None,
) -> str:
    """Sample a continuation of ``prompt`` and decode it (only the generated text is returned).

    Without ``tokenizer`` (or with the bytes one) it samples bytes and decodes them as UTF-8
    (``errors="replace"``: invalid sequences become U+FFFD, so the string can be shorter than
    ``max_new_tokens``); with one, it samples that tokenizer's ids (an empty prompt starts from its
    end-of-document id) and decodes them with it.
    """
    if tokenizer is None or tokenizer.kind == BYTES:
        raw = generate_bytes(
            model, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
            progress=progress,
        )
        return raw.decode("utf-8", errors="replace")
    text = prompt.decode("utf-8", errors="replace") if isinstance(prompt, bytes) else prompt
    ids = tokenizer.encode_batch([text])[0] if text else [tokenizer.eos_id]
    out = sample_ids(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                     progress=progress, vocab_limit=tokenizer.vocab_size)
    return tokenizer.decode(out)


def run_tokenizer(run_dir: str | Path, *, spec: str | None = None) -> LocalTokenizer | None:
    """The tokenizer named by `spec`; without one, that of a run on a prepared corpus (``data.factory``
    ``build_packed``): the one its manifest names, checked against the manifest's identity; None (bytes) for
    any other run."""
    if spec:
        return load_tokenizer(spec)
    path = Path(run_dir) / "config.yaml"
    cfg = load_yaml(path.read_text()) if path.is_file() else {}
    data = (cfg or {}).get("data") or {}
    if data.get("factory") == FINETUNE_FACTORY:  # a fine-tuning run: the tokenizer its data.kwargs name
        spec = (data.get("kwargs") or {}).get("tokenizer", BYTES)
        return None if spec == BYTES else load_tokenizer(spec)
    if data.get("factory") != PACKED_FACTORY or not (data.get("kwargs") or {}).get("source"):
        return None
    manifest = load_manifest(data["kwargs"]["source"])
    recorded = manifest["tokenizer"]
    if recorded["kind"] == BYTES:
        return None
    try:
        tok = load_tokenizer(recorded["spec"])
    except ConfigError as e:
        raise ConfigError(
            f"the run's tokenizer {recorded['spec']!r} cannot be loaded ({e}); pass --tokenizer"
        ) from None
    if not tok.identity().same_tokens(recorded):
        raise ConfigError(f"the tokenizer at {recorded['spec']!r} changed since the run's data was prepared; pass the "
                          "one it was prepared with as --tokenizer")
    return tok


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
    cfg = load_yaml((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    model_cfg = (cfg or {}).get("model") or {}
    spec = model_cfg.get("factory") or DEFAULT_MODEL_FACTORY
    factory = import_object(spec)
    model = factory(**(model_cfg.get("kwargs") or {}))
    if not callable(getattr(model, "logits", None)):
        raise ConfigError(
            f"{str(run_dir)!r} is a run of model.factory={spec!r}, which is not a language model "
            f"(no logits(idx) method); generate needs a run of {DEFAULT_MODEL_FACTORY!r} or a model with logits()"
        )
    weights = run_dir / "final" / "model.safetensors"
    try:
        state = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a damaged file
        raise ConfigError(
            f"{str(weights)!r} cannot be read ({e}); the file is damaged or truncated. `dptrain ckpt export "
            f"{run_dir} --out {weights}` rewrites it from the run's newest valid checkpoint"
        ) from None
    # Checkpoints taken from a DDP- or compile-wrapped module carry a wrapper prefix.
    for prefix in ("module.", "_orig_mod."):
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    _fill_shared_keys(model, state)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        raise ConfigError(
            f"{str(run_dir / 'final' / 'model.safetensors')!r} does not fit the model {spec!r} built from "
            f"{str(run_dir / 'config.yaml')!r} ({first}); generate needs the final weights of that language model"
        ) from None
    return model.to(device).eval()
