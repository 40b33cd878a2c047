"""What an earlier main wrote still works with today's code: run directories written at commit
a72a6fd, before the package layout moved (tests/fixtures/pre_layout, see generate.py there).

Their `config.yaml` names import paths (`dptrain.models.toy:build_mlp`) and every field that main
had; their checkpoints are weights-only files and DCP shards. `dptrain run --out DIR` continues each
from step 3 and must reproduce that main's own losses for steps 4-6 bit for bit.
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
from support.run_helpers import ROOT, subprocess_env

FIXTURES = ROOT / "tests" / "fixtures" / "pre_layout"


def test_the_default_config_written_before_the_move_loads_unchanged():
    """`dptrain config show`'s YAML of the built-in recipe at a72a6fd reads back as today's defaults."""
    assert load_config(str(FIXTURES / "default_config.yaml"), []) == Config()


def losses(run: Path) -> list[tuple[int, str]]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], float.hex(r["loss"])) for r in recs if "loss" in r]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_a_run_written_before_the_move_continues_exactly(tmp_path, name):
    run = tmp_path / name
    shutil.copytree(FIXTURES / name, run)
    expected = json.loads((run / "expected.json").read_text())
    proc = subprocess.run(
        [sys.executable, "-m", "dptrain", "run", "--out", str(run), "--nproc-per-node", "1"],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert losses(run) == [tuple(x) for x in expected["losses"][3:]]  # steps 4-6, bit for bit
    digest = hashlib.sha256((run / "final" / "model.safetensors").read_bytes()).hexdigest()
    assert digest == expected["final_weights_sha256"]
