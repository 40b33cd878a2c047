"""The checkpoint manager without a Trainer, checkpoint format versions, and the step boundary:
the preemption agreement across real processes and the absence of per-step host-device syncs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dptrain.checkpoint import manifest as mf
from dptrain.checkpoint.manager import FORMAT_VERSION, CheckpointManager
from dptrain.checkpoint.state import CheckpointState, DataPosition, ModelState, OptimizerState
from dptrain.config import ConfigError
from dptrain.config.load import load_config
from dptrain.data import GlobalBatchSampler
from dptrain.distributed.env import DistEnv
from support import ROOT
from support.checkpoints import TOY, fit, losses, weights_sha
from support.mp import run_ranks
from support.old_runs import (
    assert_restored_exactly,
    capture_resume,
    continued_within,
    old_main_run,
    saved_state,
    stopped_at_step_3,
    stored_losses,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ckpt_v1"
SRC = str(ROOT / "src" / "dptrain")


# ---------------------------------------------------------------------- no Trainer at all
class Progress:
    """A train state of the caller's own: the manager only calls state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.step = 0
        self.samples_seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "samples_seen": self.samples_seen}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step, self.samples_seen = sd["step"], sd["samples_seen"]


X = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
Y = X.sum(dim=1, keepdim=True).sin()


