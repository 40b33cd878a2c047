"""What a `Checkpointer` resume does, said and kept, in one process (no process group at world size one):

- `resume="auto"` with nothing saved says so in one line; `resume="none"` over committed checkpoints is refused
  before anything is touched (every file's SHA-256 unchanged), `resume="overwrite"` moves them aside;
- the caller's own state (`extra=`: JSON values and tensors) comes back with a bitwise resume, is hashed in
  the manifest, loaded without unpickling code, and listed by `dptrain ckpt ls`;
- `rng=` saves the RNG as it was when the step's batch was drawn (a nanoGPT-style loop that draws its next batch
  before saving resumes bitwise with it, shifted by one batch without it).

References: the same loop run without interruption; hashes of the directory taken before the refusal."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import dptrain
from dptrain.config import ConfigError

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]


def _trio(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(1, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = dptrain.prepare_dataloader(TensorDataset(torch.arange(24)), global_batch_size=4, micro_batch_size=4)
    return model, opt, loader


def _train(model, opt, loader, n: int) -> None:
    for _, _, (x,) in dptrain.micro_steps(loader, max_steps=loader.step + n):
        model(x.float()[:, None]).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _checkpointer(out: Path, *, seed: int = 0, **kw) -> dptrain.Checkpointer:
    model, opt, loader = _trio(seed)
    return dptrain.Checkpointer(out, model, opt, loader=loader, **kw)


def _tree_sha256(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_auto_with_nothing_saved_says_it_starts_at_step_zero(tmp_path, capsys):
    model, opt, loader = _trio()
    assert dptrain.Checkpointer(tmp_path, model, opt, loader=loader).resume() == 0
    err = capsys.readouterr().err
    assert err.count(f"dptrain: no checkpoint in {tmp_path / 'checkpoints'}: starting at step 0") == 1, err


def test_none_over_checkpoints_is_refused_with_every_file_unchanged_and_overwrite_moves_them_aside(tmp_path, capsys):
    model, opt, loader = _trio()
    ckpt = dptrain.Checkpointer(tmp_path, model, opt, loader=loader)
    _train(model, opt, loader, 2)
    ckpt.save(2)
    _train(model, opt, loader, 2)
    ckpt.save(4)
    before = _tree_sha256(tmp_path)
    assert "checkpoints/step_000004/model.pt" in before and len(before) >= 10

    with pytest.raises(ConfigError) as e:
        _checkpointer(tmp_path, seed=1, resume="none")
    msg = str(e.value)
    assert "Checkpointer(resume='none')" in msg and "step_000004" in msg and "resume='overwrite'" in msg
    assert _tree_sha256(tmp_path) == before  # nothing touched, not even a folder made

    capsys.readouterr()
    model2, opt2, loader2 = _trio(seed=1)
    ckpt2 = dptrain.Checkpointer(tmp_path, model2, opt2, loader=loader2, resume="overwrite")
    assert "moved to" in capsys.readouterr().err
    assert ckpt2.resume() == 0 and not (tmp_path / "checkpoints" / "step_000004").exists()
    moved = tmp_path / "previous" / "1" / "checkpoints"
    assert _tree_sha256(moved) == {k.removeprefix("checkpoints/"): v for k, v in before.items()}  # kept whole
    _train(model2, opt2, loader2, 1)
    ckpt2.save(1)
    assert _checkpointer(tmp_path, seed=2).resume() == 1  # the new run's, not the old step 4
    with pytest.raises(ConfigError, match="'auto', 'none', 'overwrite' or a step folder"):
        _checkpointer(tmp_path, resume=None)


def test_extra_state_comes_back_with_a_bitwise_resume_hashed_listed_and_unpickled_by_weights_only(tmp_path, capsys):
    from dptrain.checkpoint import manifest as mf
    from dptrain.cli.main import main as cli

    model, opt, loader = _trio()
    ckpt = dptrain.Checkpointer(tmp_path, model, opt, loader=loader)
    _train(model, opt, loader, 3)
    best = model.weight.detach().clone()
    extra = {"best_val_loss": float("inf"), "iter_num": 3, "model_args": {"n_layer": 2, "bias": True, "name": "gpt"},
             "best_weight": best, "history": [1.5, None, torch.tensor([2, 3])]}
    ckpt.save(3, extra=extra)
    _train(model, opt, loader, 4)
    ckpt.save(7)  # no extra given: the last one is kept
    _train(model, opt, loader, 2)

    model2, opt2, loader2 = _trio(seed=1)
    ckpt2 = dptrain.Checkpointer(tmp_path, model2, opt2, loader=loader2, resume=str(tmp_path / "checkpoints" /
                                                                                     "step_000003"))
    assert ckpt2.resume() == 3
    got = ckpt2.extra
    assert got["best_val_loss"] == float("inf") and got["iter_num"] == 3
    assert got["model_args"] == {"n_layer": 2, "bias": True, "name": "gpt"}
    assert torch.equal(got["best_weight"], best) and got["history"][:2] == [1.5, None]
    assert torch.equal(got["history"][2], torch.tensor([2, 3]))
    _train(model2, opt2, loader2, 6)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))

    step7 = tmp_path / "checkpoints" / "step_000007"
    assert "extra.pt" in mf.read_manifest(step7)["files"]  # hashed like the other files
    assert torch.load(step7 / "extra.pt", weights_only=True).keys() == {"0", "1"}
    assert dptrain.Checkpointer(tmp_path, *_trio()[:2]).resume() == 7  # no loader: the extra still comes back
    capsys.readouterr()
    assert cli(["ckpt", "ls", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert listing.count("extra: best_val_loss=inf, best_weight=tensor, history=[1.5, None, tensor], iter_num=3, "
                         "model_args={bias: True, n_layer: 2, name: 'gpt'}") == 2, listing
    (step7 / "extra.pt").write_bytes(b"not a tensor file")
    assert cli(["ckpt", "verify", str(step7)]) == 1

    with pytest.raises(ConfigError, match=r"extra\['model'\] is a Linear: .*JSON values"):
        ckpt.save(9, extra={"model": torch.nn.Linear(1, 1)})
    with pytest.raises(ConfigError, match="keys are strings"):
        ckpt.save(9, extra={"a": {1: 2}})


def _nanogpt_style(out: Path, *, steps: int, save_at: int | None = None, capture: bool = True) -> list[str]:
    """nanoGPT's shape: the first batch drawn before the loop, the next one drawn (from the global RNG) right
    after the step, before the save point. Returns the per-step losses as float.hex."""
    data = torch.linspace(-1, 1, 64 * 3).reshape(64, 3)

    def get_batch() -> torch.Tensor:
        return data[torch.randint(len(data), (4,))]

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = dptrain.Checkpointer(out, model, opt)
    start = ckpt.resume()
    losses = []
    rng = dptrain.rng_state()
    x = get_batch()
    for it in range(start, steps):
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
        rng = dptrain.rng_state()  # as it is when the next step's batch is drawn
        x = get_batch()
        if it + 1 == save_at:
            ckpt.save(it + 1, rng=rng if capture else None)
            break
    return losses


def test_rng_taken_when_the_batch_was_drawn_resumes_a_prefetching_loop_bitwise(tmp_path):
    reference = _nanogpt_style(tmp_path / "ref", steps=8)
    for capture in (True, False):
        out = tmp_path / f"capture_{capture}"
        first = _nanogpt_style(out, steps=8, save_at=5, capture=capture)
        rest = _nanogpt_style(out, steps=8)
        assert first == reference[:5] and len(rest) == 3
        if capture:
            assert rest == reference[5:]  # bitwise: the resumed run draws the batch the saved one had drawn
        else:
            assert rest != reference[5:]  # the current RNG is one batch further: a shifted run
    with pytest.raises(ConfigError, match=r"rng=\.\.\.\): pass what dptrain.rng_state\(\) returned"):
        dptrain.Checkpointer(tmp_path / "x", *_trio()[:2]).save(1, rng=torch.get_rng_state())  # type: ignore[arg-type]
