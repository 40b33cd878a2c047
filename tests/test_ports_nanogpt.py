"""The nanoGPT-shaped port (examples/ports/nanogpt_{base,dptrain}.py, docs/guides/porting.md) against its torchrun
DDP original: the original as plain `python` and under torchrun, the port as plain `python` and under
`dptrain launch --nproc-per-node 2`. Every logged loss, every evaluation and best_val_loss are equal bit for bit at
world 1 and 2. The port's every-rank save (rank 0 decides, `dptrain.broadcast`) with the RNG taken as the batch was
drawn resumes bit for bit, with best_val_loss back from `ckpt.extra`. The guide shows the whole diff."""

from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from support import ROOT
from support.mp import find_free_port
from support.ports import run_script

PORTS = ROOT / "examples" / "ports"
ARGS = ["--max_iters", "10"]  # evaluations at 0, 4, 8 (the original evaluates on rank 0 only)


def _run(script: str, tmp: Path, *args: str, launcher: str = "", out: str = "out") -> tuple[dict[str, Any], str]:
    losses = tmp / f"{out}.{len(list(tmp.iterdir()))}.json"
    head = [sys.executable, str(PORTS / script)]
    if launcher == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(find_free_port()), str(PORTS / script)]
    elif launcher == "dptrain":
        head = [sys.executable, "-m", "dptrain", "launch", "--nproc-per-node", "2", str(PORTS / script)]
    return run_script([*head, *ARGS, *args, "--out_dir", str(tmp / out), "--losses", str(losses)], losses, tmp,
                      original=script.endswith("_base.py"))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [1, 2])
def test_the_nanogpt_port_is_its_original_bit_for_bit(tmp_path, world):
    original, _ = _run("nanogpt_base.py", tmp_path, launcher="torchrun" if world == 2 else "", out="base")
    port, _ = _run("nanogpt_dptrain.py", tmp_path, launcher="dptrain" if world == 2 else "", out="port")
    assert len(original["loss"]) == 10 and [i for i, _ in original["val"]] == [0, 4, 8]
    assert port == original  # every logged loss, every evaluation, best_val_loss: bit for bit


@pytest.mark.timeout(90)
def test_the_nanogpt_port_resumes_bit_for_bit_with_best_val_loss_from_extra(tmp_path):
    whole, _ = _run("nanogpt_dptrain.py", tmp_path, launcher="dptrain", out="whole")
    first, _ = _run("nanogpt_dptrain.py", tmp_path, "--max_iters", "8", launcher="dptrain", out="run")
    rest, err = _run("nanogpt_dptrain.py", tmp_path, "--init_from", "resume", launcher="dptrain", out="run")
    assert "resumed from" in err and "step_000008" in err
    assert first["loss"] + rest["loss"] == whole["loss"]  # the batches after the resume are the same ones
    assert rest["val"][0] == first["val"][-1] and first["val"] + rest["val"][1:] == whole["val"]
    assert rest["best_val_loss"] == whole["best_val_loss"]
    assert "step_000008 committed" not in err  # best_val_loss came back: the re-evaluation at 8 is no improvement
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_000008" / "manifest.json").read_text())["meta"]
    assert meta["extra"] == {"best_val_loss": whole["best_val_loss"],
                             "model_args": {"vocab_size": 256, "block_size": 16, "n_embd": 32}}


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_the_guide_shows_the_nanogpt_ports_whole_diff():
    a, b = "examples/ports/nanogpt_base.py", "examples/ports/nanogpt_dptrain.py"
    diff = "".join(difflib.unified_diff((ROOT / a).read_text().splitlines(keepends=True),
                                        (ROOT / b).read_text().splitlines(keepends=True), fromfile=a, tofile=b))
    page = (ROOT / "docs" / "guides" / "porting.md").read_text()
    start = page.index("<!-- diff:nanogpt -->\n") + len("<!-- diff:nanogpt -->\n")
    assert page[start:page.index("<!-- /diff:nanogpt -->")] == f"```diff\n{diff}```\n", (
        "docs/guides/porting.md is stale: paste the diff of tests/test_ports_nanogpt.py's test between the markers"
    )
