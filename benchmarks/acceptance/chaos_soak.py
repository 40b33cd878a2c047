"""Chaos soak: a training job on the two-host cluster, faults injected from a seed, the result checked.

The job is the toy MLP recipe under `launch.nnodes=1:2` on dptrain.tools.netns's two-namespace cluster
(one worker per node, node 0 hosts the c10d rendezvous), its run directory on a small tmpfs. From
`--seed`, at random steps, the soak injects `--faults` faults, one after the other once the job trains
again, drawn so that every kind comes up (with 7 faults or more):

- `worker_kill`: SIGKILL one node's worker (torchrun restarts the group from the newest checkpoint);
- `node_loss`: SIGKILL every process in node 1's namespace (node 0 goes on alone, world 2 -> 1);
- `rejoin`: node 1's command started again (world 1 -> 2);
- `sigterm`: SIGTERM one worker (preemption: every rank saves the step it finished, then a restart);
- `stall`: SIGSTOP one worker for 2-6 s, then SIGCONT (nothing restarts);
- `full_disk`: the run directory's tmpfs filled up across a checkpoint save, then freed;
- `corrupt`: the newest committed checkpoint's largest file overwritten in the middle, then a worker
  SIGKILLed so that the resume must find it corrupt and take the one before.

Node 0's processes are never all killed: its agent hosts the rendezvous store (losing it ends the job,
as losing the rank-0 host of any torchrun job does). Every fault is printed with its recovery time
(fault -> the next step trained, from the times the metrics records appeared) and the steps lost
(steps trained before the fault that had to be trained again). At the end the final weights and the
per-step loss record are compared with a reference run of the same seed and batch, made of plain
`dptrain run` segments that change the world size at the same steps as the soak did (its membership
records in attempts.jsonl) through `--resume` of the checkpoint at that step: bit-identical is
required where the world size never changed, and reported in every case.

    python benchmarks/acceptance/chaos_soak.py --seed 1 --faults 20 --md docs/results/chaos_soak.md
    python benchmarks/acceptance/chaos_soak.py --plan worker_kill@6,node_loss@14,rejoin@20   # fixed faults
    python benchmarks/acceptance/chaos_soak.py --overrides checkpoint.snapshot_every_steps=0  # disk only

Needs root (network namespaces, tmpfs). Exit 0 when the comparison holds, 1 when it does not, 2 when
the cluster cannot be built or the job failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for _p in (ROOT / "src", ROOT / "tests"):  # dptrain; tests/support (the toy recipe)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from dptrain.checkpoint import manifest as mf  # noqa: E402
from dptrain.checkpoint.snapshots.folder import run_id  # noqa: E402
from dptrain.checkpoint.snapshots.store import DEFAULT_ROOT  # noqa: E402
from dptrain.tools.netns import Cluster, unavailable_reason  # noqa: E402
from support.run_helpers import TOY_RUN  # noqa: E402

KINDS = ("worker_kill", "node_loss", "rejoin", "sigterm", "stall", "full_disk", "corrupt")
PACE_ENV = "DPTRAIN_CHAOS_PACE_FILE"
RECIPE = [
    *TOY_RUN,
    "optim.name=sgd",
    "train.loss=chaos_soak:paced_loss",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=4",
]
JOB = ["launch.max_restarts=1000"]  # every fault costs a restart of torchrun's budget; the soak's are many
END = "<!-- the soak writes everything above this line -->"


def paced_loss(model: Any, batch: Any) -> Any:
    """The model's own loss after a short sleep (seconds in the file $DPTRAIN_CHAOS_PACE_FILE names, which the
    soak sets to 0 once its last fault is over): steps slow enough to aim faults at; the math is the model's."""
    pace = 0.0
    with contextlib.suppress(OSError, ValueError, TypeError):
        pace = float(Path(os.environ[PACE_ENV]).read_text())
    if pace > 0:
        time.sleep(pace)
    return model(batch)


def joined(*parts: list[str]) -> list[str]:
    """key=value lists joined, a later setting of a key replacing an earlier one (dptrain refuses a key twice)."""
    out: dict[str, str] = {}
    for item in (i for part in parts for i in part):
        out[item.split("=", 1)[0]] = item
    return list(out.values())


