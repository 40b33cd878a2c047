"""Every bad input gets one clear line and exit 2, never a traceback nor a silent default (issue 26's
battery, the cases that need no process group). Each case runs `dptrain ARGV` in this process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dptrain.cli.main import main
from support import ROOT, overrides
from support.cli import refused

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(("override", "named"), [
    ("parallel.bucket_cap_mb=1e308", "parallel.bucket_cap_mb=1e+308 is not valid"),
    ("parallel.timeout_s=1e300", "parallel.timeout_s=1e+300 is not valid"),
    ("parallel.timeout_s=0.001", "parallel.timeout_s=0.001 is not valid"),
    ("log.status_every_s=1e300", "log.status_every_s=1e+300 is not valid"),
    ("diagnostics.hang_timeout_s=1e300", "diagnostics.hang_timeout_s=1e+300 is not valid"),
    ("precision.init_scale=1e300", "precision.init_scale=1e+300 is not valid"),
])
def test_absurd_but_finite_numbers_are_refused_with_their_range(capsys, override, named):
    refused(capsys, ["config", "show", override], named, "it must be a finite number in")


def test_an_override_without_a_value_is_named_as_such(capsys):
    refused(capsys, ["config", "show", "train.max_steps"], "'train.max_steps' has no value", "train.max_steps=VALUE")


def test_a_hash_inside_an_override_value_is_kept_literally(capsys):
    assert main(["config", "show", "log.out_dir=runs/a #1"]) == 0
    assert "out_dir: 'runs/a #1'" in capsys.readouterr().out
    refused(capsys, ["config", "show", "train.max_steps=5 #x"], "train.max_steps='5 #x' has the wrong type")


@pytest.mark.parametrize(
    ("suffix", "text", "named"),
    [
        (".yaml", "train:\n  max_steps: 3\n  max_steps: 5\n", "duplicate key 'max_steps': 3 (line 2) and 5 (line 3)"),
        (".yaml", "train: {max_steps: 3}\ntrain: {seed: 1}\n", "duplicate key 'train'"),
        (".json", '{"train": {"max_steps": 3, "max_steps": 5}}', "duplicate key 'max_steps': 3 and 5"),
        (".json", '{"train_batch_size": 8, "train_batch_size": 16}', "duplicate key 'train_batch_size': 8 and 16"),
        (".json", '{"train": {"max_steps": 3}, "trian": {}}', "unknown config key 'trian'"),
        (
            ".json",
            '{"train_batch_size": 8, "zero_optimization": {"stage": [2]}}',
            "zero_optimization.stage=[2] is not valid",
        ),
        (
            ".json",
            '{"train_batch_size": 8, "scheduler": {"type": ["WarmupLR"]}}',
            "scheduler.type=['WarmupLR'] is not valid",
        ),
        (
            ".json",
            '{"train_batch_size": 8, "fp16": {"enabled": true, "initial_scale_power": 5000}}',
            "fp16.initial_scale_power=5000 is not valid",
        ),
    ],
)
def test_config_files_with_two_meanings_or_wrong_shapes_are_refused(capsys, tmp_path, suffix, text, named):
    path = tmp_path / f"cfg{suffix}"
    path.write_text(text)
    refused(capsys, ["config", "show", str(path)], named)


def test_a_config_read_from_a_pipe_is_read(tmp_path):
    """`dptrain config show <(...)` and a FIFO: exists without being a regular file."""
    fifo = tmp_path / "cfg"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"printf 'train: {{max_steps: 4}}\\n' > {fifo}"])
    out = subprocess.run(
        [sys.executable, "-m", "dptrain", "config", "show", str(fifo)], capture_output=True, text=True, timeout=60
    )
    writer.wait(timeout=10)
    assert out.returncode == 0 and "max_steps: 4" in out.stdout, out.stderr


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["run", "--out", "a", "--out", "b"], "--out given twice: 'a' and 'b'"),
        (["run", "--out", "train.max_steps=3"], "--out 'train.max_steps=3' looks like a section.field=value override"),
        (["run", "--out", ""], "--out is empty"),
        (["run", "--max-restarts", "1", "--max-restarts", "2"], "--max-restarts given twice: 1 and 2"),
        (
            ["config", "show", "--nproc-per-node", "2", "launch.nproc_per_node=3"],
            "--nproc-per-node 2 and the override launch.nproc_per_node=3 disagree",
        ),
        (
            ["run", "--out", "x", "log.out_dir=y", "train.max_steps=1"],
            "--out x and the override log.out_dir=y disagree",
        ),
    ],
)
def test_options_with_two_meanings_are_refused(capsys, argv, named):
    refused(capsys, argv, named)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["plan", "--params", "nan", "--gpus", "8"], "argument --params: nan is not valid"),
        (["plan", "--params", "7e9", "--gpus", "0"], "argument --gpus: 0 is not valid"),
        (["manifest", "slurm", "--nnodes", "1", "--nproc-per-node", "0"], "argument --nproc-per-node: 0 is not valid"),
        (
            ["manifest", "slurm", "--nnodes", "1", "--nproc-per-node", "-1"],
            "argument --nproc-per-node: -1 is not valid",
        ),
        (["ckpt", "ls", "/nonexistent/run"], "'/nonexistent/run' does not exist"),
        (["ckpt", "verify", "/nonexistent/run"], "'/nonexistent/run' does not exist"),
        (["launch", "/nonexistent/train.py"], "script '/nonexistent/train.py' does not exist"),
    ],
)
def test_other_commands_name_the_bad_value(capsys, argv, named):
    refused(capsys, argv, named)


def test_ckpt_ls_of_a_file_and_report_of_a_non_run_are_refused(capsys, tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    refused(capsys, ["ckpt", "ls", str(f)], "is a file")
    refused(capsys, ["report", str(tmp_path)], "is not a run directory")


def test_launch_help_is_dptrains_own_and_imports_no_torch():
    code = (
        "import sys; from dptrain.cli.main import main; rc = main(['launch', '--help']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "usage: dptrain launch [torchrun options] SCRIPT [ARGS]" in out.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--out", "/proc/dptrain-run", "train.max_steps=1"],
        ["run", "--out", "/sys/dptrain-run", "train.max_steps=1"],
        ["report", "RUN", "--out", "/proc/report"],
        ["ckpt", "export", "RUN", "--out", "/proc/model.safetensors"],
        ["doctor", "--comm", "--json", "/proc/sweep.json"],
        ["plan", "--model", "llama-7b", "--gpus", "8", "--recommend", "--write", "/proc/recipe.yaml"],
        ["bench", "--out", "/proc/bench"],
    ],
)
def test_outputs_where_no_file_can_be_written_are_refused(capsys, tmp_path, argv):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    refused(capsys, [str(run) if a == "RUN" else a for a in argv], "cannot hold files")


def test_outputs_with_a_file_in_the_way_are_refused(capsys, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    refused(capsys, ["run", "--out", str(f), "train.max_steps=1"], "is a file, not a directory")
    refused(capsys, ["ckpt", "export", str(tmp_path), "--out", str(f / "m.safetensors")], "is a file, not a directory")


# ---------------------------------------------------------------------- factories returning the wrong thing
# (named by import path below: `test_input_errors:...`, this module, on the path pytest gives tests/)
def no_parameters():
    from torch import nn

    class Frozen(nn.Module):
        def forward(self, x, y=None):
            return x.sum()

    return Frozen()


def returns_int():
    return 5


def returns_none():
    return None


def returns_three():
    from dptrain.models.toy import build_regression_data

    data = build_regression_data()
    return data, data, data


def returns_iterable():
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(10)

    return Stream()


def returns_empty_val():
    from dptrain.models.toy import build_regression_data

    return build_regression_data(), []


TOY_FLAGS = [
    "model.factory=dptrain.models.toy:build_mlp",
    "model.kwargs={}",
    "data.factory=dptrain.models.toy:build_regression_data",
    "data.kwargs={}",
    "train.max_steps=1",
    "--nproc-per-node",
    "1",
]


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model.factory=test_input_errors:no_parameters", "returned Frozen with no trainable parameters"),
        ("data.factory=test_input_errors:returns_int", "data factory returned builtins.int"),
        ("data.factory=test_input_errors:returns_none", "data factory returned builtins.NoneType"),
        ("data.factory=test_input_errors:returns_three", "data factory returned a tuple of length 3"),
        (
            "data.factory=test_input_errors:returns_iterable",
            "the train split is an IterableDataset (returns_iterable.<locals>.Stream)",
        ),
        ("data.factory=test_input_errors:returns_empty_val", "the validation split is empty"),
    ],
)
def test_factories_returning_what_cannot_train_are_refused_before_launch(capsys, tmp_path, override, named):
    refused(capsys, ["run", *overrides(TOY_FLAGS, [override]), "--out", str(tmp_path / "run")], named)
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_vocabulary_smaller_than_the_data_is_refused(capsys, tmp_path):
    refused(
        capsys,
        [
            "run",
            "model.kwargs.vocab_size=100",
            "train.max_steps=1",
            "--nproc-per-node",
            "1",
            "--out",
            str(tmp_path / "run"),
        ],
        "model vocab_size=100 is smaller than the data's vocabulary",
    )


@pytest.mark.timeout(60)
def test_top_stops_at_ctrl_c_even_when_started_with_sigint_ignored(tmp_path):
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "dptrain", "top", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # a background job's
    try:
        time.sleep(3)  # importing, drawing the first frame
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0


def test_generate_with_truncated_weights_says_so(capsys, tmp_path):
    from safetensors.torch import save_file

    from dptrain.config import Config
    from dptrain.config.load import dump_yaml

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_yaml(Config()))
    import torch

    save_file({"w": torch.zeros(1000)}, str(run / "final" / "model.safetensors"))
    data = (run / "final" / "model.safetensors").read_bytes()
    (run / "final" / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused(capsys, ["generate", str(run)], "cannot be read", "damaged or truncated")


def test_more_workers_than_the_machine_can_start_is_refused_saying_why(capsys):
    refused(
        capsys, ["run", "--nproc-per-node", "4096"], "launch.nproc_per_node=4096 workers on this node's", "CPU core(s)"
    )


def test_an_override_given_twice_with_two_values_is_refused(capsys):
    refused(capsys, ["config", "show", "train.max_steps=3", "train.max_steps=5"],
            "override train.max_steps given twice: train.max_steps=3 and train.max_steps=5")
    assert main(["config", "show", "train.max_steps=3", "train.max_steps=3"]) == 0  # one value twice: one meaning


def returns_text():
    from torch import nn

    class Text(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 1)

        def forward(self, batch):
            return "a loss"

    return Text()


def text_loss(model, batch):
    return "a loss"


def test_a_float_for_an_integer_factory_argument_is_refused(capsys):
    refused(capsys, ["run", "data.kwargs.seq_len=16.5", "--nproc-per-node", "1"],
            "data.kwargs.seq_len=16.5 is not an integer", "seq_len: int")


@pytest.mark.parametrize(("override", "named"), [
    ("model.factory=test_input_errors:returns_text", "the model's forward returned str, not a loss tensor"),
    ("train.loss=test_input_errors:text_loss", "train.loss='test_input_errors:text_loss' returned str"),
])
@pytest.mark.timeout(120)
def test_a_forward_or_loss_returning_no_tensor_is_one_line(capsys, tmp_path, override, named):
    """Found by the run itself (a one-process run here: in this process): exit 2, one line."""
    refused(capsys, ["run", *overrides(TOY_FLAGS, [override, "train.global_batch_size=8", "train.micro_batch_size=8"]),
                     "--out", str(tmp_path / "run")], named)
