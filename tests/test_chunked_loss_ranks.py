"""The chunked loss (`train.loss_chunk_tokens`, dptrain/models/chunked_loss.py) in whole runs on 2 forked gloo ranks,
against the same run over the whole logits (`train.loss_chunk_tokens=0`), plain SGD: every step's loss and the
final weights agree within float32 rounding. Under ddp with a transformers Llama (a user's factory), under fsdp
with a Llama saved locally, loaded sharded by `dptrain.models.hf:causal_lm` with LoRA (the head an FSDP2 unit of
its own, frozen) and two micro-steps, and under fsdp with the built-in LLaMA (the head in the root unit)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the optional extra: pip install -e '.[hf]')"
)
pytest.importorskip("peft", reason="peft is not installed (the optional extra: pip install -e '.[lora]')")

from safetensors.torch import load_file  # noqa: E402

from dptrain.models.lora import base_of  # noqa: E402
from support import hf, parity  # noqa: E402
from support.mp import run_ranks  # noqa: E402
from support.pretrained import save_hf_llama  # noqa: E402

STEPS = 3


def _fit(rank: int, items: list[str], out: str) -> bool:
    """One rank's run; whether its model trained on the chunked loss."""
    from dptrain.config.load import load_config
    from dptrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, items), out_dir=out)
    trainer.fit()
    plain = base_of(trainer.parallel.plain if hasattr(trainer.parallel, "plain") else trainer.model)
    head = getattr(plain, "lm_head", None)
    return bool(getattr(plain, "loss_chunk_tokens", None)) or isinstance(getattr(head, "forward", None),
                                                                         functools.partial)


def _run(items: list[str], out: Path) -> tuple[list[float], dict, bool]:
    chunked = run_ranks(_fit, 2, items, str(out), timeout=200)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = out / "final"
    weights = load_file(str(final / ("adapter_model.safetensors" if (final / "adapter_model.safetensors").exists()
                                     else "model.safetensors")))
    return [r["loss"] for r in records if "loss" in r], weights, all(chunked)


def _case(case: str, tmp_path: Path) -> list[str]:
    if case == "hf-ddp":
        return [*(i for i in hf.overrides("llama", "ddp") if not i.startswith("train.max_steps")),
                f"train.max_steps={STEPS}"]
    if case == "hf-lora-fsdp":
        folder = save_hf_llama(tmp_path / "base")
        base = [i for i in hf.overrides("llama", "fsdp") if not i.startswith(("model.", "train.max_steps",
                                                                              "train.micro", "train.grad_accum"))]
        return [*base, "model.factory=dptrain.models.hf:causal_lm", f"model.kwargs={{pretrained: {folder}}}",
                "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", f"train.max_steps={STEPS}",
                f"train.micro_batch_size={hf.GLOBAL_BATCH // 4}", "train.grad_accum_steps=2"]
    return [*parity.overrides(strategy="fsdp", world_size=2, accum=1, model="llama", steps=STEPS),
            "model.kwargs.vocab_size=256"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["hf-ddp", "hf-lora-fsdp", "llama-fsdp"])
def test_chunked_runs_match_the_whole_logits(case: str, tmp_path: Path, capsys) -> None:
    items = _case(case, tmp_path)
    want_loss, want, whole_chunked = _run([*items, "train.loss_chunk_tokens=0"], tmp_path / "whole")
    got_loss, got, chunked = _run([*items, "train.loss_chunk_tokens=8"], tmp_path / "chunked")
    assert chunked and not whole_chunked
    assert len(got_loss) == STEPS
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(got_loss, want_loss, strict=True))
    assert want.keys() == got.keys() and want
    worst = max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)
    with capsys.disabled():
        print(f"\nchunked vs whole logits | {case} | loss rel {worst_loss:.2e} | weights rel {worst:.2e}")
    assert worst_loss <= 1e-6 and worst <= 1e-6