# ------------------------------------------------------------------ the faults
@dataclass
class Fault:
    kind: str
    at_step: int
    relative: bool = False  # at_step counts from the step the job trained again after the previous fault
    node: int = 0
    hold_s: float = 0.0
    # filled in by the soak
    injected_step: int | None = None
    t_fault: float | None = None
    t_again: float | None = None
    recovery_s: float | None = None
    resumed_step: int | None = None
    steps_lost: int | None = None
    world_after: int | None = None
    note: str = ""

    def label(self) -> str:
        where = "" if self.kind in ("node_loss", "rejoin", "full_disk", "corrupt") else f" node {self.node}"
        return f"{self.kind}{where}"


def draw_faults(seed: int, count: int, *, first_step: int = 6, gap: tuple[int, int] = (5, 9)) -> list[Fault]:
    """`count` faults at random steps from `seed`: every kind once (when count >= 7) before any repeats,
    node_loss only while node 1 is in the job and rejoin only while it is out."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    node1_up, step = True, first_step
    unused = list(KINDS)
    rng.shuffle(unused)
    for _ in range(count):
        allowed = [k for k in KINDS if (k != "node_loss" or node1_up) and (k != "rejoin" or not node1_up)]
        fresh = [k for k in unused if k in allowed]
        if not node1_up and rng.random() < 0.6:
            kind = "rejoin"  # keep the job at two nodes most of the time
        else:
            kind = fresh[0] if fresh else rng.choice(allowed)
        if kind in unused:
            unused.remove(kind)
        node = rng.randrange(2) if node1_up else 0
        hold = round(rng.uniform(2.0, 6.0), 1) if kind == "stall" else 0.0
        faults.append(Fault(kind, step, relative=True, node=node, hold_s=hold))
        node1_up = {"node_loss": False, "rejoin": True}.get(kind, node1_up)
        step = rng.randint(*gap)
    return faults


def parse_plan(text: str) -> list[Fault]:
    """`kind@step[:node],...`, e.g. `worker_kill@6:1,node_loss@14,rejoin@20`."""
    out = []
    for item in text.split(","):
        kind, _, rest = item.strip().partition("@")
        step, _, node = rest.partition(":")
        if kind not in KINDS or not step.isdigit():
            raise SystemExit(f"--plan item {item!r}: write kind@step[:node] with kind one of {', '.join(KINDS)}")
        out.append(Fault(kind, int(step), node=int(node or 0), hold_s=3.0 if kind == "stall" else 0.0))
    return out


# ------------------------------------------------------------------ watching the job
class Watch:
    """Tails RUN/metrics.jsonl (every 20 ms): each step record with the time it appeared."""

    def __init__(self, run: Path) -> None:
        self.path = run / "metrics.jsonl"
        self.rows: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._pos = 0
        self._inode: int | None = None
        self._buf = ""
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            self.poll()

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode:  # a new file (a restart from step 0 moves the old one to previous/)
                    self._inode, self._pos, self._buf = st.st_ino, 0, ""
                elif st.st_size < self._pos:  # a resume cut the records after its step (checkpoint/resume.py)
                    self._pos, self._buf = st.st_size, ""
                f.seek(self._pos)
                chunk = f.read()
                self._pos = f.tell()
        except OSError:
            return
        now = time.time()
        self._buf += chunk
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if "loss" in rec and "step" in rec:
                    self.rows.append((float(rec.get("time", now)), rec))

    def stop(self) -> None:
        self._stop.set()
        self._t.join()
        self.poll()

    def last_step(self) -> int:
        return self.rows[-1][1]["step"] if self.rows else 0

    def since(self, t: float) -> list[tuple[float, dict]]:
        return [(ti, r) for ti, r in self.rows if ti > t]


def progress(run: Path) -> dict:
    try:
        return json.loads((run / "attempts" / "rank0.json").read_text())
    except (OSError, ValueError):
        return {}


def worker_pid(c: Cluster, node: int) -> int | None:
    """The pid of the process that trains `node`'s worker: the dptrain worker itself, or with warm spares
    (launch.warm_workers) the process the node's warm server forked for it (a stall must stop that one)."""
    cold = None
    for pid in c.pids(node):
        with contextlib.suppress(OSError, ValueError, IndexError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"dptrain.launch.warm_server" in cmd:
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                if b"dptrain.launch.warm_server" in Path(f"/proc/{ppid}/cmdline").read_bytes():
                    return pid  # forked by the server (the server's own parent is the launcher)
            elif b"dptrain.launch.worker" in cmd and cold is None:
                cold = pid
    return cold


def newest_checkpoint(run: Path) -> Path | None:
    """The newest committed checkpoint whose files match its manifest (what `--resume auto` would take)."""
    for d in reversed(mf.step_dirs(run / "checkpoints")):
        if mf.inspect_dir(d).valid:
            return d
    return None


def corrupt(ckpt: Path) -> str:
    files = sorted((p for p in ckpt.rglob("*") if p.is_file() and p.stat().st_size > 0), key=lambda p: p.stat().st_size)
    big = files[-1]
    data = bytearray(big.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes((b ^ 0xFF) for b in data[mid : mid + 16])
    big.write_bytes(bytes(data))
    return str(big.relative_to(ckpt.parent.parent))


class Job:
    """The soak's job: one `dptrain run` per node of a fresh cluster, its run directory on a tmpfs."""

    def __init__(self, c: Cluster, run: Path, items: list[str], *, env: dict[str, str], logs: Path) -> None:
        self.c, self.run, self.items, self.env, self.logs = c, run, items, env, logs
        self.procs: dict[int, subprocess.Popen] = {}
        self.starts = {0: 0, 1: 0}
        self._pumps: list[threading.Thread] = []

    def start(self, node: int) -> None:
        self.starts[node] += 1
        argv = [sys.executable, "-m", "dptrain", "run", *self.items, *self.c.launch_overrides(node, nnodes="1:2"),
                "--nproc-per-node", "1", "--out", str(self.run)]
        p = self.c.popen(node, argv, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.procs[node] = p
        log = open(self.logs / f"node{node}.{self.starts[node]}.log", "w")  # noqa: SIM115 - closed by the pump

        def pump() -> None:
            assert p.stdout is not None
            with log:
                for line in iter(p.stdout.readline, b""):
                    log.write(f"{time.time():.3f} {line.decode(errors='replace')}")
                    log.flush()

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        self._pumps.append(t)

    def failed(self) -> str | None:
        p = self.procs.get(0)
        if p is not None and p.poll() is not None:
            return f"node 0's launcher exited {p.returncode}" + (" (the job finished)" if p.returncode == 0 else "")
        return None

    def tail(self) -> str:
        logs = sorted(self.logs.glob("node*.log"))
        return "\n----\n".join(f"{p.name}:\n{p.read_text()[-2500:]}" for p in logs)


def wait_for(cond: Any, *, timeout: float, job: Job, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        why = job.failed()
        if why or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not reached ({why or f'timed out after {timeout:.0f}s'})\n{job.tail()}")
        time.sleep(0.02)


def inject(job: Job, watch: Watch, f: Fault, *, disk: Path, log: Any) -> None:
    """Inject `f` once the job has trained `f.at_step` (counted from the previous fault's recovery when
    `f.relative`), then wait until it trains again."""
    run, c = job.run, job.c
    target = f.at_step + (log["base"] if f.relative else 0)
    wait_for(lambda: watch.last_step() >= target, timeout=300, job=job, what=f"step {target}")
    before_pid = progress(run).get("pid")
    f.injected_step = watch.last_step()
    restarts = True
    if f.kind in ("worker_kill", "corrupt", "sigterm", "stall"):
        pid = worker_pid(c, f.node)
        if pid is None:
            raise RuntimeError(f"{f.label()}: no worker on node {f.node}\n{job.tail()}")
    if f.kind == "corrupt":
        ckpt = newest_checkpoint(run)
        f.note = f"corrupted {corrupt(ckpt)}" if ckpt else "no checkpoint yet"
    f.t_fault = time.time()
    t_cont = f.t_fault  # when the fault is over, for faults that restart nothing
    if f.kind in ("worker_kill", "corrupt"):
        os.kill(pid, signal.SIGKILL)
    elif f.kind == "sigterm":
        os.kill(pid, signal.SIGTERM)
    elif f.kind == "node_loss":
        c.kill_node(1)
        job.procs.pop(1, None)
    elif f.kind == "rejoin":
        (log["work"] / "pace").write_text(str(max(0.5, log["pace"])))  # node 0 alone must not finish meanwhile
        job.start(1)
    elif f.kind == "stall":
        os.kill(pid, signal.SIGSTOP)
        time.sleep(f.hold_s)
        os.kill(pid, signal.SIGCONT)
        t_cont = time.time()
        restarts = False
    elif f.kind == "full_disk":
        filler = disk / "filler"
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        with open(filler, "wb") as fh:
            with contextlib.suppress(OSError):
                os.posix_fallocate(fh.fileno(), 0, free)
        # hold it full across the next checkpoint save (or until the job fails), then free it
        every = 5
        target = (f.injected_step // every + 1) * every
        deadline = time.monotonic() + 30
        while (watch.last_step() < target + 1 and progress(run).get("pid") == before_pid
               and time.monotonic() < deadline and not job.failed()):
            time.sleep(0.05)
        f.hold_s = round(time.time() - f.t_fault, 1)
        filler.unlink()
        t_cont = time.time()
        restarts = progress(run).get("pid") != before_pid or watch.last_step() <= target
    if restarts:
        wait_for(lambda: progress(run).get("pid") not in (None, before_pid), timeout=240, job=job,
                 what=f"{f.label()}: a new worker group")
        t_group = time.time()
        wait_for(lambda: watch.since(max(t_group - 0.05, f.t_fault)), timeout=240, job=job,
                 what=f"{f.label()}: training again")
        t_again, rec = watch.since(max(t_group - 0.05, f.t_fault))[0]
    else:
        # a step whose all-reduce the stopped rank had already joined may still finish while it is stopped:
        # the next step trained is the first one after SIGCONT
        wait_for(lambda: watch.since(t_cont), timeout=120, job=job, what=f"{f.label()}: training again")
        t_again, rec = watch.since(t_cont)[0]
    f.t_again = t_again
    f.recovery_s = round(t_again - f.t_fault, 2)
    last_before = max((r["step"] for t, r in watch.rows if t <= f.t_fault), default=0)
    f.resumed_step = rec["step"] - 1
    f.steps_lost = max(0, last_before - f.resumed_step)
    f.world_after = progress(run).get("world_size")
    print(f"fault {log['n']:>2}: {f.label():<16} at step {f.injected_step:>3}: training again after "
          f"{f.recovery_s:6.2f} s, resumed at step {f.resumed_step}, {f.steps_lost} step(s) lost, "
          f"world {f.world_after}{'; ' + f.note if f.note else ''}", flush=True)
    log["n"] += 1
    (log["work"] / "pace").write_text(str(log["pace"]))
    log["base"] = rec["step"]


# ------------------------------------------------------------------ the reference
def reference(segments: list[tuple[int, int]], *, max_steps: int, items: list[str], env: dict[str, str],
              out: Path) -> Path:
    """Plain `dptrain run` runs of the same recipe (train.max_steps unchanged: the schedule depends on it), one per
    (k, w) segment: world size `w`, resuming the previous segment's checkpoint at its boundary step, checkpoints
    every step; a segment is stopped (SIGTERM) once its checkpoint at step `k` is committed, the last one runs to
    max_steps. Later segments' records replace an earlier one's past its boundary (`losses`)."""
    prev: Path | None = None
    for i, (stop, world) in enumerate(segments):
        run = out / f"ref{i}"
        last = i == len(segments) - 1
        argv = [sys.executable, "-m", "dptrain", "run", *joined(items, ["checkpoint.every_steps=1"]),
                "--nproc-per-node", str(world), "--out", str(run)]
        if prev is not None:
            argv += ["--resume", str(prev)]
        target = run / "checkpoints" / f"step_{stop:06d}"
        p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        deadline = time.monotonic() + 900
        while p.poll() is None and (last or not (target / mf.MARKER).exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
        err = p.communicate(timeout=120)[1]
        if not (target / mf.MARKER).exists() or (last and p.returncode != 0):
            raise RuntimeError(f"reference segment {i} ({' '.join(argv[3:])}) failed (exit {p.returncode}):\n"
                               f"{err[-3000:]}")
        prev = target
    return out / f"ref{len(segments) - 1}"


def losses(run_dirs: list[Path]) -> dict[int, float]:
    """Step -> loss, the last record of each step (a step trained again after a restart replaces the first)."""
    out: dict[int, float] = {}
    for run in run_dirs:
        for line in (run / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if "loss" in rec and "step" in rec:
                    out[rec["step"]] = rec["loss"]
    return out


def compare(run: Path, ref_dirs: list[Path]) -> dict[str, Any]:
    import torch  # noqa: F401 - safetensors' torch API
    from safetensors.torch import load_file

    got, want = load_file(run / "final" / "model.safetensors"), load_file(ref_dirs[-1] / "final" / "model.safetensors")
    same_keys = got.keys() == want.keys()
    diffs = {n: (got[n].double() - want[n].double()).abs().max().item() for n in want if n in got}
    weights_equal = same_keys and all(torch_equal(got[n], want[n]) for n in want)
    lg, lw = losses([run]), losses(ref_dirs)
    steps = sorted(lw)
    loss_equal = sorted(lg) == steps and all(lg[s] == lw[s] for s in steps)
    loss_diff = max((abs(lg[s] - lw[s]) for s in steps if s in lg), default=float("nan"))
    return {"weights_bit_identical": weights_equal, "weights_max_abs_diff": max(diffs.values(), default=0.0),
            "losses_bit_identical": loss_equal, "loss_max_abs_diff": loss_diff, "steps_compared": len(steps),
            "tensors": len(want)}


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


# ------------------------------------------------------------------ the soak
def soak(args: argparse.Namespace) -> int:
    reason = unavailable_reason()
    if reason:
        print(f"chaos soak: cannot build the two-host cluster here: {reason}", file=sys.stderr)
        return 2
    faults = parse_plan(args.plan) if args.plan else draw_faults(args.seed, args.faults)
    planned = sum(f.at_step for f in faults) if not args.plan else max(f.at_step for f in faults)
    max_steps = args.max_steps or planned + 6 * len(faults) + 10  # room for the steps a recovery takes
    src = Path(args.src).resolve() if args.src else ROOT / "src"
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", PACE_ENV: str(work / "pace"), **({"LOGLEVEL": "INFO"} if args.verbose else {})}
    items = joined(RECIPE, [f"train.seed={args.seed}", f"train.max_steps={max_steps}"], args.overrides)
    disk = work / "disk"
    disk.mkdir(exist_ok=True)
    run = disk / "run"
    (work / "logs").mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.disk_mb}m", "chaos-soak", str(disk)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"chaos soak: cannot mount a tmpfs for the run directory: {r.stderr.strip()}", file=sys.stderr)
        return 2
    (work / "pace").write_text(str(args.pace))
    print(f"chaos soak: seed {args.seed}, {len(faults)} faults, {max_steps} steps, run directory on a "
          f"{args.disk_mb} MiB tmpfs; work in {work}", flush=True)
    for i, f in enumerate(faults):
        at = f"{f.at_step} steps after the previous recovery" if f.relative else f"step {f.at_step}"
        print(f"  planned {i:>2}: {f.label()} at {at}" + (f" ({f.hold_s} s)" if f.hold_s else ""))
    t0 = time.time()
    log = {"n": 0, "base": 0, "work": work, "pace": args.pace}
    try:
        with Cluster(rate="1gbit") as c:
            job = Job(c, run, joined(items, JOB), env=env, logs=work / "logs")
            job.start(0)
            job.start(1)
            watch = Watch(run)
            try:
                for f in faults:
                    inject(job, watch, f, disk=disk, log=log)
                (work / "pace").write_text("0")  # the rest of the run at full speed
                code0 = job.procs[0].wait(timeout=600)
                codes = {n: p.wait(timeout=120) for n, p in job.procs.items()}
            finally:
                watch.stop()
                for node, p in list(job.procs.items()):
                    if p.poll() is None:
                        c.kill_node(node)
            if code0 != 0 or any(codes.values()):
                print(f"chaos soak: the job failed: exit codes {codes}\n{job.tail()}", file=sys.stderr)
                return 2
        wall = time.time() - t0
        shutil.copytree(run, work / "run", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("checkpoints"))
        shutil.copytree(run / "final", work / "run" / "final", dirs_exist_ok=True)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
        # a lost node's in-memory snapshots (its host never comes back to clear them)
        shutil.rmtree(Path(DEFAULT_ROOT) / run_id(run), ignore_errors=True)
    return conclude(args, work=work, faults=faults, max_steps=max_steps, items=items, env=env, wall=wall)


def recompare(args: argparse.Namespace) -> int:
    """Build the reference again for a finished soak (its --keep folder and --json report) and compare."""
    report = json.loads(Path(args.json).read_text())
    faults = [Fault(**f) for f in report["faults"]]
    work = Path(args.keep)
    args.seed, args.overrides = report["seed"], report["overrides"]
    max_steps = report["max_steps"]
    items = joined(RECIPE, [f"train.seed={args.seed}", f"train.max_steps={max_steps}"], args.overrides)
    src = Path(args.src).resolve() if args.src else ROOT / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", PACE_ENV: str(work / "pace")}
    shutil.rmtree(work / "reference", ignore_errors=True)
    return conclude(args, work=work, faults=faults, max_steps=max_steps, items=items, env=env, wall=report["wall_s"])


def conclude(args: argparse.Namespace, *, work: Path, faults: list[Fault], max_steps: int, items: list[str],
             env: dict[str, str], wall: float) -> int:
    """The reference with the soak's membership changes, the comparison, the totals and the reports."""
    run = work / "run"
    members = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()
               if line.strip() and json.loads(line).get("event") == "membership"]
    segments: list[tuple[int, int]] = []
    world = 2
    for m in members:
        if m["world_size_after"] != world:
            if segments and segments[-1][0] == m["resumed_step"]:
                segments[-1] = (m["resumed_step"], world)
            else:
                segments.append((m["resumed_step"], world))
            world = m["world_size_after"]
    segments.append((max_steps, world))
    ref_env = {**env, PACE_ENV: str(work / "no-pace")}
    reference(segments, max_steps=max_steps, items=joined(items, ["checkpoint.keep_last=null"]), env=ref_env,
              out=work / "reference")
    result = compare(run, [work / "reference" / f"ref{i}" for i in range(len(segments))])
    changed = len(segments) > 1
    ok = result["weights_bit_identical"] and result["losses_bit_identical"]
    total_lost = sum(f.steps_lost or 0 for f in faults)
    total_rec = sum(f.recovery_s or 0 for f in faults)
    print(f"\ntotal: {len(faults)} faults, {total_lost} step(s) lost, {total_rec:.1f} s recovering, "
          f"{wall:.0f} s wall; world-size segments {segments}")
    print(f"final weights vs the reference: {'bit-identical' if result['weights_bit_identical'] else 'DIFFERENT'} "
          f"(max |diff| {result['weights_max_abs_diff']:.3g}); per-step losses ({result['steps_compared']} steps): "
          f"{'bit-identical' if result['losses_bit_identical'] else 'DIFFERENT'} "
          f"(max |diff| {result['loss_max_abs_diff']:.3g})")
    report = {"seed": args.seed, "max_steps": max_steps, "overrides": args.overrides, "segments": segments,
              "world_size_changed": changed, "wall_s": round(wall, 1), "faults": [asdict(f) for f in faults],
              "steps_lost": total_lost, "recovery_s_total": round(total_rec, 2), "comparison": result, "ok": ok}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.md:
        write_markdown(Path(args.md), report, faults, argv=sys.argv[1:])
    return 0 if ok else 1


def write_markdown(path: Path, report: dict, faults: list[Fault], *, argv: list[str]) -> None:
    rows = "\n".join(
        f"| {i} | {f.label()} | {f.injected_step} | {f.recovery_s:.2f} | {f.resumed_step} | {f.steps_lost} | "
        f"{f.world_after} | {f.note or ('held ' + str(f.hold_s) + ' s' if f.hold_s else '')} |"
        for i, f in enumerate(faults)
    )
    by_kind: dict[str, list[Fault]] = {}
    for f in faults:
        by_kind.setdefault(f.kind, []).append(f)
    kinds = "\n".join(
        f"| {k} | {len(v)} | {min(x.recovery_s or 0 for x in v):.2f} | "
        f"{sorted(x.recovery_s or 0 for x in v)[len(v) // 2]:.2f} | {max(x.recovery_s or 0 for x in v):.2f} | "
        f"{sum(x.steps_lost or 0 for x in v)} |" for k, v in sorted(by_kind.items())
    )
    cmp = report["comparison"]
    keep = ""  # what the page says below the soak's own part is kept
    if path.exists() and END in path.read_text():
        keep = path.read_text().split(END, 1)[1]
    path.write_text(f"""# Chaos soak

`python benchmarks/acceptance/chaos_soak.py {' '.join(argv)}` on the two-namespace cluster (`dptrain.tools.netns`),
toy MLP recipe, `launch.nnodes=1:2`, one worker per node, checkpoints every 5 steps, run directory on a
tmpfs. Recovery time: from the fault to the next step trained (the time its metrics record appeared);
steps lost: steps trained before the fault that were trained again. The machine is shared (2 cores).

Seed {report['seed']}, {report['max_steps']} steps, {len(faults)} faults, {report['wall_s']} s wall.
Total: **{report['steps_lost']} step(s) lost**, {report['recovery_s_total']} s spent recovering.

| # | fault | at step | recovery (s) | resumed at | steps lost | world after | note |
|---|---|---|---|---|---|---|---|
{rows}

| kind | count | min (s) | median (s) | max (s) | steps lost |
|---|---|---|---|---|---|
{kinds}

Reference: plain `dptrain run` segments with the soak's world-size changes at the same steps
({report['segments']}: `(step, world size)` per segment, each resuming the previous one's checkpoint).
Final weights: **{'bit-identical' if cmp['weights_bit_identical'] else 'different'}** (max |diff|
{cmp['weights_max_abs_diff']:.3g} over {cmp['tensors']} tensors); per-step losses over
{cmp['steps_compared']} steps: **{'bit-identical' if cmp['losses_bit_identical'] else 'different'}** (max |diff|
{cmp['loss_max_abs_diff']:.3g}).

{END}{keep}""")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `kill` (a test's timeout) still cleans up
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--plan", help="fixed faults instead of drawn ones: kind@step[:node],...")
    p.add_argument("--max-steps", type=int, default=None, help="default: 8 past the last fault")
    p.add_argument("--pace", type=float, default=0.05, help="seconds of sleep per micro-batch loss (default 0.05)")
    p.add_argument("--disk-mb", type=int, default=16, help="size of the run directory's tmpfs (MiB)")
    p.add_argument("--overrides", nargs="*", default=[], help="extra `dptrain run` overrides (key=value)")
    p.add_argument("--src", help="the dptrain checkout's src/ the job runs (default: this one's)")
    p.add_argument("--keep", help="work directory to keep (default: a temporary one)")
    p.add_argument("--verbose", action="store_true", help="torchrun's INFO log lines in the node logs")
    p.add_argument("--recompare", action="store_true",
                   help="only build the reference again and compare, for the soak in --keep with its --json report")
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    if args.recompare and not (args.keep and args.json):
        p.error("--recompare needs --keep WORK and --json REPORT of a finished soak")
    return recompare(args) if args.recompare else soak(args)


if __name__ == "__main__":
    raise SystemExit(main())