def plain_run(run_dir: Path, *, until: int, every: int = 3, extra: tuple[str, ...] = (), env: DistEnv | None = None,
              crash: bool = False) -> tuple[list[str], list[torch.Tensor], CheckpointManager]:
    """A hand-written loop: plain model, SGD with momentum, LR schedule, the dptrain sampler. `crash`: stop after
    step `until` as a killed worker would (no final save; the in-memory snapshot in flight finishes)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sampler = GlobalBatchSampler(dataset_len=64, global_batch_size=8, micro_batch_size=8, grad_accum_steps=1,
                                 dp_rank=0, dp_world_size=1, seed=3)
    progress = Progress()
    state = CheckpointState(
        model_parts=[ModelState(model, full=True)],
        optimizers=[OptimizerState(model, opt, full=True)],
        schedule=sched,
        scaler=None,
        data=DataPosition(sampler, progress),
        train=progress,
        full=True,
    )
    cfg = load_config(None, [f"checkpoint.every_steps={every}", "checkpoint.keep_last=null", *extra])
    mgr = CheckpointManager(cfg=cfg, run_dir=run_dir, env=env or DistEnv.from_env({}))
    mgr.maybe_resume(state)
    batches, out = iter(sampler), []
    while progress.step < until:
        idx = next(batches)
        noise = 0.01 * torch.randn(len(idx), 1)  # the RNG state is part of the checkpoint too
        loss = ((model(X[idx]) - Y[idx] - noise) ** 2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        progress.step += 1
        progress.samples_seen += len(idx)
        out.append(float.hex(loss.item()))
        assert not mgr.maybe_save(state, step=progress.step)
    if crash:
        mgr.memory.wait()
        return out, [], mgr
    mgr.save_final(state)
    return out, [p.detach().clone() for p in model.parameters()], mgr


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_a_restart_that_resumes_from_memory_hashes_no_disk_checkpoint_unless_it_needs_one(tmp_path, monkeypatch):
    """After a restart the in-memory snapshot is chosen without reading the disk checkpoints' data (their SHA-256
    costs minutes at scale): the disk's newest committed step is read from its manifest. Only when no snapshot is
    that new are the disk checkpoints verified, and then an older valid one (the newest corrupt) lets an older
    snapshot win. Every resumed run ends bit-identical to the uninterrupted one."""
    ref_losses, ref_params, _ = plain_run(tmp_path / "ref", until=8)
    hashed: list[str] = []
    verify = mf.verify_files
    monkeypatch.setattr(mf, "verify_files", lambda d, *a, **k: (hashed.append(Path(d).name), verify(d, *a, **k))[1])

    def restart(run: Path, *extra: str, attempt: int) -> tuple[list[str], list[torch.Tensor], CheckpointManager]:
        env = DistEnv.from_env({"TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": "3"})
        return plain_run(run, until=7 if attempt == 0 else 8, extra=(f"checkpoint.snapshot_dir={tmp_path / 'mem'}",
                                                                    *extra), env=env, crash=attempt == 0)

    # memory every step, disk every 3: the snapshot of step 7 beats the disk's step 6, whose data is never read
    restart(tmp_path / "a", attempt=0)
    hashed.clear()
    rest, params, mgr = restart(tmp_path / "a", attempt=1)
    assert mgr.resumed_from_memory is not None and mgr.resumed_from_memory.step == 7
    assert hashed == []  # no checkpoint data read at the resume
    assert rest == ref_losses[7:] and all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    # memory every 2 steps (snapshots 4 and 6 kept), disk at step 7 only: the disk is newer, so it is verified
    for corrupt, want in ((False, ("disk", 7)), (True, ("memory", 6))):
        run = tmp_path / f"b-{corrupt}"
        restart(run, "checkpoint.snapshot_every_steps=2", "checkpoint.every_steps=7", attempt=0)
        if corrupt:  # the newest disk checkpoint is corrupt: the disk's valid step is 0, the snapshot of 6 wins
            (run / "checkpoints" / "step_000007" / "model.pt").write_bytes(b"garbage")
        hashed.clear()
        rest, params, mgr = restart(run, "checkpoint.snapshot_every_steps=2", "checkpoint.every_steps=7", attempt=1)
        memory = mgr.resumed_from_memory
        got = ("memory", memory.step) if memory else ("disk", mf.step_of(mgr.resumed_from))
        assert got == want and "step_000007" in hashed
        assert rest == ref_losses[want[1]:], corrupt
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_manager_saves_and_resumes_hand_built_stateful_objects_exactly(tmp_path):
    ref_losses, ref_params, _ = plain_run(tmp_path / "ref", until=6)
    first, _, mgr = plain_run(tmp_path / "run", until=3)
    assert mgr.resumed_from is None and first == ref_losses[:3]
    rest, params, mgr = plain_run(tmp_path / "run", until=6)
    assert mgr.resumed_from is not None and mgr.resumed_from.name == "step_000003"
    assert rest == ref_losses[3:]  # bit for bit: model, momentum, schedule, data position and RNG restored
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    meta = mf.verify(tmp_path / "run" / "checkpoints" / "step_000006")
    assert meta["format_version"] == FORMAT_VERSION and meta["format"] == "full" and meta["sampler"]["step"] == 6
    optim = torch.load(tmp_path / "run" / "checkpoints" / "step_000006" / "optim.pt", weights_only=True)
    assert sorted(optim["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]  # keyed by name (version 2)


# ---------------------------------------------------------------------- format versions
# tests/fixtures/ckpt_v1: step 3 of a 6-step run written by dptrain at commit 5186cb6 (before `format_version`
# existed), with that run's own losses and final weights (see generate.py there), on the developers' AMD machine.
V1_COMMIT = "5186cb6"
V1_CASES = [("single", "single"), ("single", "zero1"), ("fsdp", "fsdp")]


def v1_overrides(strategy: str) -> list[str]:
    return ["train.max_steps=6", "checkpoint.every_steps=3", f"parallel.strategy={strategy}"]


@pytest.fixture(scope="module")
def v1_here(tmp_path_factory) -> Path:
    """The fixture's runs made again on this machine by commit 5186cb6's own code (support/old_runs.py)."""
    out = tmp_path_factory.mktemp("v1")
    return old_main_run(V1_COMMIT, FIXTURES / "generate.py", ["single", "fsdp"], out, threads=1)  # as run_ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("fixture", "strategy"), V1_CASES)
def test_a_checkpoint_written_before_format_versions_is_restored_exactly(tmp_path, fixture, strategy):
    """The stored fixture, written on another CPU, resumed by today's code: everything restored equals what the
    old main saved, bit for bit (weights, optimizer state and hyper-parameters, schedule, RNG, data position, log
    window, counters; no float is computed to restore them, so this holds on any machine). The continued losses
    of steps 4-6 agree with the stored ones to a relative 1e-5 (LOSS_RTOL): the float kernels of another CPU may
    round the last bit differently (support/old_runs.py). Where this machine reproduces the stored run from
    scratch bit for bit, the continued losses and final weights must equal the stored ones exactly."""
    run = tmp_path / "old"
    shutil.copytree(FIXTURES / fixture, run)
    ckpt = run / "checkpoints" / "step_000003"
    saved = saved_state(ckpt)
    assert "format_version" not in mf.verify(ckpt)  # version 1: written before the field existed
    [restored] = run_ranks(capture_resume, 1, run, [*TOY, *v1_overrides(strategy)])
    assert_restored_exactly(saved, restored)
    stored = stored_losses(run)
    assert continued_within(losses(run), stored[3:])  # steps 4-6
    fresh = tmp_path / "fresh"
    run_ranks(fit, 1, fresh, v1_overrides(strategy))
    if losses(fresh) == stored:  # this machine computes as the recording one did
        assert losses(run) == stored[3:]
        assert weights_sha(run) == json.loads((run / "expected.json").read_text())["final_weights_sha256"]
    assert mf.verify(run / "checkpoints" / "step_000006")["format_version"] == FORMAT_VERSION


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("fixture", "strategy"), V1_CASES)
def test_a_checkpoint_written_before_format_versions_continues_exactly_on_this_machine(
    tmp_path, v1_here, fixture, strategy
):
    """Commit 5186cb6's own code makes the fixture's run again on this machine (6 steps, saving at 3 and 6); today's
    code resumes its step 3 and must reproduce that main's steps 4-6 and final weights bit for bit, and today's
    uninterrupted run of the same recipe from scratch must reproduce all six of its losses bit for bit."""
    old = v1_here / f"run_{fixture}"
    expected = json.loads((old / "expected.json").read_text())
    run = stopped_at_step_3(old, tmp_path / "old")
    assert "format_version" not in mf.verify(run / "checkpoints" / "step_000003")
    run_ranks(fit, 1, run, v1_overrides(strategy))
    assert losses(run) == [tuple(x) for x in expected["losses"][3:]]  # steps 4-6, bit for bit
    assert weights_sha(run) == expected["final_weights_sha256"]
    fresh = tmp_path / "fresh"
    run_ranks(fit, 1, fresh, v1_overrides(strategy))
    assert losses(fresh) == [tuple(x) for x in expected["losses"]]


@pytest.mark.timeout(120)
def test_the_cross_machine_tolerance_catches_a_lost_optimizer_state(tmp_path):
    """The guard for LOSS_RTOL: the stored fixture resumed with its optimizer state dropped (Adam's moments and
    step count reset, as a resume that forgot them would) continues outside the tolerance."""
    run = tmp_path / "old"
    shutil.copytree(FIXTURES / "single", run)
    ckpt = run / "checkpoints" / "step_000003"
    optim = torch.load(ckpt / "optim.pt", weights_only=True)
    optim["state"] = {}
    torch.save(optim, ckpt / "optim.pt")
    body = json.loads((ckpt / "manifest.json").read_text())
    body["files"]["optim.pt"] = mf.file_entry(ckpt / "optim.pt")
    mf.commit(ckpt, manifest_sha256=mf.write_manifest(ckpt, files=body["files"], meta=body["meta"]))
    run_ranks(fit, 1, run, v1_overrides("single"))
    stored = stored_losses(run)
    assert continued_within(losses(run)[:1], stored[3:4])  # step 4 runs before any optimizer step
    assert not continued_within(losses(run)[1:], stored[4:])


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_an_unknown_format_version_is_refused_naming_it(tmp_path):
    from dptrain.cli.ckpt import prepare_resume

    run = tmp_path / "run"
    plain_run(run, until=3)
    ckpt = run / "checkpoints" / "step_000003"
    body = json.loads((ckpt / "manifest.json").read_text())
    body["meta"]["format_version"] = 99
    mf.commit(ckpt, manifest_sha256=mf.write_manifest(ckpt, files=body["files"], meta=body["meta"]))
    assert mf.inspect_dir(ckpt).valid  # intact: refused for its version only
    with pytest.raises(
        mf.CheckpointError, match=r"step_000003: checkpoint format version 99, but this dptrain .* reads versions 1, 2"
    ):
        plain_run(run, until=6)
    with pytest.raises(ConfigError, match="checkpoint format version 99"):  # `dptrain run`: exit 2 before launch
        prepare_resume(load_config(None, []), run_dir=run, resume=str(ckpt), trust=False, world_size=1)


# ---------------------------------------------------------------------- the step boundary
_calls = [0]


def sigterm_on_rank1(model, batch):
    """The model's loss; rank 1 sends itself SIGTERM during the first micro-step of step 3."""
    _calls[0] += 1
    if os.environ["RANK"] == "1" and _calls[0] == 2 * 2 + 1:  # 2 micro-steps per step at world size 2
        os.kill(os.getpid(), signal.SIGTERM)
    return model(batch)


