"""`dptrain run` hosting a user's own code: an optimizer and LR scheduler by import path (any strategy, per-step
and per-epoch, exact resume), `train.eval_fn` metrics over an uneven evaluation set (the same at 1 and 2 ranks),
collate keyword arguments, `--defaults torch`, and the refusals before launch. References: torch's own
optimizer and scheduler classes in a plain single-process loop (support/hosting.py), and a plain forward over
the whole validation set for the accuracy."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dptrain.cli.main import config_reference, main
from dptrain.config import DataConfig
from dptrain.config.load import load_command_line
from dptrain.train.build import build_collate
from support.checkpoints import losses, weights_sha
from support.cli import refused
from support.hosting import base, build_classifier, classes, reference_accuracy, reference_f1, torch_reference
from support.parity import assert_weights_close, train
from support.run_helpers import TOY_RUN

ADADELTA = ["optim.factory=torch.optim.Adadelta", "optim.kwargs.rho=0.8", "optim.lr=0.5"]
STEP_LR = ["optim.scheduler_factory=torch.optim.lr_scheduler.StepLR", "optim.scheduler_kwargs.step_size=2",
           "optim.scheduler_kwargs.gamma=0.5"]
EPOCH_LR = ["optim.scheduler_factory=torch.optim.lr_scheduler.StepLR", "optim.scheduler_kwargs.step_size=1",
            "optim.scheduler_kwargs.gamma=0.5", "optim.scheduler_interval=epoch"]  # 4 steps an epoch


def _reference(steps: int, *, per_epoch: bool):
    sched = {"step_size": 1, "gamma": 0.5} if per_epoch else {"step_size": 2, "gamma": 0.5}
    return torch_reference(steps=steps, opt_cls=torch.optim.Adadelta, opt_kwargs={"lr": 0.5, "rho": 0.8},
                           sched_cls=torch.optim.lr_scheduler.StepLR, sched_kwargs=sched, per_epoch=per_epoch)


# ---------------------------------------------------------------- optimizer and scheduler by import path
@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize("per_epoch", [False, True], ids=["per-step", "per-epoch"])
def test_adadelta_and_steplr_match_torch_in_one_process(tmp_path: Path, per_epoch: bool) -> None:
    items = [*base(steps=6, strategy="single", world=1), *ADADELTA, *(EPOCH_LR if per_epoch else STEP_LR)]
    got, records = train(items, 1, tmp_path)
    want, lrs = _reference(6, per_epoch=per_epoch)
    assert_weights_close(got, want)
    assert [r["lr"] for r in records if "loss" in r] == pytest.approx(lrs, rel=1e-12)
    assert len(set(lrs)) > 1  # the schedule did change the rate


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "strategy,per_epoch,factory",
    [("ddp", False, "torch.optim.Adadelta"), ("zero1", True, "support.hosting:make_adadelta"),
     ("zero2", False, "torch.optim.Adadelta"), ("fsdp", True, "torch.optim.Adadelta")],
)
def test_adadelta_and_steplr_match_torch_under_each_strategy(
    tmp_path: Path, strategy: str, per_epoch: bool, factory: str
) -> None:
    """zero1 with a factory function: ZeroRedundancyOptimizer calls it with each rank's share."""
    items = [*base(steps=6, strategy=strategy), *ADADELTA, f"optim.factory={factory}",
             *(EPOCH_LR if per_epoch else STEP_LR)]
    got, records = train(items, 2, tmp_path, timeout=60)
    want, lrs = _reference(6, per_epoch=per_epoch)
    assert_weights_close(got, want)
    assert [r["lr"] for r in records if "loss" in r] == pytest.approx(lrs, rel=1e-12)


@pytest.mark.fast
@pytest.mark.timeout(90)
@pytest.mark.parametrize("per_epoch", [False, True], ids=["per-step", "per-epoch"])
def test_resume_with_a_torch_scheduler_is_bit_identical(tmp_path: Path, per_epoch: bool) -> None:
    sched = EPOCH_LR if per_epoch else STEP_LR
    straight = tmp_path / "straight"
    train([*base(steps=6, strategy="single", world=1), *ADADELTA, *sched], 1, straight)
    resumed = tmp_path / "resumed"
    train([*base(steps=3, strategy="single", world=1), *ADADELTA, *sched], 1, resumed)  # saves step 3
    _, records = train([*base(steps=6, strategy="single", world=1), *ADADELTA, *sched], 1, resumed)
    assert weights_sha(resumed) == weights_sha(straight)
    assert losses(resumed) == losses(straight)
    lrs = [r["lr"] for r in records if "loss" in r]
    assert lrs == [json.loads(x)["lr"] for x in (straight / "metrics.jsonl").read_text().splitlines()
                   if '"loss"' in x]


