"""What an earlier main wrote still works with today's code: run directories written at commit
a72a6fd, before the package layout moved (tests/fixtures/pre_layout, see generate.py there).

Their `config.yaml` names import paths (`dptrain.models.toy:build_mlp`) and every field that main
had; their checkpoints are weights-only files and DCP shards. Today's code must restore their step 3 exactly and
`dptrain run --out DIR` must continue it as that main did: bit for bit where the run was made on this machine (by
that main's own code, again), within a stated tolerance against the stored losses of another CPU
(support/old_runs.py says why).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dptrain.config import Config
from dptrain.config.load import load_config
from support.checkpoints import losses
from support.mp import run_ranks
from support.old_runs import (
    assert_restored_exactly,
    capture_resume,
    continued_within,
    old_main_run,
    saved_state,
    stored_losses,
)
from support.run_helpers import ROOT, subprocess_env

FIXTURES = ROOT / "tests" / "fixtures" / "pre_layout"


def test_the_default_config_written_before_the_move_loads_unchanged():
    """`dptrain config show`'s YAML of the built-in recipe at a72a6fd reads back as today's defaults."""
    assert load_config(str(FIXTURES / "default_config.yaml"), []) == Config()


PRE_LAYOUT_COMMIT = "a72a6fd"
NAMES = ["ddp", "fsdp"]


def dptrain_run_out(run: Path) -> None:
    """`dptrain run --out RUN` on one worker: continues the run from its own config.yaml and newest checkpoint."""
    proc = subprocess.run(
        [sys.executable, "-m", "dptrain", "run", "--out", str(run), "--nproc-per-node", "1"],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def pre_layout_here(tmp_path_factory) -> Path:
    """The fixture's runs made again on this machine by commit a72a6fd's own code (support/old_runs.py)."""
    return old_main_run(PRE_LAYOUT_COMMIT, FIXTURES / "generate.py", [], tmp_path_factory.mktemp("pre_layout"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", NAMES)
def test_a_run_written_before_the_move_is_restored_exactly(tmp_path, name):
    """The stored run (written on another CPU) resumed by today's code from its own config.yaml: everything restored
    equals what that main saved, bit for bit (weights, optimizer state, schedule, RNG, data position, log window,
    counters: machine-independent), and the continued losses of steps 4-6 agree with the stored ones to a relative
    1e-5 (LOSS_RTOL, support/old_runs.py: another CPU's float kernels may round the last bit differently)."""
    run = tmp_path / name
    shutil.copytree(FIXTURES / name, run)
    saved = saved_state(run / "checkpoints" / "step_000003")
    [restored] = run_ranks(capture_resume, 1, run, [], run / "config.yaml")
    assert_restored_exactly(saved, restored)
    assert continued_within(losses(run), stored_losses(run)[3:])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", NAMES)
def test_a_run_written_before_the_move_continues_exactly_on_this_machine(tmp_path, pre_layout_here, name):
    """Commit a72a6fd's own code writes the run again on this machine; `dptrain run --out DIR` continues it from step 3
    and must reproduce that main's own losses for steps 4-6 and its final weights bit for bit."""
    run = tmp_path / name
    shutil.copytree(pre_layout_here / name, run)
    expected = json.loads((run / "expected.json").read_text())
    dptrain_run_out(run)
    assert losses(run) == [tuple(x) for x in expected["losses"][3:]]  # steps 4-6, bit for bit
    digest = hashlib.sha256((run / "final" / "model.safetensors").read_bytes()).hexdigest()
    assert digest == expected["final_weights_sha256"]
