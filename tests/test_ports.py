"""The porting guide's three ports (examples/ports/, docs/guides/porting.md) against their single-process
bases: each port run as plain `python` (a world of one) gives the base's per-step losses and evaluation
results bit for bit; the MNIST port under `dptrain launch --nproc-per-node 2` (same global batch) gives them
within a relative 1e-4. Dropout is off in these runs (2 ranks draw other masks than 1 process); every run
has OMP_NUM_THREADS=1.
benchmarks/acceptance/ports.py measures more (world 2 for all three, resume across world sizes)."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

import pytest

from support import ROOT
from support.ports import run_script

PORTS = ROOT / "examples" / "ports"
ARGS = {
    "mnist": ["--epochs", "1", "--no-dropout"],
    "word_lm": ["--epochs", "2", "--dropout", "0"],
    "nlp": ["--num_epochs", "1", "--dropout", "0"],
}


def _run(script: str, args: list[str], tmp: Path, *, nproc: int = 0) -> dict[str, Any]:
    out = tmp / f"{script}.{nproc}.json"
    head = [sys.executable, str(PORTS / script)]
    if nproc:
        head = [sys.executable, "-m", "dptrain", "launch", "--nproc-per-node", str(nproc), str(PORTS / script)]
    extra = {"mnist_dptrain.py": ["--out", str(tmp / f"ckpt{nproc}")]}.get(script, [])
    if script.startswith("word_lm"):
        extra = ["--save", str(tmp / f"{script}.{nproc}.pt")]
    return run_script([*head, *args, *extra, "--losses", str(out)], out, tmp, timeout=120)[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(ARGS))
def test_a_port_at_world_one_is_its_base_bit_for_bit(name, tmp_path):
    if name == "nlp":
        pytest.importorskip("transformers")
    base = _run(f"{name}_base.py", ARGS[name], tmp_path)
    port = _run(f"{name}_dptrain.py", ARGS[name], tmp_path)
    assert len(base["loss"]) > 4
    assert port == base  # every step's loss and every evaluation result


@pytest.mark.timeout(120)
def test_the_mnist_port_on_two_ranks_follows_its_base(tmp_path):
    args = ["--epochs", "1", "--no-dropout"]
    base = _run("mnist_base.py", args, tmp_path)
    two = _run("mnist_dptrain.py", args, tmp_path, nproc=2)
    assert len(two["loss"]) == len(base["loss"]) == 512 // 64
    assert two["loss"] == pytest.approx(base["loss"], rel=1e-4)
    assert two["test"][0]["correct"] == base["test"][0]["correct"]  # 131 test samples: one repeat dropped
    assert two["test"][0]["test_loss"] == pytest.approx(base["test"][0]["test_loss"], rel=1e-4)


@pytest.mark.fast
@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(ARGS))
def test_the_guide_shows_each_ports_whole_diff(name):
    a, b = (f"examples/ports/{name}_{kind}.py" for kind in ("base", "dptrain"))
    diff = "".join(difflib.unified_diff((ROOT / a).read_text().splitlines(keepends=True),
                                        (ROOT / b).read_text().splitlines(keepends=True), fromfile=a, tofile=b))
    page = (ROOT / "docs" / "guides" / "porting.md").read_text()
    start = page.index(f"<!-- diff:{name} -->\n") + len(f"<!-- diff:{name} -->\n")
    assert page[start:page.index(f"<!-- /diff:{name} -->")] == f"```diff\n{diff}```\n", (
        "docs/guides/porting.md is stale: PYTHONPATH=src python benchmarks/acceptance/ports.py --docs --diffs-only"
    )
