"""Renamed config fields (config/dotted.py `RENAMED`): the old names still load from YAML, JSON, overrides and a run
directory's saved config.yaml, with one warning line naming old -> new; a run written by the main before the rename
resumes under today's code bit for bit."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dptrain.config import ConfigError, dotted
from dptrain.config.dotted import RENAMED
from dptrain.config.load import build_config, dump_yaml, load_config
from support.checkpoints import losses
from support.old_runs import old_main_run
from support.run_helpers import ROOT, subprocess_env

OLD_MAIN = "4f03f72"  # the last main with checkpoint.memory_* and diagnostics.memory_*
OLD_VALUES = {"checkpoint.memory_every_steps": 3, "checkpoint.memory_dir": "/tmp/snaps",
              "diagnostics.memory_every_steps": 7, "diagnostics.memory_window": 4, "diagnostics.memory_leak_mb": 99.0}


def nested(flat: dict[str, object]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for key, value in flat.items():
        section, name = key.split(".")
        out.setdefault(section, {})[name] = value
    return out


def assert_new_names_hold_old_values(cfg) -> None:
    for old, new in RENAMED.items():
        section, name = new.split(".")
        assert getattr(getattr(cfg, section), name) == OLD_VALUES[old], new


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the warning afresh (it is said once per process)."""
    monkeypatch.setattr(dotted, "_told", set())
    monkeypatch.setattr(dotted, "_pending", [])


@pytest.mark.fast
@pytest.mark.timeout(30)
@pytest.mark.parametrize("form", ["yaml", "json", "overrides", "dict"])
def test_old_names_load_with_one_line_saying_so(tmp_path, capsys, form):
    if form == "yaml":
        path = tmp_path / "c.yaml"
        path.write_text("".join(f"{section}:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in fields.items())
                                for section, fields in nested(OLD_VALUES).items()))
        cfg = load_config(str(path), [])
    elif form == "json":
        path = tmp_path / "c.json"
        path.write_text(json.dumps(nested(OLD_VALUES)))
        cfg = load_config(str(path), [])
    elif form == "overrides":
        cfg = load_config(None, [f"{k}={v}" for k, v in OLD_VALUES.items()])
    else:
        cfg = build_config(nested(OLD_VALUES))
    assert_new_names_hold_old_values(cfg)
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("dptrain: warning: renamed config keys: ")
    for old, new in RENAMED.items():
        assert f"{old} -> {new}" in lines[0]
    load_config(None, ["checkpoint.memory_every_steps=1"])  # said once per process
    assert capsys.readouterr().err == ""


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_new_names_load_silently_and_are_what_is_saved(capsys):
    cfg = load_config(None, ["checkpoint.snapshot_every_steps=3", "diagnostics.rss_every_steps=7"])
    assert (cfg.checkpoint.snapshot_every_steps, cfg.diagnostics.rss_every_steps) == (3, 7)
    assert capsys.readouterr().err == ""
    text = dump_yaml(cfg)
    assert "snapshot_every_steps: 3" in text and "rss_every_steps: 7" in text and "memory_every_steps" not in text


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_an_old_and_a_new_name_both_set_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("checkpoint:\n  memory_every_steps: 3\n  snapshot_every_steps: 4\n")
    with pytest.raises(ConfigError, match=r"checkpoint.memory_every_steps and checkpoint.snapshot_every_steps are "
                                          r"both set"):
        load_config(str(path), [])
    path.write_text("checkpoint:\n  memory_every_steps: 3\n")  # an override of the new name over the file's old one
    assert load_config(str(path), ["checkpoint.snapshot_every_steps=5"]).checkpoint.snapshot_every_steps == 5


@pytest.fixture(scope="module")
def old_main_here(tmp_path_factory) -> Path:
    """The run made by the main before the rename (its own source, from this checkout's git history)."""
    return old_main_run(OLD_MAIN, ROOT / "tests" / "fixtures" / "renamed_fields" / "generate.py", [],
                        tmp_path_factory.mktemp("renamed_fields"))


@pytest.mark.timeout(240)
def test_a_run_written_with_the_old_names_resumes_exactly(tmp_path, old_main_here):
    """The old main wrote config.yaml with checkpoint.memory_* and diagnostics.memory_* (set away from their
    defaults) and stopped at step 3; `dptrain run --out DIR` continues it under today's code: the old values land in
    the new fields, one warning line names the renames, and steps 4-6 and the final weights are that main's own, bit
    for bit (losses compared as float.hex)."""
    run = tmp_path / "run"
    shutil.copytree(old_main_here / "run", run)
    saved = (run / "config.yaml").read_text()
    assert "memory_every_steps: 2" in saved and "snapshot_every_steps" not in saved  # written the old way
    cfg = load_config(str(run / "config.yaml"), [])
    assert cfg.checkpoint.snapshot_every_steps == 2 and cfg.checkpoint.snapshot_dir == str(old_main_here / "shm")
    assert (cfg.diagnostics.rss_every_steps, cfg.diagnostics.rss_window, cfg.diagnostics.rss_leak_mb) == (2, 4, 100.0)
    proc = subprocess.run([sys.executable, "-m", "dptrain", "run", "--out", str(run), "--nproc-per-node", "1"],
                          env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    renamed = [line for line in proc.stderr.splitlines() if "renamed config keys" in line]
    assert len(renamed) == 1, proc.stderr
    expected = json.loads((run / "expected.json").read_text())
    assert "dptrain: resumed from" in proc.stderr and "step 3" in proc.stderr
    assert losses(run) == [tuple(x) for x in expected["losses"][3:]]  # steps 4-6, float.hex, bit for bit
    assert hashlib.sha256((run / "final" / "model.safetensors").read_bytes()).hexdigest() == \
        expected["final_weights_sha256"]
    assert "snapshot_every_steps: 2" in (run / "config.yaml").read_text()  # rewritten with the new names
