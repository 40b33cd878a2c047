"""`dptrain run --out DIR` on a directory that holds run records but no config.yaml (a run stopped during
start-up) never trains a recipe the directory did not name: exit 2, saying how to start over or what to pass.
And under `dptrain launch`, a user script's exit status is reported as its own; dptrain's meanings (3: the hang
watchdog) apply only when dptrain's exit mark says it caused them (real 2-process launches)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dptrain.cli.main import main
from dptrain.config.load import dump_yaml, load_config
from support.cli import refused
from support.run_helpers import TOY_RUN, dptrain


def _started_then_killed(run_dir: Path) -> None:
    """What a SIGTERM during start-up left: console.log, an empty metrics.jsonl, status/."""
    (run_dir / "status").mkdir(parents=True)
    (run_dir / "status" / "owner.json").write_text('{"pid": 1, "host": "h", "started": "s", "command": []}\n')
    (run_dir / "console.log").write_text("dptrain: standalone rendezvous on this node\n")
    (run_dir / "metrics.jsonl").write_text("")


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_records_without_a_config_are_refused_not_trained_with_the_built_in_recipe(capsys, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _started_then_killed(run_dir)
    before = sorted(p.name for p in run_dir.iterdir())
    text = refused(capsys, ["run", "--out", str(run_dir)], "no config.yaml", "console.log", "--resume none",
                   f"dptrain run CONFIG --out {run_dir}")
    assert "built-in" in text
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing written, nothing trained
    # overrides alone do not name the recipe either
    refused(capsys, ["run", "train.max_steps=1", "--out", str(run_dir)], "no config.yaml")


@pytest.mark.fast
@pytest.mark.timeout(90)
def test_naming_the_recipe_or_resume_none_still_starts(tmp_path: Path) -> None:
    toy = [*TOY_RUN, "train.max_steps=1", "parallel.strategy=single"]
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(dump_yaml(load_config(None, toy)))
    run_a = tmp_path / "a"  # a config file given: the user named the recipe
    _started_then_killed(run_a)
    assert main(["run", str(recipe), "--nproc-per-node", "1", "--out", str(run_a)]) == 0
    assert (run_a / "final" / "model.safetensors").is_file()
    run_c = tmp_path / "c"  # overrides that name the model and data factories name the recipe too
    _started_then_killed(run_c)
    assert main(["run", *toy, "--nproc-per-node", "1", "--out", str(run_c)]) == 0
    assert (run_c / "final" / "model.safetensors").is_file()
    run_b = tmp_path / "b"  # --resume none: start a new run there
    _started_then_killed(run_b)
    assert main(["run", *toy, "--nproc-per-node", "1", "--out", str(run_b), "--resume", "none"]) == 0
    assert (run_b / "final" / "model.safetensors").is_file() and (run_b / "config.yaml").is_file()


SCRIPT = """
import os, sys
{body}
sys.exit({code} if os.environ["RANK"] == "0" else 0)
"""


@pytest.mark.timeout(90)
def test_a_user_scripts_exit_status_is_its_own(tmp_path: Path) -> None:
    script = tmp_path / "exit3.py"
    script.write_text(SCRIPT.format(body="", code=3))
    r = dptrain("launch", "--nproc-per-node", "2", str(script), timeout=80)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "dptrain: your script exited with status 3 on rank 0" in r.stderr
    assert "hang watchdog" not in r.stderr and "hang_report" not in r.stderr


@pytest.mark.timeout(90)
def test_dptrains_own_exit_mark_keeps_its_meaning(tmp_path: Path) -> None:
    """A rank that dptrain's watchdog ends writes its mark first (diagnostics/watchdog.py); the launcher then
    says what dptrain did, naming the report."""
    script = tmp_path / "hang.py"
    body = ("import time\nfrom dptrain.distributed.exit_marks import mark_exit\n"
            "if os.environ['RANK'] == '0':\n"
            f"    mark_exit(3, 'hang watchdog', detail={str(tmp_path / 'hang_report.txt')!r})\n"
            "else:\n    time.sleep(60)  # stopped by torchrun once rank 0 has gone")
    script.write_text(SCRIPT.format(body=body, code=3))
    r = dptrain("launch", "--nproc-per-node", "2", str(script), timeout=80)
    assert r.returncode == 3, r.stderr[-2000:]
    line = f"stopped by the hang watchdog: rank 0 (exit 3), rank 1 (exit -15); see {tmp_path / 'hang_report.txt'}"
    assert line in r.stderr, r.stderr[-2000:]