# ---------------------------------------------------------------- eval_fn
def _eval_items(strategy: str, world: int, n_val: int) -> list[str]:
    return [
        "model.factory=support.hosting:build_classifier", "model.kwargs={}",
        "data.factory=support.hosting:classes", "data.kwargs.n=64", f"data.kwargs.n_val={n_val}",
        "data.num_workers=0", "data.pin_memory=false", "train.loss=support.hosting:ce_loss",
        "train.eval_fn=support.hosting:accuracy", "train.eval_summary=support.hosting:f1", "train.eval_samples=-1",
        "train.max_steps=3",
        "train.eval_every_steps=0", "train.log_every_steps=1", "train.global_batch_size=8",
        f"train.micro_batch_size={8 // world}", f"parallel.strategy={strategy}", "parallel.device=cpu",
        "parallel.timeout_s=60", "optim.name=sgd", "optim.lr=0.5", "log.progress=false", "train.seed=1234",
    ]


ACC_TOL = 1e-6
"""The batch means eval_fn returns are float32: 1e-6 is far below one sample's weight (1/13), so a sample
counted twice or dropped fails."""


def _evals(records: list[dict]) -> list[dict]:
    return [r for r in records if "val_loss" in r]


@pytest.mark.timeout(90)
def test_eval_fn_accuracy_is_the_same_on_one_and_two_ranks_with_an_uneven_eval_set(tmp_path: Path, capfd) -> None:
    """13 validation samples: 6 and 7 on two ranks, in micro-batches of 4 (of 8 on one rank)."""
    _, val = classes(n=64, n_val=13)
    one_w, one = train([*_eval_items("single", 1, 13), "log.progress=true"], 1, tmp_path / "one")
    two_w, two = train(_eval_items("ddp", 2, 13), 2, tmp_path / "two", timeout=60)
    torch.manual_seed(1234)
    init = {k: v.detach().clone() for k, v in build_classifier().state_dict().items()}
    for records, final in ((one, one_w), (two, two_w)):
        start, end = _evals(records)
        assert start["eval_accuracy"] == pytest.approx(reference_accuracy(init, val), abs=ACC_TOL)
        assert end["eval_accuracy"] == pytest.approx(reference_accuracy(final, val), abs=ACC_TOL)
        assert end["eval_f1"] == pytest.approx(reference_f1(final, val), abs=ACC_TOL)  # from the exact tp/fp/fn
        assert start["eval_ce"] == pytest.approx(start["val_loss"], rel=1e-9)  # sample-weighted like the loss
    assert _evals(one)[0]["eval_accuracy"] == pytest.approx(_evals(two)[0]["eval_accuracy"], abs=ACC_TOL)
    assert _evals(one)[1]["eval_accuracy"] == pytest.approx(_evals(two)[1]["eval_accuracy"], abs=ACC_TOL)
    assert _evals(one)[1]["eval_f1"] == pytest.approx(_evals(two)[1]["eval_f1"], abs=ACC_TOL)
    assert _evals(one)[0]["val_loss"] == pytest.approx(_evals(two)[0]["val_loss"], rel=1e-6)  # float32 batch means
    assert f"eval_accuracy {reference_accuracy(init, val):.4f}" in capfd.readouterr().out  # the console's line


@pytest.mark.timeout(90)
def test_eval_fn_under_fsdp_when_one_rank_has_fewer_batches(tmp_path: Path) -> None:
    """9 validation samples: 4 (one batch) and 5 (two batches) on two ranks; rank 0 runs a weight-0 forward so
    FSDP2's all-gathers stay matched, and no sample is counted twice."""
    _, val = classes(n=64, n_val=9)
    final, records = train(_eval_items("fsdp", 2, 9), 2, tmp_path, timeout=60)
    assert _evals(records)[-1]["eval_accuracy"] == pytest.approx(reference_accuracy(final, val), abs=ACC_TOL)


# ---------------------------------------------------------------- collate
@pytest.mark.fast
def test_collate_kwargs_are_bound_and_a_module_level_closure_imports() -> None:
    samples = [(torch.ones(2), torch.zeros(1)), (torch.ones(2), torch.zeros(1))]
    fn = build_collate(DataConfig(collate="support.hosting:scaled_collate", collate_kwargs={"scale": 3.0}))
    assert fn is not None
    x, _ = fn(samples)
    assert torch.equal(x, torch.full((2, 2), 3.0))
    closure = build_collate(DataConfig(collate="support.hosting:offset_collate"))
    assert closure is not None and torch.equal(closure(samples)[0], torch.ones(2, 2))


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_a_run_with_collate_kwargs_trains_on_the_collated_batches(tmp_path: Path) -> None:
    """scale=2 doubles every input: the run matches the torch loop on doubled inputs only if the kwargs reach it."""
    plain, _ = train([*base(steps=2, strategy="single", world=1), "optim.name=sgd", "optim.lr=0.1"], 1,
                     tmp_path / "plain")
    items = [*base(steps=2, strategy="single", world=1), "optim.name=sgd", "optim.lr=0.1",
             "data.collate=support.hosting:scaled_collate", "data.collate_kwargs.scale=2.0"]
    scaled, _ = train(items, 1, tmp_path / "scaled")
    assert any(not torch.equal(plain[k], scaled[k]) for k in plain)
    items[-1] = "data.collate_kwargs.scale=1.0"
    same, _ = train(items, 1, tmp_path / "same")
    assert all(torch.equal(plain[k], same[k]) for k in plain)


