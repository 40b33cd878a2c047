"""The ImageNet-style port (examples/ports/imagenet_{base,dptrain}.py, docs/guides/porting.md) against its DDP
original: the original under mp.spawn with DistributedSampler at world 1 and 2, the port as plain `python` (world
1) and under `dptrain launch --nproc-per-node 2`. With BatchNorm and `rank_split="interleaved"` every step's loss
(rank 0's, as the original logs it) and every epoch's top-1 accuracy are equal bit for bit; the port stopped after
epoch 1 and resumed at the same world size continues bit for bit, with best_acc1 back from `ckpt.extra`. The
guide shows the whole diff."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

import pytest

from support import ROOT
from support.mp import find_free_port
from support.ports import run_script

PORTS = ROOT / "examples" / "ports"


def _run(script: str, tmp: Path, *args: str, nproc: int = 0, out: str = "out") -> dict[str, Any]:
    losses = tmp / f"{script}.{nproc}.{len(list(tmp.iterdir()))}.json"
    head = [sys.executable, str(PORTS / script)]
    if nproc:
        head = [sys.executable, "-m", "dptrain", "launch", "--nproc-per-node", str(nproc), str(PORTS / script)]
    record, _ = run_script([*head, *args, "--out", str(tmp / out), "--losses", str(losses)], losses, tmp,
                           original=script.endswith("_base.py"))
    return record


def _original(tmp: Path, world: int) -> dict[str, Any]:
    return _run("imagenet_base.py", tmp, "--world-size", str(world), "--dist-url",
                f"tcp://127.0.0.1:{find_free_port()}", out=f"base{world}")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [1, 2])
def test_the_imagenet_port_is_its_ddp_original_bit_for_bit_with_batchnorm(tmp_path, world):
    original = _original(tmp_path, world)
    port = _run("imagenet_dptrain.py", tmp_path, nproc=0 if world == 1 else 2, out=f"port{world}")
    assert len(original["loss"]) == 16 and len(original["val"]) == 2
    assert port == original  # every step's loss, every accuracy and best_acc1, as floats: bit for bit


@pytest.mark.timeout(90)
def test_the_imagenet_port_resumes_bit_for_bit_with_best_acc1_from_extra(tmp_path):
    whole = _run("imagenet_dptrain.py", tmp_path, nproc=2, out="whole")
    first = _run("imagenet_dptrain.py", tmp_path, "--epochs", "1", nproc=2, out="run")
    rest = _run("imagenet_dptrain.py", tmp_path, "--epochs", "2", nproc=2, out="run")
    assert first["loss"] + rest["loss"] == whole["loss"] and first["val"] + rest["val"] == whole["val"]
    assert rest["best_acc1"] == whole["best_acc1"] == max(whole["val"])
    assert whole["val"][1] < whole["val"][0]  # the best is epoch 1's: only ckpt.extra can have brought it back
    assert (tmp_path / "run" / "model_best.safetensors").is_file()


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_the_guide_shows_the_imagenet_ports_whole_diff():
    a, b = "examples/ports/imagenet_base.py", "examples/ports/imagenet_dptrain.py"
    diff = "".join(difflib.unified_diff((ROOT / a).read_text().splitlines(keepends=True),
                                        (ROOT / b).read_text().splitlines(keepends=True), fromfile=a, tofile=b))
    page = (ROOT / "docs" / "guides" / "porting.md").read_text()
    start = page.index("<!-- diff:imagenet -->\n") + len("<!-- diff:imagenet -->\n")
    assert page[start:page.index("<!-- /diff:imagenet -->")] == f"```diff\n{diff}```\n", (
        "docs/guides/porting.md is stale: paste the diff of tests/test_ports_imagenet.py's test between the markers"
    )
