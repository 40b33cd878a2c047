"""Issue 26's battery of bad-input, misuse and interrupt cases, run against the real CLI.

Every case runs `python -m dptrain ...` as a subprocess (PYTHONPATH led by this checkout's src/), in a temp
directory of its own, with a timeout, and the script prints a Markdown table: class, case, command, exit code,
the first line of dptrain's message (or "no traceback: ok"), whether a traceback was printed, and the outcome
(clean refusal, other clean exit, traceback, hang, silently wrong). After the table come the facts of the
three composite cases: the orphan test, the double start and the corrupt-only continue.

    nice -n 19 python benchmarks/acceptance/input_battery.py [CASE ...] > /tmp/battery.md

CASE: only the cases whose name contains one of these words (all cases without any).

Tiny configs throughout (the toy MLP with 1 or 2 gloo workers, a few steps), so each case takes seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from support.run_helpers import workers_of  # noqa: E402

SRC = ROOT / "src"
PY = sys.executable
TOY = ["model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
       "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
       "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every_steps=1",
       "train.eval_every_steps=0", "log.progress=false"]
ONE = ["--nproc-per-node", "1"]
TWO = ["--nproc-per-node", "2"]

FACTORIES = '''
import time
import torch
from torch import nn
from torch.utils.data import IterableDataset
from dptrain.models.toy import build_mlp, build_regression_data


class Wrap(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.inner, self.kind = build_mlp(), kind

    def forward(self, batch):
        loss = self.inner(batch)
        return {"tuple": (loss, loss), "str": "a loss", "float": float(loss)}[self.kind]


class Frozen(nn.Module):
    def forward(self, batch):
        return batch[0].sum()


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(10)


def model_tuple(): return Wrap("tuple")
def model_str(): return Wrap("str")
def model_float(): return Wrap("float")
def model_no_params(): return Frozen()
def data_int(): return 5
def data_none(): return None
def data_three():
    d = build_regression_data()
    return d, d, d
def data_iterable(): return Stream()
def data_empty_val(): return build_regression_data(), []
def loss_str(model, batch): return "a loss"
def nan_loss(model, batch): return model(batch) * float("nan")
def slow_loss(model, batch):
    time.sleep(0.02)
    return model(batch)
'''


@dataclass
class Result:
    cmd: str
    rc: int | None  # None: killed at the timeout (a hang)
    output: str
    seconds: float
    expect: str = "refuse"  # refuse (exit 2), ok (exit 0 and `check` holds), or an exit code as text ("130", "4")
    check: bool = True  # the case's own fact (e.g. the value kept literally, the folders untouched)
    note: str = ""


@dataclass
class Row:
    cls: str
    case: str
    result: Result
    facts: list[str] = field(default_factory=list)


BASE = Path(tempfile.mkdtemp(prefix="dptrain-battery-"))
(BASE / "battfx.py").write_text(FACTORIES)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(BASE)]), "OMP_NUM_THREADS": "1"}


def short(argv: list[str], tmp: Path) -> str:
    text = " ".join(argv).replace(str(tmp), "T").replace(str(BASE), "B").replace(" ".join(TOY), "TOY")
    for key in ("model.factory", "data.factory"):  # TOY with one factory replaced
        text = text.replace(" ".join(t for t in TOY if not t.startswith(key)), f"TOY(but {key})")
    return text if len(text) <= 110 else text[:107] + "..."


def dp(argv: list[str], tmp: Path, *, timeout: float = 120, prefix: list[str] | None = None) -> Result:
    """`dptrain ARGV` in `tmp`; killed (process group) at `timeout`."""
    t0 = time.monotonic()
    return finish(popen(argv, tmp, prefix=prefix), argv, tmp, t0, timeout)


def popen(argv: list[str], tmp: Path, *, prefix: list[str] | None = None) -> subprocess.Popen:
    """`dptrain ARGV` (or `PREFIX ARGV`) started in `tmp`, in a process group of its own."""
    return subprocess.Popen([*(prefix or [PY, "-m", "dptrain"]), *argv], cwd=tmp, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, argv: list[str], tmp: Path, t0: float, timeout: float = 150) -> Result:
    """Wait for `proc` (started at `t0`); killed (process group) at `timeout`."""
    try:
        out, rc = proc.communicate(timeout=timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, rc = proc.communicate()[0] + f"\n[killed after {timeout:.0f} s]", None
    return Result("dptrain " + short(argv, tmp), rc, out, time.monotonic() - t0)


def run_argv(out: Path, *overrides: str, nproc: list[str] = ONE) -> list[str]:
    """`run` of the toy recipe with `overrides` on top (an override replaces TOY's setting of its key)."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return ["run", *[t for t in TOY if t.split("=", 1)[0] not in keys], *overrides, *nproc, "--out", str(out)]


# ------------------------------------------------------------------------------------------ run-dir helpers
def losses(run_dir: Path) -> list[tuple[int, str]]:
    out = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in rec and rec["loss"] is not None:
            out.append((rec["step"], float.hex(rec["loss"])))
    return out


def weights(run_dir: Path) -> str:
    path = run_dir / "final" / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "(no final weights)"


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def step_dirs(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())


def children_workers(pid: int) -> list[tuple[int, str]]:
    """(pid, RANK) of the worker processes below `pid`."""
    found = []
    try:
        for c in psutil.Process(pid).children(recursive=True):
            try:
                if "dptrain.launch.worker" in " ".join(c.cmdline()):
                    found.append((c.pid, c.environ().get("RANK", "?")))
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return found


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(s >= step for s, _ in losses(run_dir)):
            return True
        time.sleep(0.05)
    return False


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_BASE_RUN: list[Path] = []


def base_run() -> Path:
    """A finished toy run (1 worker, 4 steps, checkpoints at 2 and 4), made once; cases copy it."""
    if not _BASE_RUN:
        out = BASE / "base_run"
        r = dp(run_argv(out, "train.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=null"), BASE)
        if r.rc != 0:
            raise SystemExit(f"the base run failed:\n{r.output[-3000:]}")
        _BASE_RUN.append(out)
    return _BASE_RUN[0]


def copy_base(tmp: Path, name: str = "run") -> Path:
    dst = tmp / name
    shutil.copytree(base_run(), dst)
    return dst


# -------------------------------------------------------------------------------------------------- cases
CASES: list[tuple[str, str, Callable[[Path], Result | tuple[Result, list[str]]]]] = []


def case(cls: str, name: str):
    def add(fn):
        CASES.append((cls, name, fn))
        return fn
    return add


def simple(cls: str, name: str, argv: list[str], **kw) -> None:
    """A case that is one command; `T` in argv is the case's temp dir."""
    def fn(tmp: Path) -> Result:
        r = dp([a.replace("T/", f"{tmp}/") for a in argv], tmp)
        for k, v in kw.items():
            setattr(r, k, v)
        return r
    CASES.append((cls, name, fn))


LOSE, SILENT, TB, HANG, UNCLEAR, OTHER, NAN = (
    "losing data", "silently wrong", "traceback", "hang", "unclear", "other subcommands", "NaN loss")


# ---------------------------------------------------------------------------------------- losing data
@case(LOSE, "launcher SIGKILLed mid-run (orphans), then the same command")
def orphan(tmp: Path):
    steps = ["train.max_steps=40", "checkpoint.every_steps=1000", "train.loss=battfx:slow_loss"]
    ref = dp(run_argv(tmp / "reference", *steps, nproc=TWO), tmp, timeout=200)
    facts = [f"reference run (uninterrupted): exit {ref.rc}"]
    out = tmp / "run"
    argv = run_argv(out, *steps, nproc=TWO)
    proc = popen(argv, tmp)
    t0 = time.monotonic()
    reached = wait_for_step(out, 5, proc)
    n_workers = len(workers_of(out))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = time.monotonic()
    while workers_of(out) and time.monotonic() - killed_at < 30:
        time.sleep(0.05)
    gone = time.monotonic() - killed_at
    left = workers_of(out)
    for pid in left:  # do not leave orphans behind on this machine
        os.kill(pid, signal.SIGKILL)
    saved = [p.name for p in step_dirs(out)]
    facts += [f"step 5 reached before the kill: {reached}; workers alive at the kill: {n_workers}",
              f"workers gone {gone:.1f} s after the launcher's SIGKILL (still alive after 30 s: {len(left)})",
              f"checkpoints saved on the way out: {saved or 'none'}"]
    again = dp(argv, tmp, timeout=200)
    locked = "in use by another dptrain job" in again.output
    resumed = [ln for ln in again.output.splitlines() if "resumed from" in ln]
    same_losses, same_weights = losses(out) == losses(tmp / "reference"), weights(out) == weights(tmp / "reference")
    facts += [f"same command at once: exit {again.rc}; run dir locked: {locked}; "
              f"{resumed[0].strip() if resumed else 'no resume line'}",
              f"resumed run vs uninterrupted: losses identical at every step: {same_losses}; "
              f"final weights sha256 identical: {same_weights} ({weights(out)[:16]})"]
    again.cmd = "dptrain " + short(argv, tmp) + "; kill -9 LAUNCHER; same command"
    again.expect, again.check = "ok", not left and gone < 10 and same_losses and same_weights and not locked
    again.seconds += time.monotonic() - t0 + ref.seconds
    return again, facts


@case(LOSE, "the same command again while the first job runs")
def double_start(tmp: Path):
    out = tmp / "run"
    argv = run_argv(out, "train.max_steps=100000", "checkpoint.every_steps=0", nproc=TWO)
    first = popen(argv, tmp)
    facts = []
    try:
        wait_for_step(out, 2, first)
        size = (out / "metrics.jsonl").stat().st_size
        second = dp(argv, tmp, timeout=90)
        facts.append(f"second command: exit {second.rc} in {second.seconds:.1f} s; first job still running: "
                     f"{first.poll() is None}; its metrics.jsonl grew on: "
                     f"{(out / 'metrics.jsonl').stat().st_size >= size}")
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        try:
            first.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(first.pid, signal.SIGKILL)
    facts.append(f"first job after SIGTERM: exit {first.returncode}")
    second.cmd = "dptrain " + short(argv, tmp) + " (twice, the first still running)"
    return second, facts


@case(LOSE, "every checkpoint corrupt, then the same command (implicit continue)")
def corrupt_continue(tmp: Path):
    out = copy_base(tmp)
    folders = step_dirs(out)
    flip(folders[0] / "model.pt")
    (folders[1] / "optim.pt").write_bytes((folders[1] / "optim.pt").read_bytes()[:64])
    (folders[1] / "stray.bin").write_bytes(b"x")
    before = tree_hashes(out / "checkpoints")
    r = dp(run_argv(out, "train.max_steps=8"), tmp)
    after = tree_hashes(out / "checkpoints")
    named = [d.name for d in folders if f"{d}: corrupt" in r.output]
    r.check = before == after
    return r, [f"corrupted: {folders[0].name}/model.pt (a flipped byte), {folders[1].name}/optim.pt (truncated "
               f"to 64 bytes) and a stray file in {folders[1].name}",
               f"folders named with their defect: {named}",
               f"sha256 of all {len(before)} files under checkpoints/ before == after: {before == after}"]


# ------------------------------------------------------------------------------------- silently wrong
simple(SILENT, "a duplicated override key with two values", ["run", "train.max_steps=3", "train.max_steps=5",
                                                             "--out", "T/r"])


@case(SILENT, "duplicate keys in YAML")
def dup_yaml(tmp: Path) -> Result:
    (tmp / "cfg.yaml").write_text("train:\n  max_steps: 3\n  max_steps: 5\n")
    return dp(["run", str(tmp / "cfg.yaml"), "--out", str(tmp / "r")], tmp)


@case(SILENT, "duplicate keys in JSON")
def dup_json(tmp: Path) -> Result:
    (tmp / "cfg.json").write_text('{"train": {"max_steps": 3, "max_steps": 5}}')
    return dp(["run", str(tmp / "cfg.json"), "--out", str(tmp / "r")], tmp)


@case(SILENT, "native JSON config with a misspelled section")
def json_section(tmp: Path) -> Result:
    (tmp / "cfg.json").write_text('{"train": {"max_steps": 3}, "trian": {"seed": 1}}')
    return dp(["run", str(tmp / "cfg.json"), "--out", str(tmp / "r")], tmp)


simple(SILENT, "--out given twice", ["run", "--out", "T/a", "--out", "T/b", "train.max_steps=1"])
simple(SILENT, "--out and log.out_dir disagreeing", ["run", "--out", "T/a", "log.out_dir=T/b", "train.max_steps=1"])
simple(SILENT, "--nproc-per-node and launch.nproc_per_node disagreeing",
       ["run", "--nproc-per-node", "2", "launch.nproc_per_node=1", "train.max_steps=1", "--out", "T/r"])
simple(SILENT, "an option value that looks like an override", ["run", "--out", "train.max_steps=3"])


@case(SILENT, "' #' inside a value (a string field): kept literally")
def hash_kept(tmp: Path) -> Result:
    r = dp(["config", "show", "log.out_dir=runs/a #1"], tmp)
    r.expect, r.check = "ok", "out_dir: 'runs/a #1'" in r.output
    r.note = "out_dir: 'runs/a #1' shown" if r.check else "the value was cut"
    return r


simple(SILENT, "' #' inside a value (an integer field): refused", ["run", "train.max_steps=5 #x", "--out", "T/r"])
simple(SILENT, "data.kwargs.seq_len=16.5", ["run", "data.kwargs.seq_len=16.5", "--nproc-per-node", "1",
                                            "--out", "T/r"])
simple(SILENT, "an empty validation split", [*run_argv(Path("T/r"), "data.factory=battfx:data_empty_val",
                                                       "train.max_steps=1")])
simple(SILENT, "--out '' (an unset shell variable)", ["run", "--out", "", "train.max_steps=1"])

# ----------------------------------------------------------------------------------------- tracebacks
for o in ["parallel.bucket_cap_mb=1e308", "parallel.timeout_s=1e300", "parallel.timeout_s=0.001",
          "log.status_every_s=1e300"]:
    simple(TB, o, ["run", *TOY, o, *ONE, "--out", "T/r"])
simple(TB, "a vocabulary smaller than the byte corpus",
       ["run", "model.kwargs.vocab_size=100", "train.max_steps=1", *ONE, "--out", "T/r"])


def ds_case(name: str, text: str) -> None:
    @case(TB, name)
    def fn(tmp: Path) -> Result:
        (tmp / "ds.json").write_text(text)
        return dp(["run", str(tmp / "ds.json"), *TOY[:4], *ONE, "--out", str(tmp / "r")], tmp)


ds_case("DeepSpeed zero_optimization.stage a list", '{"train_batch_size": 8, "zero_optimization": {"stage": [2]}}')
ds_case("DeepSpeed scheduler.type a list", '{"train_batch_size": 8, "scheduler": {"type": ["WarmupLR"]}}')
ds_case("DeepSpeed fp16.initial_scale_power 5000",
        '{"train_batch_size": 8, "fp16": {"enabled": true, "initial_scale_power": 5000}}')
for name, o in [("a model returning a tuple", "model.factory=battfx:model_tuple"),
                ("a model returning a string", "model.factory=battfx:model_str"),
                ("a model returning a float", "model.factory=battfx:model_float"),
                ("a model with no parameters", "model.factory=battfx:model_no_params"),
                ("a data factory returning int", "data.factory=battfx:data_int"),
                ("a data factory returning None", "data.factory=battfx:data_none"),
                ("a data factory returning a 3-tuple", "data.factory=battfx:data_three"),
                ("a data factory returning an IterableDataset", "data.factory=battfx:data_iterable"),
                ("train.loss returning a string", "train.loss=battfx:loss_str")]:
    simple(TB, name, run_argv(Path("T/r"), o, "train.max_steps=2"))


@case(TB, "--resume of a run of another model")
def resume_other(tmp: Path) -> Result:
    src = copy_base(tmp)
    return dp(run_argv(tmp / "new", "model.kwargs.hidden=8", "train.max_steps=6") + ["--resume", str(src)], tmp)


@case(TB, "continuing a run whose config.yaml was edited (model.kwargs)")
def resume_edited(tmp: Path) -> Result:
    src = copy_base(tmp)
    cfg = (src / "config.yaml").read_text()
    (src / "config.yaml").write_text(cfg.replace("kwargs: {}", "kwargs: {hidden: 8}", 1))
    r = dp(["run", "train.max_steps=6", "--out", str(src)], tmp)
    r.note = "config.yaml's model.kwargs edited to {hidden: 8}" if "hidden: 8" in (src / "config.yaml").read_text() \
        else "(the edit did not apply)"
    return r


for name, target in [("--out under /proc", "--out=/proc/dptrain-run"), ("--out under /sys", "--out=/sys/dptrain-run"),
                     ("checkpoint.dir under /proc", "checkpoint.dir=/proc/dptrain-ckpt"),
                     ("checkpoint.dir under /sys", "checkpoint.dir=/sys/dptrain-ckpt")]:
    argv = run_argv(Path("T/r"), "train.max_steps=2")
    if target.startswith("--out="):
        argv = [*argv[:-2], "--out", target.split("=", 1)[1]]
    else:
        argv.insert(-2, target)
    simple(TB, name, argv)


@case(TB, "--out on a full file system (1 MiB tmpfs)")
def full_fs(tmp: Path):
    mnt = tmp / "full"
    mnt.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if m.returncode != 0:
        return Result("(skipped)", -1, "", 0, note=f"skipped: mount -t tmpfs failed ({m.stderr.strip()[:80]})"), []
    try:
        with open(mnt / "filler", "wb") as f:  # fill it up
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        r = dp(run_argv(mnt / "run", "train.max_steps=4", "checkpoint.every_steps=2"), tmp)
        return r, [f"tmpfs of 1 MiB at T/full, filled before the run: {shutil.disk_usage(mnt).free} bytes free"]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def two_nodes(endpoint: str, rank: int) -> list[str]:
    return ["launch.nnodes=2", f"launch.node_rank={rank}", f"launch.rdzv_endpoint={endpoint}",
            "launch.rdzv_conf=join_timeout=3"]


@case(TB, "rendezvous nobody hosts (node_rank 1, join_timeout=3)")
def rdzv_nohost(tmp: Path) -> Result:
    return dp(run_argv(tmp / "r", "train.max_steps=2", *two_nodes(f"127.0.0.1:{free_port()}", 1)), tmp, timeout=90)


@case(TB, "rendezvous the other node never joins (node_rank 0, join_timeout=3)")
def rdzv_nopeer(tmp: Path) -> Result:
    return dp(run_argv(tmp / "r", "train.max_steps=2", *two_nodes(f"127.0.0.1:{free_port()}", 0)), tmp, timeout=90)


simple(TB, "rendezvous on an unresolvable host",
       run_argv(Path("T/r"), "train.max_steps=2", *two_nodes("no-such-host.invalid:29500", 1)))


@case(TB, "SIGKILL of rank 1 with --max-restarts 2")
def kill_rank1(tmp: Path):
    argv = run_argv(tmp / "run", "train.loss=battfx:slow_loss", "train.max_steps=20", "checkpoint.every_steps=5",
                    nproc=TWO) + ["--max-restarts", "2"]
    t0 = time.monotonic()
    proc = popen(argv, tmp)
    reached = wait_for_step(tmp / "run", 8, proc, timeout=120)
    victim = [pid for pid, rank in children_workers(proc.pid) if rank == "1"]
    if victim:
        os.kill(victim[0], signal.SIGKILL)
    r = finish(proc, argv, tmp, t0)
    r.expect = "ok"
    r.cmd += "; kill -9 RANK-1 WORKER at step 8"
    restarted = "restart 1" in r.output and "resumed from" in r.output
    return r, [f"step 8 reached: {reached}; rank 1 killed: {bool(victim)}; restarted and resumed: {restarted}"]


@case(TB, "Ctrl-C in the instant the launcher spawns its first worker")
def ctrl_c_spawn(tmp: Path) -> Result:
    argv = run_argv(tmp / "run", "train.max_steps=3", nproc=TWO)
    t0 = time.monotonic()
    proc = popen(argv, tmp)
    while not children_workers(proc.pid) and proc.poll() is None and time.monotonic() - t0 < 60:
        time.sleep(0.001)
    os.killpg(proc.pid, signal.SIGINT)
    r = finish(proc, argv, tmp, t0, timeout=90)
    r.expect, r.cmd = "130", r.cmd + "; Ctrl-C at the first worker's spawn"
    r.check = "KeyboardInterrupt" not in r.output
    return r


# ---------------------------------------------------------------------------------------------- hangs
@case(HANG, "rendezvous port already taken by another program")
def port_taken(tmp: Path) -> Result:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        return dp(run_argv(tmp / "r", "train.max_steps=2", *two_nodes(f"127.0.0.1:{port}", 0)), tmp, timeout=90)


# -------------------------------------------------------------------------------------------- unclear
simple(UNCLEAR, "train.max_steps without '='", ["run", "train.max_steps", "--out", "T/r"])


@case(UNCLEAR, "a config from a FIFO")
def fifo(tmp: Path) -> Result:
    path = tmp / "cfg"
    os.mkfifo(path)
    writer = subprocess.Popen(["sh", "-c", f"printf 'train: {{max_steps: 4}}\\n' > {path}"])
    r = dp(["config", "show", str(path)], tmp, timeout=60)
    writer.kill()
    r.expect, r.check = "ok", "max_steps: 4" in r.output
    r.note = "read: max_steps: 4" if r.check else "not read"
    return r


@case(UNCLEAR, "a config from a /dev/fd pipe (bash <(...))")
def devfd(tmp: Path) -> Result:
    r = dp(["-c", f"{PY} -m dptrain config show <(printf 'train: {{max_steps: 4}}\\n')"], tmp, timeout=60,
           prefix=["bash"])
    r.cmd = "dptrain config show <(printf 'train: {max_steps: 4}')"
    r.expect, r.check = "ok", "max_steps: 4" in r.output
    r.note = "read: max_steps: 4" if r.check else "not read"
    return r


simple(UNCLEAR, "--nproc-per-node 4096 on 2 cores", ["run", "--nproc-per-node", "4096", "--out", "T/r"])


@case(UNCLEAR, "Ctrl-C 1 s into the launcher's checks, then the same command")
def ctrl_c_checks(tmp: Path):
    argv = run_argv(tmp / "run", "train.max_steps=3", nproc=TWO)
    t0 = time.monotonic()
    proc = popen(argv, tmp)
    time.sleep(1.0)
    spawned = bool(children_workers(proc.pid))
    os.killpg(proc.pid, signal.SIGINT)
    first = finish(proc, argv, tmp, t0, timeout=90)
    said = [ln for ln in first.output.splitlines() if ln.startswith("dptrain")] or ["(no dptrain: line)"]
    first_line = said[-1]
    again = dp(argv, tmp, timeout=150)
    again.cmd += " (after a Ctrl-C 1 s in)"
    again.expect, again.check = "clean", first.rc != 0  # a Ctrl-C that the run ignored (trained on, exit 0) is wrong
    again.note = f"the Ctrl-C'd run itself: exit {first.rc}"
    return again, [f"Ctrl-C 1 s in (workers spawned yet: {spawned}): exit {first.rc}, "
                   f"traceback: {'Traceback' in first.output}, says: {first_line[:140]}",
                   f"the same command then: exit {again.rc}, steps logged {[s for s, _ in losses(tmp / 'run')]}"]


@case(UNCLEAR, "Ctrl-C at every 0.2 s of the launcher's first 4 s (imports, checks, rendezvous, spawn)")
def ctrl_c_sweep(tmp: Path):
    argv = run_argv(tmp / "run", "train.max_steps=3", nproc=TWO)
    seen: dict[str, list[float]] = {}
    worst: Result | None = None  # the first run that did not end with exit 130 and no traceback
    t00 = time.monotonic()
    for i in range(1, 21):
        delay = round(0.2 * i, 1)
        shutil.rmtree(tmp / "run", ignore_errors=True)
        t0 = time.monotonic()
        proc = popen(argv, tmp)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        r = finish(proc, argv, tmp, t0, timeout=90)
        kind = f"exit {r.rc}" + (" with a traceback" if "Traceback" in r.output else "")
        seen.setdefault(kind, []).append(delay)
        if kind != "exit 130" and worst is None:
            worst = r
    r = Result("dptrain " + short(argv, tmp) + "; Ctrl-C at 0.2, 0.4, ... 4.0 s (20 runs)",
               130 if worst is None else worst.rc, "" if worst is None else worst.output, time.monotonic() - t00)
    r.expect = "130"
    r.note = "; ".join(f"{k}: {len(v)} (at {', '.join(map(str, v))} s)" for k, v in seen.items())
    return r, [f"Ctrl-C sweep: {r.note}"]


# ------------------------------------------------------------------------------------ other subcommands
simple(OTHER, "ckpt ls on a missing path", ["ckpt", "ls", "T/missing"])


@case(OTHER, "ckpt ls on a file")
def ls_file(tmp: Path) -> Result:
    (tmp / "f.txt").write_text("x")
    return dp(["ckpt", "ls", str(tmp / "f.txt")], tmp)


@case(OTHER, "ckpt export of an empty directory")
def export_empty(tmp: Path) -> Result:
    (tmp / "empty").mkdir()
    r = dp(["ckpt", "export", str(tmp / "empty"), "--out", str(tmp / "m.safetensors")], tmp)
    r.expect = "nonzero"
    return r


@case(OTHER, "ckpt export of a run whose every checkpoint is corrupt")
def export_corrupt(tmp: Path) -> Result:
    out = copy_base(tmp)
    for d in step_dirs(out):
        flip(d / "model.pt")
    r = dp(["ckpt", "export", str(out), "--out", str(tmp / "m.safetensors")], tmp)
    r.expect = "nonzero"
    return r


simple(OTHER, "plan --params nan", ["plan", "--params", "nan", "--gpus", "8"])


@case(OTHER, "report on a directory that is not a run")
def report_nonrun(tmp: Path) -> Result:
    (tmp / "notarun").mkdir()
    return dp(["report", str(tmp / "notarun")], tmp)


@case(OTHER, "top (live) on an empty directory, then Ctrl-C after 3 s")
def top_ctrl_c(tmp: Path) -> Result:
    (tmp / "empty").mkdir()
    argv = ["top", str(tmp / "empty")]
    t0 = time.monotonic()
    proc = subprocess.Popen([PY, "-m", "dptrain", *argv], cwd=tmp, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    r = finish(proc, argv, tmp, t0, timeout=15)
    r.expect, r.cmd = "ok", r.cmd + "; Ctrl-C after 3 s (started with SIGINT ignored, as a background job)"
    return r


simple(OTHER, "manifest slurm --nproc-per-node 0", ["manifest", "slurm", "--nnodes", "1", "--nproc-per-node", "0"])
simple(OTHER, "manifest slurm --nproc-per-node -1", ["manifest", "slurm", "--nnodes", "1", "--nproc-per-node", "-1"])


def out_case(name: str, argv_of: Callable[[Path, str], list[str]], where: str) -> None:
    @case(OTHER, name)
    def fn(tmp: Path) -> Result:
        (tmp / "afile").write_text("x")
        target = where.replace("AFILE", str(tmp / "afile"))
        return dp(argv_of(tmp, target), tmp)


def _with_run(tmp: Path) -> Path:
    return copy_base(tmp)


for where, label in [("/proc/dptrain-x", "under /proc"), ("AFILE/x", "under a file")]:
    out_case(f"plan --write {label}", lambda t, w: ["plan", "--model", "llama-7b", "--gpus", "8", "--recommend",
                                                    "--write", w], where)
    out_case(f"report --out {label}", lambda t, w: ["report", str(_with_run(t)), "--out", w], where)
    out_case(f"bench --out {label}", lambda t, w: ["bench", "--out", w, *TOY[:4], "--steps", "1"], where)
    out_case(f"doctor --comm --json {label}", lambda t, w: ["doctor", "--comm", "--json", w], where)
    out_case(f"ckpt export --out {label}", lambda t, w: ["ckpt", "export", str(_with_run(t)), "--out", w], where)


@case(OTHER, "generate with a truncated model.safetensors")
def gen_truncated(tmp: Path) -> Result:
    run = tmp / "run"
    make = (
        "import sys, torch; from pathlib import Path; from safetensors.torch import save_file; "
        "from dptrain.config import Config; from dptrain.config.load import dump_yaml; run = Path(sys.argv[1]); "
        "(run / 'final').mkdir(parents=True); (run / 'config.yaml').write_text(dump_yaml(Config())); "
        "w = run / 'final' / 'model.safetensors'; save_file({'w': torch.zeros(1000)}, str(w)); "
        "w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])"
    )
    subprocess.run([PY, "-c", make, str(run)], env=ENV, check=True, timeout=120)
    return dp(["generate", str(run)], tmp)


simple(OTHER, "launch of a missing script", ["launch", "T/missing_train.py"])


@case(OTHER, "dptrain launch --help imports torch?")
def launch_help(tmp: Path) -> Result:
    r = dp(["-X", "importtime", "-m", "dptrain", "launch", "--help"], tmp, prefix=[PY])
    r.cmd = "dptrain launch --help"
    torch = [ln for ln in r.output.splitlines() if ln.startswith("import time:") and ln.rstrip().endswith("| torch")]
    r.output = "\n".join(ln for ln in r.output.splitlines() if not ln.startswith("import time:"))
    r.expect, r.check = "ok", not torch
    r.note = f"torch imported: {bool(torch)}; {r.seconds:.2f} s"
    return r


# ------------------------------------------------------------------------------------------------ NaN
for policy in ("error", "skip"):
    simple(NAN, f"NaN loss with diagnostics.nonfinite={policy}" + (" (every step skipped)" if policy == "skip" else ""),
           run_argv(Path("T/r"), "train.loss=battfx:nan_loss", f"diagnostics.nonfinite={policy}",
                    "diagnostics.max_consecutive_skips=2", "train.max_steps=6", "optim.grad_clip=null", nproc=TWO),
           expect="4")


# ------------------------------------------------------------------------------------------------ table
# expect: "refuse" (exit 2), "ok" (exit 0), "nonzero" (any failure exit), "clean" (0 or 2), or one exit code
def first_message(r: Result) -> str:
    lines = [ln.strip() for ln in r.output.splitlines() if ln.strip()]
    said = next((ln for ln in lines if ln.startswith(("dptrain: error", "dptrain: stopped", "dptrain: interrupted"))
                 or (ln.startswith("dptrain") and ": error:" in ln)), None)
    if said is None:
        said = next((ln for ln in lines if "error" in ln.lower()), None)
    if r.rc is None:
        return "(no message: killed at the timeout)" if said is None else said
    if r.rc == 0 and r.expect not in ("ok", "nonzero", "clean"):
        return "(exit 0 without a message)" + (f" ({r.note})" if r.note else "")
    if r.rc == 0 and not (said and said.startswith("dptrain: error")):
        return "no traceback: ok" + (f" ({r.note})" if r.note else "")
    return (said or (lines[0] if lines else "(no output)")) + (f" ({r.note})" if r.note else "")


def outcome(r: Result) -> str:
    if r.cmd == "(skipped)":
        return "skipped"
    if r.rc is None:
        return "hang"
    if "Traceback (most recent call last)" in r.output or "KeyboardInterrupt" in r.output:
        return "traceback"
    wanted = {"refuse": r.rc == 2, "ok": r.rc == 0, "nonzero": r.rc != 0, "clean": r.rc in (0, 2)}.get(
        r.expect, str(r.rc) == r.expect)
    if not wanted or not r.check:
        return "silent/wrong" if r.rc == 0 else "unexpected exit"
    return "clean refusal (2)" if r.rc == 2 else f"clean exit {r.rc}"


def md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("only", nargs="*", metavar="CASE", help="run only the cases whose name contains one of these")
    only = ap.parse_args().only
    rows: list[Row] = []
    t_all = time.monotonic()
    for cls, name, fn in CASES:
        if only and not any(o in name for o in only):
            continue
        tmp = Path(tempfile.mkdtemp(prefix="case-", dir=BASE))
        try:
            got = fn(tmp)
        except Exception as e:  # the battery's own failure, not dptrain's: say so in the row
            got = Result("(battery error)", -1, f"battery error: {type(e).__name__}: {e}", 0, check=False)
        r, facts = got if isinstance(got, tuple) else (got, [])
        rows.append(Row(cls, name, r, facts))
        print(f"[{time.monotonic() - t_all:6.0f} s] {outcome(r):18} {cls}: {name} ({r.seconds:.1f} s)",
              file=sys.stderr, flush=True)

    print("| class | case | command (short) | exit code | first line of the message | traceback? | outcome | s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        r = row.result
        tb = "yes" if "Traceback (most recent call last)" in r.output else "no"
        rc = "killed (timeout)" if r.rc is None else str(r.rc)
        print(f"| {row.cls} | {md(row.case)} | `{md(r.cmd)}` | {rc} | {md(first_message(r)[:220])} | {tb} | "
              f"{outcome(r)} | {r.seconds:.1f} |")
    print()
    counts = Counter(outcome(row.result) for row in rows)
    print("Outcomes: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + f" ({len(rows)} cases, "
          f"{time.monotonic() - t_all:.0f} s)")
    for row in rows:
        if row.facts:
            print(f"\n**{row.case}**\n")
            for f in row.facts:
                print(f"- {md(f)}")
    bad = [row for row in rows if outcome(row.result) not in ("clean refusal (2)", "skipped")
           and not outcome(row.result).startswith("clean exit")]
    if bad:
        print("\nStill bad:\n")
        for row in bad:
            tail = " ".join(row.result.output.strip().splitlines()[-3:])[:300]
            print(f"- {row.cls}: {row.case}: `{md(row.result.cmd)}` -> {outcome(row.result)}; {md(tail)}")
    shutil.rmtree(BASE, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