# ---------------------------------------------------------------- --defaults torch
@pytest.mark.fast
def test_defaults_torch_sets_pytorch_semantics_under_the_file_and_overrides(tmp_path: Path) -> None:
    cfg = load_command_line([], defaults=["optim.weight_decay=0.0", "optim.warmup_steps=0"])
    assert cfg.optim.weight_decay == 0.0 and cfg.optim.warmup_steps == 0
    main_cfg = _show(["--defaults", "torch"])
    for line in ("weight_decay: 0.0", "warmup_steps: 0", "schedule: constant", "grad_clip: null", "- 0.999"):
        assert line in main_cfg, line
    assert "# --defaults torch set" in main_cfg
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  weight_decay: 0.1\n")
    shown = _show([str(recipe), "optim.warmup_steps=5", "--defaults", "torch"])
    assert "weight_decay: 0.1" in shown and "warmup_steps: 5" in shown and "schedule: constant" in shown
    assert "`--defaults torch`" in config_reference() and "| `optim.betas` |" in config_reference()


def _show(argv: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["config", "show", *argv]) == 0
    return buf.getvalue()


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_defaults_torch_plain_sgd_matches_torch(tmp_path: Path) -> None:
    """One switch: the default recipe's warm-up, cosine, clipping and weight decay are gone."""
    items = [*base(steps=4, strategy="single", world=1), "optim.name=sgd", "optim.lr=0.1"]
    items = [i for i in items if not i.startswith(("optim.weight_decay", "optim.grad_clip"))]
    out = tmp_path / "run"
    assert main(["run", *items, "--defaults", "torch", "--nproc-per-node", "1", "--out", str(out)]) == 0
    got = load_file(str(out / "final" / "model.safetensors"))
    want, _ = torch_reference(steps=4, opt_cls=torch.optim.SGD, opt_kwargs={"lr": 0.1},
                              sched_cls=torch.optim.lr_scheduler.ConstantLR, sched_kwargs={"factor": 1.0},
                              per_epoch=False)
    assert_weights_close(got, want)


# ---------------------------------------------------------------- refusals before launch
@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "bad,named",
    [
        (["optim.factory=torch.optim.NoSuchOpt"], ["NoSuchOpt"]),
        (["optim.factory=torch.optim.Adadelta", "optim.kwargs.bogus=1"], ["optim.factory", "bogus"]),
        (["optim.factory=torch.optim.Adadelta", "optim.kwargs.lr=1.0"], ["optim.kwargs.lr", "optim.lr"]),
        (["optim.kwargs.rho=0.9"], ["optim.kwargs", "optim.factory"]),
        (["optim.scheduler_factory=torch.optim.lr_scheduler.StepLR"], ["optim.scheduler_factory", "step_size"]),
        (["optim.scheduler_factory=torch.optim.lr_scheduler.ReduceLROnPlateau"], ["ReduceLROnPlateau", "metrics"]),
        (["optim.scheduler_factory=torch.optim.lr_scheduler.StepLR", "optim.scheduler_kwargs.step_size=1",
          "optim.scheduler_interval=batch"], ["optim.scheduler_interval='batch'", "epoch"]),
        (["optim.scheduler_interval=epoch"], ["optim.scheduler_interval", "scheduler_factory"]),
        (["train.eval_fn=support.hosting:no_such_fn"], ["no_such_fn"]),
        (["train.eval_fn=support.hosting:scaled_collate"], ["train.eval_fn", "fn(model, batch)"]),
        (["train.eval_samples=0"], ["train.eval_samples=0", "-1"]),
        (["train.eval_summary=support.hosting:f1"], ["train.eval_summary", "train.eval_fn"]),
        (["data.collate=support.hosting:scaled_collate"], ["data.collate", "scale"]),
        (["data.collate_kwargs.scale=2"], ["data.collate_kwargs", "data.collate"]),
        (["optim.factory=torch"], ["optim.factory='torch'", "import path"]),
    ],
)
def test_hosted_code_is_refused_before_launch(capsys, tmp_path: Path, bad: list[str], named: list[str]) -> None:
    refused(capsys, ["run", *TOY_RUN, *bad, "--out", str(tmp_path / "run")], *named)
    assert not (tmp_path / "run").exists()
