"""`dptrain.notebook_launch` from a real Jupyter kernel: nbclient executes a notebook on an
ipykernel kernel registered for this interpreter (a kernelspec written to a temporary
JUPYTER_PATH); the notebook defines a dptrain training function in a cell (so it lives in the
kernel's __main__ and reaches the spawned workers by value, through cloudpickle) and trains the toy
model on 2 processes started by torchrun's elastic_launch; rank 0's summary comes back and the
notebook checks it. The refusals are checked without a kernel.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat/nbclient are not installed")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed")
pytest.importorskip("ipykernel", reason="ipykernel is not installed")
pytest.importorskip("cloudpickle", reason="cloudpickle is not installed (the optional extra dptrain[notebook])")

from support import subprocess_env  # noqa: E402

TRAIN_CELL = '''
import dptrain
from dptrain.config.load import load_config

def train_toy(out_dir, steps):
    """A dptrain run on this rank; the spawned workers get this function by value."""
    import os
    items = ["model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
             "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}", "data.num_workers=0",
             "train.global_batch_size=8", "train.micro_batch_size=4", f"train.max_steps={steps}",
             "train.log_every_steps=1", "parallel.strategy=ddp", "parallel.device=cpu", "log.progress=false"]
    summary = dptrain.Trainer(load_config(None, items), out_dir=out_dir).fit()
    return {**summary, "rank": int(os.environ["RANK"]), "pid": os.getpid()}
'''

LAUNCH_CELL = '''
import os
import signal
before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
result = dptrain.notebook_launch(train_toy, OUT_DIR, 4, nproc=2)
assert result["rank"] == 0 and result["world_size"] == 2 and result["steps"] == 4, result
assert result["pid"] != os.getpid()
print("RESULT", result["rank"], result["world_size"], result["steps"], result["strategy"])
after = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
assert after == before, (before, after)  # the kernel's own handlers (Ctrl-C interrupts the cell) are back
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_notebook_launch_from_a_real_kernel(tmp_path: Path, monkeypatch) -> None:
    from ipykernel.kernelspec import install

    install(prefix=str(tmp_path / "jupyter"), kernel_name="dptrain-test")  # argv: this interpreter
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter" / "share" / "jupyter"))
    monkeypatch.setenv("PYTHONPATH", subprocess_env(tests=False)["PYTHONPATH"])
    out = tmp_path / "run"
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(TRAIN_CELL),
        nbformat.v4.new_code_cell(LAUNCH_CELL.replace("OUT_DIR", repr(str(out)))),
    ]
    client = nbclient.NotebookClient(nb, kernel_name="dptrain-test", timeout=540, allow_errors=False)
    client.execute()
    text = "".join(o.get("text", "") for o in nb.cells[1].outputs if o.get("output_type") == "stream")
    assert "RESULT 0 2 4 ddp" in text, nb.cells[1].outputs
    assert "checkpoints/step_000004 committed" in text  # rank 0's own stderr, echoed into the cell
    assert (out / "final" / "model.safetensors").is_file() and (out / "summary.json").is_file()


def test_a_notebook_function_without_cloudpickle_is_refused(monkeypatch) -> None:
    from dptrain.launch import notebook

    monkeypatch.setitem(sys.modules, "cloudpickle", None)

    def local() -> None: ...

    for fn in (local, lambda: 0):
        with pytest.raises(notebook.NotPicklableError, match="defined in the notebook.*dptrain\\[notebook\\]"):
            notebook.notebook_launch(fn, nproc=2)
    main_fn = type(local)(local.__code__, {"__name__": "__main__"}, "train")
    main_fn.__module__, main_fn.__qualname__ = "__main__", "train"  # as a notebook cell defines it
    with pytest.raises(notebook.NotPicklableError, match="'train' is defined in the notebook"):
        notebook.dumps_callable(main_fn, ())


def test_arguments_that_cannot_travel_are_refused_before_any_process() -> None:
    from dptrain.launch import notebook

    with pytest.raises(notebook.NotPicklableError, match="cannot send 'getcwd'.*build models"):
        notebook.notebook_launch(os.getcwd, threading.Lock(), nproc=2)
    with pytest.raises(notebook.NotPicklableError, match="needs a function"):
        notebook.notebook_launch(42, nproc=2)  # type: ignore[arg-type]
    for bad in (0, -1, "2", True):
        with pytest.raises(ValueError, match=f"nproc={bad!r} is not valid"):
            notebook.notebook_launch(os.getcwd, nproc=bad)  # type: ignore[arg-type]


def test_the_payload_round_trips() -> None:
    from dptrain.launch import notebook

    assert notebook.run_pickled(notebook.dumps_callable(lambda a, b: a * b, (6, 7))) == 42