@pytest.mark.timeout(90)
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step_with_a_committed_checkpoint(tmp_path, capfd):
    run = tmp_path / "run"
    over = ["train.max_steps=30", "checkpoint.every_steps=0", "train.loss=test_checkpoint_state:sigterm_on_rank1"]
    summaries = run_ranks(fit, 2, run, over)
    # Received during step 3 on rank 1 only; agreed (without blocking) at the next boundary: both stop at 4.
    assert [s.get("preempted") for s in summaries] == [True, True]
    assert [s["steps"] for s in summaries] == [4, 4]
    assert [i.step for i in mf.list_checkpoints(run / "checkpoints")] == [4]
    assert mf.inspect_dir(run / "checkpoints" / "step_000004").valid
    assert "preempted (SIGTERM): saved step 4" in capfd.readouterr().err
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4]


def fit_counting_syncs(rank: int, out: Path, overrides: list[str], log_every: int) -> dict[str, list[str]]:
    """fit(), recording every .item(), .tolist() and GradScaler.get_scale() that dptrain's own code
    calls inside train_step/end_step, split by whether the step is a logging step."""
    from dptrain.train.trainer import Trainer

    where: list[str | None] = [None]
    seen: dict[str, list[str]] = {"log": [], "other": []}

    def counted(real, name):
        def call(self, *args, **kwargs):
            frame = sys._getframe(1)
            caller = frame.f_code.co_filename
            # dptrain's code only (torch's GradScaler.step reads its found-inf flag itself); the
            # sampler's .tolist() turns a CPU index permutation into a list: no device involved
            if where[0] is not None and caller.startswith(SRC) and not caller.endswith("sampler.py"):
                seen[where[0]].append(f"{name} at {caller}:{frame.f_lineno}")
            return real(self, *args, **kwargs)

        return call

    torch.Tensor.item = counted(torch.Tensor.item, "item")
    torch.Tensor.tolist = counted(torch.Tensor.tolist, "tolist")
    torch.amp.GradScaler.get_scale = counted(torch.amp.GradScaler.get_scale, "get_scale")

    def tagged(real):
        def method(self, *args):
            step = self.state.step + 1  # the step being trained (end_step counts it)
            where[0] = "log" if step % log_every == 0 or step == self.cfg.train.max_steps else "other"
            try:
                return real(self, *args)
            finally:
                where[0] = None

        return method

    real_train, real_end = Trainer.train_step, Trainer.end_step
    Trainer.train_step, Trainer.end_step = tagged(real_train), tagged(real_end)
    fit(rank, out, overrides)
    return seen


@pytest.mark.timeout(90)
def test_no_host_device_sync_on_the_step_path_except_at_logging_steps(tmp_path):
    # A loss scale too large for fp16: the first steps overflow and are skipped, so the skip count the
    # scaler keeps on the device between logging steps is a number that can be wrong.
    over = ["train.max_steps=10", "train.log_every_steps=5", "precision.dtype=fp16", f"precision.init_scale={2**18}"]
    seen = run_ranks(fit_counting_syncs, 2, tmp_path / "run", over, 5)
    for rank_seen in seen:
        assert rank_seen["other"] == []  # steps 1-4 and 6-9: no .item(), .tolist() or get_scale()
        assert any("item" in s for s in rank_seen["log"])  # the counter sees the log steps' reads
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    logged = {
        r["step"]: r
        for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }
    assert summary["steps"] == 10 and sorted(logged) == [5, 10]
    skipped = summary["skipped_steps"]
    assert 0 < skipped < 10 and logged[10]["skipped_steps"] == skipped
    # every skipped step halved the scale once (no growth within 10 steps): counted, not just sampled
    assert logged[10]["loss_scale"] == 2**18 / 2**skipped
