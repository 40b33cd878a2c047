"""FSDP2 on the host (parallel/fsdp.py `free_gather_buffers_early`): the all-gather is one broadcast per rank
straight into FSDP2's flat buffer (`HostAllGather`: gloo's own all-gather copies the unit once more), or for a
one-parameter unit into the parameter's own storage; the buffer is freed at its copy-out; and backward gathers no
weight it does not read: a frozen input embedding, and a frozen transformers head whose loss is chunked (its
hidden-state gradient made in forward). The values are the same as torch's all-gather; the memory it saves is
measured by benchmarks/memory/finetune_memory.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.mp import in_group, run_ranks

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the optional extra: pip install -e '.[hf]')"
)
pytest.importorskip("peft", reason="peft is not installed (the optional extra: pip install -e '.[lora]')")

from support import hf  # noqa: E402
from support.pretrained import save_hf_llama  # noqa: E402


def _gather(rank: int, async_op: bool) -> bool:
    import torch.distributed as dist

    from dptrain.parallel.fsdp import HostAllGather

    def body() -> bool:
        group = dist.group.WORLD
        shard = torch.arange(5, dtype=torch.float32) + 10 * rank
        out = torch.full((10,), -1.0)
        out.view(2, -1)[rank].copy_(shard)  # FSDP2 copies the shard into its slice first (all_gather_copy_in)
        work = HostAllGather()(output_tensor=out, input_tensor=out.view(2, -1)[rank], group=group, async_op=async_op)
        if work is not None:
            work.wait()
        want = torch.empty(10)
        dist.all_gather_into_tensor(want, shard)
        return torch.equal(out, want)

    return in_group(body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("async_op", [False, True])
def test_the_host_all_gather_gives_torchs_all_gather(async_op: bool) -> None:
    assert run_ranks(_gather, 2, async_op, timeout=50) == [True, True]


def _backward_gathers(rank: int, items: list[str], out: str) -> dict[str, list[int]]:
    """Sizes of the units gathered in forward and in backward of one training step, and the two embeddings' sizes."""
    import tempfile

    from dptrain.config.load import load_config
    from dptrain.distributed.process_group import process_group
    from dptrain.models.lora import base_of
    from dptrain.parallel import fsdp
    from dptrain.train.trainer import Trainer

    seen: dict[str, list[int]] = {"forward": [], "backward": [], "into_own": []}
    real = fsdp.HostAllGather.__call__
    step = [0]

    def record(self, output_tensor, input_tensor, **kw):  # FSDP2 calls its comm by keyword
        in_backward = torch._C._current_graph_task_id() != -1  # the autograd engine is running
        if step[0] == 0:
            seen["backward" if in_backward else "forward"].append(output_tensor.numel())
        own = getattr(self.into, "all_gather_outputs", None)
        if own and output_tensor.untyped_storage().data_ptr() == own[0].untyped_storage().data_ptr():
            seen["into_own"].append(output_tensor.numel())  # gathered straight into the parameter's storage
        return real(self, output_tensor=output_tensor, input_tensor=input_tensor, **kw)

    trainer = Trainer(load_config(None, items), out_dir=tempfile.mkdtemp(dir=out))
    with process_group(trainer.env, backend=trainer.res.backend, device=trainer.device, timeout_s=60):
        trainer.setup()
        fsdp.HostAllGather.__call__ = record  # type: ignore[method-assign]
        try:
            trainer.train_step()
            step[0] = 1
            trainer.train_step()  # FSDP2 made each unsharded storage at the first copy-out
        finally:
            fsdp.HostAllGather.__call__ = real  # type: ignore[method-assign]
        model = base_of(trainer.parallel.plain)
        seen["embedding"] = [model.get_input_embeddings().weight.numel()]
        seen["head"] = [model.get_output_embeddings().weight.numel()]
        trainer.close()
        trainer.model = trainer.parallel.release()
        trainer.mesh.release()
    return seen


def _items(folder: Path, *, lora: bool) -> list[str]:
    base = [i for i in hf.overrides("llama", "fsdp") if not i.startswith(("model.", "train.max_steps"))]
    items = [*base, "model.factory=dptrain.models.hf:causal_lm", f"model.kwargs={{pretrained: {folder}}}",
             "train.max_steps=1", "checkpoint.every_steps=0"]
    return [*items, "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8"] if lora else items


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lora", [True, False])
def test_backward_gathers_no_frozen_embedding_and_no_frozen_head(lora: bool, tmp_path: Path) -> None:
    folder = save_hf_llama(tmp_path / "base", vocab_size=96)  # the embeddings: the largest units, of their own size
    seen = run_ranks(_backward_gathers, 2, _items(folder, lora=lora), str(tmp_path), timeout=100)[0]
    vocab = seen["embedding"][0]  # the input and the output embedding: one size, vocabulary x hidden
    assert seen["head"][0] == vocab
    assert seen["forward"].count(vocab) == 2, seen  # each gathered once in forward
    # the embedding's backward reads no weight, so it is never gathered again; a frozen head (chunked loss) made its
    # hidden-state gradient in forward, so neither is it; a trained head's backward reads its weight (the test can
    # tell: one vocabulary-sized gather in backward)
    assert seen["backward"].count(vocab) == (0 if lora else 1), seen
    assert seen["backward"], seen  # the decoder layers are gathered again
    # the one-parameter units (the two embeddings, the final norm) gather into the parameter's own storage from their
    # second gather; a decoder layer (several parameters, the largest other unit) into FSDP2's flat buffer
    layer = max(n for n in seen["forward"] if n != vocab)
    assert seen["into_own"].count(vocab) >= 2 and layer not in seen["into_own"], seen
