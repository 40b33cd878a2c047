"""Every class of bad input is refused before launch: exit 2, one clean message naming the value,
no traceback. Most cases call `dptrain.cli.main.main` in this process (fast); a subprocess only where
the point is what a real launch prints (one copy of a factory's traceback, not one per rank).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dptrain.cli.main import main
from dptrain.config import ConfigError
from dptrain.config.load import load_config, load_yaml, parse_override, resolve_scalar
from dptrain.config.resolve import _torch_build_has_gpu
from support import ROOT, subprocess_env
from support import overrides as join
from support.cli import refused

TOY = ["model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
       "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
       "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_every_steps=0", "log.progress=false"]
ONE = ["--nproc-per-node", "1", "parallel.strategy=single"]


# ------------------------------------------------------------------ numeric ranges and finiteness
@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("override", "named"), [
    ("optim.lr=inf", "optim.lr=inf is not valid; it must be a finite number > 0"),
    ("optim.lr=.nan", "optim.lr=nan"),
    ("optim.lr=0", "optim.lr=0.0"),
    ("diagnostics.hang_timeout_s=nan", "diagnostics.hang_timeout_s=nan is not valid"),
    ("parallel.bucket_cap_mb=nan", "parallel.bucket_cap_mb=nan is not valid; it must be a finite number in (0, "),
    ("parallel.bucket_cap_mb=1e308", "parallel.bucket_cap_mb=1e+308 is not valid; it must be a finite number in (0, "),
    ("parallel.timeout_s=1e300", "parallel.timeout_s=1e+300 is not valid; it must be a finite number in [1, "),
    ("parallel.timeout_s=0.001", "parallel.timeout_s=0.001 is not valid; it must be a finite number in [1, "),
    ("log.status_every_s=1e300", "log.status_every_s=1e+300 is not valid; it must be a finite number in [0, 86400]"),
    ("precision.init_scale=1e300", "precision.init_scale=1e+300 is not valid; it must be a finite number in (0, "),
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 is not valid; it must be a finite number >= 0"),
    ("precision.init_scale=-1", "precision.init_scale=-1.0 is not valid; it must be a finite number in (0, "),
    ("precision.growth_interval=0", "precision.growth_interval=0 is not valid; it must be an integer >= 1"),
    ("launch.node_rank=-1", "launch.node_rank=-1 is not valid; it must be an integer >= 0"),
    ("launch.node_rank=1", "launch.node_rank=1 is not valid for launch.nnodes=1; it must be in [0, 0]"),
    ("optim.momentum=-0.9", "optim.momentum=-0.9 is not valid; it must be a finite number in [0, 1)"),
    ("optim.betas=[0.9,1.0]", "betas[1]=1.0 must be a finite number in [0, 1)"),
    ("optim.betas=[-0.1,0.9]", "betas[0]=-0.1"),
    ("optim.eps=0", "optim.eps=0.0 is not valid; it must be a finite number > 0"),
    ("train.seed=-1", "train.seed=-1 is not valid; it must be an integer in [0, 9223372036854775807]"),
    ("train.seed=9223372036854775808", "train.seed=9223372036854775808"),
    ("parallel.timeout_s=0", "parallel.timeout_s=0.0 is not valid; it must be a finite number in [1, "),
    ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio=1.5 is not valid; it must be a finite number in [0, 1]"),
    ("optim.grad_clip=-1", "optim.grad_clip=-1.0"),
    ("train.max_steps=0", "train.max_steps=0 is not valid; it must be an integer >= 1"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last=0"),
    ("diagnostics.rss_leak_mb=-inf", "diagnostics.rss_leak_mb=-inf"),
])
def test_numeric_fields_out_of_range_or_not_finite(capsys, tmp_path, override, named):
    refused(capsys, ["run", "--out", str(tmp_path / "r"), override], named)
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ parsing (YAML 1.2 scalars)
@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("override", "named"), [
    ("launch.nnodes=1:2", "launch.nnodes='1:2'"),  # YAML 1.1 would read 62
    ("diagnostics.nonfinite=no", "diagnostics.nonfinite='no'"),  # YAML 1.1 would read False
    ("train.max_steps=five", "train.max_steps='five'"),
    ("parallel.strategy=true", "parallel.strategy=True"),  # a boolean is not a strategy name
])
def test_values_parsed_as_yaml_1_2_then_refused_by_their_field(capsys, tmp_path, override, named):
    refused(capsys, ["run", "--out", str(tmp_path / "r"), override], named)


@pytest.mark.fast
@pytest.mark.timeout(30)
@pytest.mark.parametrize(("text", "value"), [
    ("1:2", "1:2"), ("no", "no"), ("off", "off"), ("yes", "yes"), ("On", "On"), ("y", "y"),
    ("true", True), ("False", False), ("TRUE", True), ("null", None), ("~", None), ("", None),
    ("1e-3", 1e-3), ("3e2", 300.0), ("-2.5", -2.5), (".5", 0.5), ("010", 10), ("0o10", 8), ("0x1F", 31),
    ("+7", 7), (".inf", math.inf), ("-.Inf", -math.inf), ("1_000", "1_000"), ("0b11", "0b11"),
])
def test_yaml_1_2_core_scalars(text, value):
    assert resolve_scalar(text) == value and type(resolve_scalar(text)) is type(value)
    if text:  # the same rule for files: plain scalars inside a mapping
        assert load_yaml(f"k: {text}") == {"k": value}


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_yaml_1_2_in_files_and_overrides_keeps_collections():
    assert load_yaml("a: [0.9, 0.95]\nb: {x: 1:2}\nc: 'yes'\n") == {"a": [0.9, 0.95], "b": {"x": "1:2"}, "c": "yes"}
    assert parse_override("optim.betas=[0.8,0.9]") == ("optim.betas", [0.8, 0.9])
    assert isnan(parse_override("optim.lr=.nan")[1])
    assert load_config(None, ["diagnostics.nonfinite=off"]).diagnostics.nonfinite == "off"


def isnan(x: object) -> bool:
    return isinstance(x, float) and math.isnan(x)


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_overrides_and_options_in_any_order(capsys, tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("train:\n  max_steps: 7\n")
    assert main(["config", "show", str(cfg), "--nproc-per-node", "1", "train.log_every_steps=3",
                 "parallel.strategy=single"]) == 0
    shown = load_yaml(capsys.readouterr().out)
    assert shown["train"]["max_steps"] == 7 and shown["train"]["log_every_steps"] == 3
    assert shown["launch"]["nproc_per_node"] == 1
    # `run CFG --out DIR override`: the override after the option is applied (and here refused by name)
    refused(capsys, ["run", str(cfg), "--out", str(tmp_path / "r"), "train.max_steps=0"], "train.max_steps=0")
    assert main(["config", "show", "train.log_every_steps=3", "--nproc-per-node", "1", str(cfg),
                 "parallel.strategy=single"]) == 0  # CONFIG after overrides and options
    assert load_yaml(capsys.readouterr().out)["train"]["max_steps"] == 7
    refused(capsys, ["config", "show", str(cfg), "train.log_every_steps=3", "other.yaml"], "'other.yaml'")
    # a real unknown option is still refused, by argparse, with exit 2
    refused(capsys, ["run", str(cfg), "--no-such-option"], "--no-such-option")


# ------------------------------------------------------------------ rendezvous endpoints
@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("overrides", "named"), [
    (["launch.nnodes=2"], "launch.nnodes=2 needs launch.rdzv_endpoint=host:port"),
    (["launch.rdzv_endpoint=node0:0"], "launch.rdzv_endpoint='node0:0'"),
    (["launch.rdzv_endpoint=node0:70000"], "launch.rdzv_endpoint='node0:70000'"),
    (["launch.rdzv_endpoint=node0"], "launch.rdzv_endpoint='node0'"),
    (["launch.rdzv_endpoint=fd00::1:29500"], "launch.rdzv_endpoint='fd00::1:29500'"),  # IPv6 needs brackets
    (["launch.rdzv_endpoint=http://node0:29500"], "launch.rdzv_endpoint='http://node0:29500'"),
])
def test_endpoints_are_parsed(capsys, tmp_path, overrides, named):
    refused(capsys, ["run", "--out", str(tmp_path / "r"), *overrides], named, "host:port")


# ------------------------------------------------------------------ config files
@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["non-utf8", "directory", "missing", "unreadable", "not-a-mapping"])
def test_bad_config_files(capsys, monkeypatch, tmp_path, kind):
    path = tmp_path / "recipe.yaml"
    if kind == "non-utf8":
        path.write_bytes("train:\n  max_steps: 5 # caf\xe9\n".encode("latin-1"))
    elif kind == "directory":
        path.mkdir()
    elif kind == "unreadable":
        path.write_text("train: {}\n")
        path.chmod(0)
        if os.geteuid() == 0:  # root reads any file: make reading it fail the way it does for a user
            real = Path.read_text

            def denied(self: Path, *a, **k) -> str:
                if self == path:
                    raise PermissionError(13, "Permission denied", str(path))
                return real(self, *a, **k)

            monkeypatch.setattr(Path, "read_text", denied)
    elif kind == "not-a-mapping":
        path.write_text("- 1\n- 2\n")
    refused(capsys, ["run", str(path), "--out", str(tmp_path / "r")], str(path))


# ------------------------------------------------------------------ run and checkpoint directories
@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("where", "named"), [
    ("out-is-file", "--out="), ("out-under-file", "is a file, not a directory"),
    ("ckpt-is-file", "checkpoint.dir="), ("out-unwritable", "is not writable"),
])
def test_run_and_checkpoint_directories(capsys, monkeypatch, tmp_path, where, named):
    afile = tmp_path / "afile"
    afile.write_text("x")
    out, extra = tmp_path / "run", []
    if where == "out-is-file":
        out = afile
    elif where == "out-under-file":
        out = afile / "run"
    elif where == "ckpt-is-file":
        extra = [f"checkpoint.dir={afile}"]
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        out = locked / "run"
        if os.geteuid() == 0:  # root writes anywhere: answer the access check as for a user
            import dptrain.launch.checks as lc

            real = os.access
            monkeypatch.setattr(lc.os, "access", lambda p, mode: False if Path(p) == locked else real(p, mode))
    where_named = str(afile if where != "out-unwritable" else out)
    refused(capsys, ["run", *TOY, *ONE, "--out", str(out), *extra], named, where_named)


# ------------------------------------------------------------------ factories
@pytest.mark.fast
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["model.kwargs.bogus=1"],
            ["model.factory='dptrain.models.toy:build_mlp'", "'bogus'", "in_dim, hidden, out_dim, depth"],
        ),
        (
            ["model.factory=support.bad_factories:needs_width", "model.kwargs={}"],
            ["model.factory='support.bad_factories:needs_width'", "'width'", "its parameters: width, depth"],
        ),
        (["data.kwargs.rows=4"], ["data.factory='dptrain.models.toy:build_regression_data'", "'rows'"]),
        (
            ["model.factory=support.bad_factories:returns_dict", "model.kwargs={}"],
            ["model.factory='support.bad_factories:returns_dict' returned dict, not a torch.nn.Module"],
        ),
    ],
)
def test_factory_kwargs_and_return_checked_before_launch(capsys, tmp_path, overrides, named):
    refused(capsys, ["run", *join(TOY, ONE, overrides), "--out", str(tmp_path / "r")], *named)
    assert not (tmp_path / "r").exists()


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_builtin_lm_seq_len_longer_than_context(capsys, tmp_path):
    refused(
        capsys,
        ["run", "data.kwargs.seq_len=256", "model.kwargs.max_seq_len=128", "--out", str(tmp_path / "r")],
        "data.kwargs.seq_len=256",
        "model.kwargs.max_seq_len=128",
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("factory", "user_line", "error"),
    [
        (
            "model.factory=support.bad_factories:raising_model",
            'raise ValueError(f"user bug',
            "ValueError: user bug: cannot build 4 layers",
        ),
        (
            "data.factory=support.bad_factories:raising_data",
            "raise FileNotFoundError",
            "FileNotFoundError: user data file for n=8",
        ),
    ],
)
def test_factory_that_raises_shows_one_copy_of_the_users_traceback(tmp_path, factory, user_line, error):
    kwargs = "model.kwargs={}" if factory.startswith("model") else "data.kwargs={}"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dptrain",
            "run",
            *join(TOY, [factory, kwargs]),
            "--nproc-per-node",
            "2",
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=subprocess_env(),
        cwd=ROOT,
    )
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    head = text.strip().splitlines()[0]
    assert head.startswith("dptrain: error: ") and factory.split("=")[1] in head and "raised" in head, text
    assert text.count(user_line) == 1 and text.count(error) == 1, text  # one copy, not one per rank
    assert "bad_factories.py" in text and "launch_checks.py" not in text and "cli.py" not in text, text
    assert "Traceback (most recent call last)" not in text, text
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ generate, ckpt, launch, doctor
@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--max-new-tokens", "-5"], "--max-new-tokens=-5"),
        (["--max-new-tokens", "0"], "--max-new-tokens=0"),
        (["--temperature", "-1"], "--temperature=-1.0"),
        (["--temperature", "nan"], "--temperature=nan"),
        (["--top-k", "-3"], "--top-k=-3"),
    ],
)
def test_generate_arguments(capsys, tmp_path, args, named):
    refused(capsys, ["generate", str(tmp_path), *args], named)


@pytest.fixture
def mlp_run(tmp_path: Path) -> Path:
    """A finished-looking run directory of a model that is not a language model."""
    from safetensors.torch import save_file

    from dptrain.models.toy import build_mlp

    run = tmp_path / "mlp_run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  factory: dptrain.models.toy:build_mlp\n  kwargs: {}\n")
    save_file(
        {k: v.contiguous() for k, v in build_mlp().state_dict().items()}, str(run / "final" / "model.safetensors")
    )
    return run


@pytest.mark.timeout(60)
def test_generate_on_a_run_that_is_not_a_language_model(capsys, mlp_run):
    refused(capsys, ["generate", str(mlp_run)], "dptrain.models.toy:build_mlp", "not a language model")
    # the LM's config with other weights: the weights do not fit
    (mlp_run / "config.yaml").write_text("model:\n  factory: dptrain.models.llama:build_llama\n  kwargs: {dim: 32}\n")
    refused(capsys, ["generate", str(mlp_run)], "model.safetensors", "does not fit")


@pytest.mark.fast
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["ckpt", "export", "RUN", "--out", "DIR"], "is a directory"),
        (["launch", "--nproc-per-node", "0", "train.py"], "--nproc-per-node='0'"),
        (["launch", "--nproc_per_node=-2", "train.py"], "--nproc-per-node='-2'"),
        (["doctor", "--comm", "--nproc-per-node", "0"], "--nproc-per-node=0"),
    ],
)
def test_ckpt_launch_and_doctor_arguments(capsys, tmp_path, argv, named):
    argv = [str(tmp_path) if a in ("RUN", "DIR") else a for a in argv]
    refused(capsys, argv, named)


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_launch_leaves_the_scripts_own_arguments_alone():
    from dptrain.cli.script import _check_nproc_option

    _check_nproc_option(["--nnodes", "1", "train.py", "--nproc-per-node", "0"])  # the script's, not torchrun's
    with pytest.raises(ConfigError, match="'x'"):
        _check_nproc_option(["--standalone", "--nproc-per-node", "x", "train.py"])


# ------------------------------------------------------------------ refusals and fast commands stay light
FAST = """
import sys
from dptrain.cli.main import main
rc = main({argv!r})
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
print("RESULT", rc, heavy)
"""
# `import torch` itself loads torch.distributed's core (c10d, device_mesh, DDP's module); what a
# launch adds on top, and what these commands must not pay for, is the launcher and the strategies.
DIST_STACK = (
    "torch.distributed.run",
    "torch.distributed.elastic",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("argv", "heavy", "rc"),
    [
        (["--help"], ("torch",), 0),
        (["config", "docs"], ("torch",), 0),
        (["ckpt", "ls", "RUN"], ("torch",), 1),  # no checkpoint there: exit 1
        (["run", "optim.lr=inf", "--out", "RUN/x"], ("torch",), 2),
        (["run", "launch.nnodes=1:2"], ("torch",), 2),
        # a CPU build of torch cannot have CUDA, so `auto` device detection needs no torch at all
        (["config", "show"], DIST_STACK if _torch_build_has_gpu() else ("torch",), 0),
        (["run", "train.global_batch_size=7", "--nproc-per-node", "2", "--out", "RUN/x"], DIST_STACK, 2),
        (
            ["run", "train.global_batch_size=7", "--nproc-per-node", "2", "parallel.device=cpu", "--out", "RUN/x"],
            ("torch",),
            2,
        ),
        (["run", *TOY, "model.kwargs.bogus=1", "--out", "RUN/x"], DIST_STACK, 2),
    ],
)
def test_fast_commands_import_no_torch_or_no_distributed_stack(tmp_path, argv, heavy, rc):
    (tmp_path / "config.yaml").write_text("train: {}\n")
    argv = [a.replace("RUN", str(tmp_path)) for a in argv]
    r = subprocess.run(
        [sys.executable, "-c", FAST.format(argv=argv, heavy=heavy)],
        capture_output=True,
        text=True,
        timeout=100,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    assert f"RESULT {rc} []" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


# ------------------------------------------------------------------ strict JSON
@pytest.mark.fast
@pytest.mark.timeout(30)
def test_strict_json_replaces_non_finite_numbers_with_null_and_a_flag():
    from dptrain.metrics import strict_json

    text = strict_json.dumps(
        {"loss": float("nan"), "lr": 1e-3, "norms": [1.0, float("inf")], "sub": {"x": float("-inf")}, "ok": None}
    )
    assert json.loads(text, parse_constant=_reject) == {
        "loss": None,
        "loss_nonfinite": "nan",
        "lr": 1e-3,
        "norms": [1.0, None],
        "norms_nonfinite": "inf",
        "sub": {"x": None, "x_nonfinite": "-inf"},
        "ok": None,
    }


def _reject(name: str) -> None:
    raise ValueError(f"not strict JSON: {name}")


@pytest.mark.timeout(240)
def test_every_json_file_of_a_run_with_a_nan_loss_parses_strictly(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dptrain",
            "run",
            *TOY,
            *ONE,
            "train.loss=support.bad_factories:nan_loss",
            "train.max_steps=4",
            "train.log_every_steps=1",
            "checkpoint.every_steps=2",
            "optim.grad_clip=null",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=200,
        env=subprocess_env(),
        cwd=ROOT,
    )
    files = [p for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")]
    assert any(p.name == "metrics.jsonl" for p in files), r.stdout[-2000:] + r.stderr[-3000:]
    assert any(p.name == "summary.json" for p in files), r.stdout[-2000:] + r.stderr[-3000:]
    nulls = 0
    for p in files:
        for line in p.read_text().splitlines() if p.suffix == ".jsonl" else [p.read_text()]:
            record = json.loads(line, parse_constant=_reject)
            nulls += isinstance(record, dict) and record.get("loss_nonfinite") == "nan"
    assert nulls >= 1, "the NaN loss was not recorded as null + loss_nonfinite"


# ------------------------------------------------------------------ generate: no silent waits
@pytest.mark.fast
@pytest.mark.timeout(60)
def test_generate_reports_progress_and_slides_past_the_context(monkeypatch):
    import io
    import itertools

    import dptrain.cli.generate as gen
    from dptrain.models.llama import build_llama

    model = build_llama(dim=16, n_layers=1, n_heads=2, max_seq_len=8)
    clock = itertools.count(0.0, 0.5)  # every call to the clock advances half a second
    monkeypatch.setattr(gen.time, "monotonic", lambda: next(clock))
    stream = io.StringIO()
    out = gen.generate_bytes(model, "ab", max_new_tokens=20, seed=1, progress=stream)
    assert len(out) == 20  # longer than the 8-byte context: the window slides
    lines = stream.getvalue().splitlines()
    assert lines and all(line.startswith("generate: ") and "/20 bytes" in line for line in lines)
