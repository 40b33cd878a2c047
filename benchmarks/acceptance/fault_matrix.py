"""The fault matrix: twelve faults injected into real runs at default settings; was the culprit named, and how fast?

Each fault runs in a fresh `dptrain run` of the toy MLP recipe (a `train.loss` or `data.factory` from
benchmarks/acceptance/faults/ injects it), or in an own loop under `dptrain launch` (faults/own_loop.py: a rank-0-only
`ckpt.save`), or across the two-"host" namespace cluster of dptrain.tools.netns (a node given the wrong rendezvous
port). No diagnostics setting is changed. From `--seed`, every fault draws its culprit rank and its step; the fault
code writes the time of the injection to a file. Everything the user can read (both launchers' stdout and stderr,
line by line as it arrives, and `RUN_DIR/*report*` files as they appear) is recorded with its arrival time, and
faults/verdict.py finds the first line that names a rank (or node) as the cause and judges it: the right rank, its
op or phase, and a stack frame or file:line of the fault. A run still going at the fault's deadline is killed
(every process it started).

    python benchmarks/acceptance/fault_matrix.py         # the whole matrix, 2 ranks (about 25 min: 4 hangs wait
                                                         # for the watchdog's default 300 s)
    python benchmarks/acceptance/fault_matrix.py --only kill,nan --nproc 4 --repeat 3 --json matrix.json

Prints a Markdown table `| fault | named right | seconds to the name | what the user reads |` (seconds from the
injection to the first right name) and writes every run's record as JSON (`--json`). Exit 0 unless a run could
not be set up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for _p in (ROOT / "src", HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from faults.cgroup import remove_leftovers  # noqa: E402
from faults.cgroup import unavailable as cgroup_unavailable  # noqa: E402
from faults.report import messages, table  # noqa: E402
from faults.verdict import Event, Expect, judge  # noqa: E402

from dptrain.tools.netns import Cluster, dptrain_argv, unavailable_reason  # noqa: E402

GLOBAL_BATCH = 12  # divisible by 2, 3 and 4 ranks: one micro-batch per step, so a loss call is a step
WATCHDOG = "the watchdog's default diagnostics.hang_timeout_s (min(300 s, parallel.timeout_s / 2))"


def base(nproc: int, seed: int) -> list[str]:
    """The toy recipe as `dptrain run` overrides: everything else, diagnostics included, at its default."""
    return ["model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
            "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={n: 4096}",
            f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={GLOBAL_BATCH // nproc}",
            "train.eval_every_steps=0", f"train.seed={seed}", "log.progress=false"]


@dataclass(frozen=True)
class Fault:
    name: str
    title: str
    kind: str  # "run": dptrain run; "launch": an own loop under dptrain launch; "nodes": two nodes, netns
    overrides: tuple[str, ...] = ()
    what: str = ""
    where: str | None = None
    desync: bool = False  # the culprit and (with 2 ranks) the other side must both be named
    culprit: int | None = None  # a fixed culprit (else drawn from the seed)
    deadline_s: float = 60.0
    bounded_by: str | None = None
    """The timeout that bounds its detection, when one does."""


FAULTS = [
    Fault("kill", "a rank killed mid-collective (SIGKILL)", "run",
          ("train.loss=faults.losses:kill_mid_collective",), what=r"SIGKILL|signal 9|killed|exit(?:code)?\s*:?\s*-9"),
    Fault("stuck", "a rank stuck in Python outside any collective", "run",
          ("train.loss=faults.losses:stuck_in_python",), what=r"forward|loss|sleep",
          where=r"stuck_in_python|stall_forever|faults/inject\.py|faults/losses\.py", deadline_s=330,
          bounded_by=WATCHDOG),
    Fault("order", "collectives called in a different order", "run",
          ("train.loss=faults.losses:collectives_out_of_order",),
          what=r"all_gather[\s\S]*all_reduce|all_reduce[\s\S]*all_gather",
          where=r"sync_metrics|faults/losses\.py", desync=True, deadline_s=330, bounded_by=WATCHDOG),
    Fault("shape", "the same collective with a different shape", "run",
          ("train.loss=faults.losses:collective_shape_differs",),
          what=r"all_reduce[^\n]*(shape|size|\[6\]|\[4\])|(shape|size)[^\n]*all_reduce",
          where=r"collective_shape_differs|faults/losses\.py", desync=True, deadline_s=330, bounded_by=WATCHDOG),
    Fault("p2p", "a send one pipeline stage skips (send/recv)", "run",
          ("train.loss=faults.losses:pipeline_send_skipped",), what=r"\brecv\b|\bsend\b",
          where=r"pipeline_send_skipped|faults/losses\.py", desync=True, deadline_s=330, bounded_by=WATCHDOG),
    Fault("skip", "a collective one rank skips (rank-0-only ckpt.save, own loop)", "launch",
          what=r"save|barrier", where=r"own_loop\.py", desync=True, culprit=0, deadline_s=330,
          bounded_by="Checkpointer's save_timeout_s (10 s default)"),
    Fault("stall", "a DataLoader worker that stalls", "run",
          ("data.factory=faults.data:stalling_data", "data.num_workers=2"), what=r"\bdata\b|DataLoader|loader",
          where=r"dataloader\.py|StallingData|faults/data\.py|stall_forever|faults/inject\.py", deadline_s=330,
          bounded_by=WATCHDOG),
    Fault("straggler", "a 3x straggler (one rank's step 3x slower)", "run",
          ("train.loss=faults.losses:straggler", "train.max_steps=60"), what=r"straggler|compute|slow",
          bounded_by="diagnostics.straggler_every_steps (default 50 steps)"),
    Fault("endpoint", "a wrong rendezvous port on one node (two hosts)", "nodes",
          what=r"could not connect|refused|timed out|unreachable|wrong|differ", culprit=1, deadline_s=180,
          bounded_by="torch's TCPStore connect timeout (60 s, tried twice)"),
    Fault("nan", "a NaN on one rank", "run", ("train.loss=faults.losses:nan_on_one_rank", "train.max_steps=30"),
          what=r"\bnan\b|non-finite"),
    Fault("memory", "host memory exhausted on one rank (RLIMIT_AS)", "run",
          ("train.loss=faults.losses:exhaust_host_memory",), what=r"memory|MemoryError|can't allocate|OOM",
          where=r"exhaust_host_memory|faults/losses\.py"),
    Fault("oom", "a rank the kernel's OOM killer ends (memory cgroup limit)", "run",
          ("train.loss=faults.losses:oom_killed",), what=r"OOM killer"),
]
BY_NAME = {f.name: f for f in FAULTS}


@dataclass
class Draw:
    """What the seed chose for one run of a fault."""

    culprit: int
    step: int
    seed: int


def draw(fault: Fault, *, nproc: int, seed: int, repeat: int) -> Draw:
    rng = random.Random(f"{seed}:{fault.name}:{repeat}")
    # never rank 0 unless the fault is rank 0's: torchrun's report and "the lowest rank first" rules fall on rank 0
    # by default, so a culprit there can be named right by luck
    culprit = fault.culprit if fault.culprit is not None else rng.randrange(1, nproc)
    return Draw(culprit=culprit, step=rng.randint(3, 6), seed=rng.randrange(1 << 16))


def expectation(fault: Fault, d: Draw, *, nproc: int) -> Expect:
    if fault.kind == "nodes":
        return Expect(frozenset({d.culprit}), fault.what, r":{port}\b", kind="node")
    culprits = {d.culprit}
    if fault.desync and nproc == 2:  # two ranks: neither side is the odd one out, both must be named
        culprits = {0, 1}
    where = fault.where if fault.name != "nan" else rf"step {d.step}\b"
    return Expect(frozenset(culprits), fault.what, where, rule="all" if fault.desync else "first")


# ----------------------------------------------------------------------------------------------------- running
@dataclass
class Watch:
    """Everything the user can read from one run, with arrival times, and the processes it started."""

    run_dirs: list[Path]
    mark: Path
    events: list[Event] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def add(self, source: str, text: str) -> None:
        with self.lock:
            self.events.append(Event(time.time(), source, text.rstrip("\n")))

    def read(self, stream, source: str) -> threading.Thread:
        def loop() -> None:
            for line in iter(stream.readline, ""):
                self.add(source, line)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        return t

    def poll(self, procs: list[subprocess.Popen]) -> threading.Thread:
        """Report files line by line as they appear, and every descendant of the launchers (to end them)."""
        seen: dict[Path, int] = {}

        def loop() -> None:
            while not self.stop.is_set():
                for run_dir in self.run_dirs:
                    for report in sorted(run_dir.glob("*report*")):
                        with contextlib.suppress(OSError):
                            lines = report.read_text(errors="replace").splitlines()
                            for line in lines[seen.get(report, 0):]:
                                self.add(report.name, line)
                            seen[report] = len(lines)
                for p in procs:
                    with contextlib.suppress(psutil.Error):
                        self.pids.update(c.pid for c in psutil.Process(p.pid).children(recursive=True))
                self.stop.wait(0.2)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        return t

    def injected(self) -> float | None:
        with contextlib.suppress(OSError, ValueError):
            return float(self.mark.read_text())
        return None


def end_all(watch: Watch, procs: list[subprocess.Popen], cluster: Cluster | None) -> None:
    """SIGKILL every process the runs started: the launchers' sessions, their descendants, anything naming a run
    directory (torchrun starts workers in sessions of their own)."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    pids = set(watch.pids)
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(str(d) in a for d in watch.run_dirs for a in proc.info["cmdline"] or []):
                pids.add(proc.pid)
    for pid in pids - {os.getpid()}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if cluster is not None:
        for i in range(2):
            cluster.kill_node(i)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
    remove_leftovers()  # the OOM fault's memory cgroups (empty once their process is gone)


def environment(d: Draw, mark: Path) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "FAULT_RANK": str(d.culprit),
            "FAULT_STEP": str(d.step), "FAULT_MARK": str(mark)}


def commands(fault: Fault, d: Draw, *, nproc: int, work: Path) -> list[list[str]]:
    """The launcher command(s) of one run (`nodes`: node 0's and node 1's, before the cluster wraps them)."""
    run = [sys.executable, "-m", "dptrain", "run"]
    if fault.kind == "launch":
        return [[sys.executable, "-m", "dptrain", "launch", "--nproc-per-node", str(nproc),
                 str(HERE / "faults" / "own_loop.py"), str(work / "run")]]
    items = [*base(nproc, d.seed), *fault.overrides]
    if fault.name == "stall":
        micro = GLOBAL_BATCH // nproc
        items.append(f"data.kwargs={{n: 4096, stall_after_items: {max(1, (d.step - 1) // 2) * micro}}}")
    items = list({item.split("=", 1)[0]: item for item in items}.values())  # a fault's setting replaces the base's
    if fault.kind == "run":
        return [[*run, *items, "--nproc-per-node", str(nproc), "--out", str(work / "run")]]
    per_node = max(1, nproc // 2)
    items = [*base(2 * per_node, d.seed), "--nproc-per-node", str(per_node)]
    return [[*items, "--out", str(work / f"run{i}")] for i in range(2)]


def run_fault(fault: Fault, *, nproc: int, seed: int, repeat: int, deadline_s: float | None,
              work: Path, port: int) -> dict[str, Any]:
    d = draw(fault, nproc=nproc, seed=seed, repeat=repeat)
    work.mkdir(parents=True, exist_ok=True)
    mark = work / "injected"
    cmds = commands(fault, d, nproc=nproc, work=work)
    run_dirs = [work / "run"] if fault.kind != "nodes" else [work / "run0", work / "run1"]
    watch = Watch(run_dirs, mark)
    env = environment(d, mark)
    cluster, procs, readers = None, [], []
    deadline = deadline_s if deadline_s is not None else fault.deadline_s
    started = time.time()
    try:
        if fault.kind == "nodes":
            cluster = Cluster()
            cluster.create()
            for i, cmd in enumerate(cmds):
                endpoint = cluster.launch_overrides(i, port=port + (i == d.culprit))  # the culprit: a wrong port
                if i == d.culprit:
                    mark.write_text(repr(time.time()))
                procs.append(cluster.popen(i, dptrain_argv([*cmd, *endpoint]), cwd=ROOT, env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        else:
            procs.append(subprocess.Popen(cmds[0], cwd=ROOT, env=env, start_new_session=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for i, p in enumerate(procs):
            prefix = f"node{i}:" if fault.kind == "nodes" else ""
            readers += [watch.read(p.stdout, f"{prefix}stdout"), watch.read(p.stderr, f"{prefix}stderr")]
        poller = watch.poll(procs)
        while any(p.poll() is None for p in procs):
            injected = watch.injected()
            limit = (injected + deadline) if injected is not None else started + 120 + deadline
            if time.time() > limit:
                break
            time.sleep(0.2)
        timed_out = any(p.poll() is None for p in procs)
        time.sleep(0.5)  # the last report lines
    finally:
        watch.stop.set()
        end_all(watch, procs, cluster)
        if cluster is not None:
            cluster.destroy()
    for t in readers:
        t.join(timeout=5)
    poller.join(timeout=5)
    return record(fault, d, watch, procs, nproc=nproc, port=port, timed_out=timed_out, deadline=deadline)


def record(fault: Fault, d: Draw, watch: Watch, procs: list[subprocess.Popen], *, nproc: int, port: int,
           timed_out: bool, deadline: float) -> dict[str, Any]:
    injected = watch.injected()
    expect = expectation(fault, d, nproc=nproc)
    if expect.where is not None:
        expect = Expect(expect.culprits, expect.what, expect.where.replace("{port}", str(port + 1)),
                        expect.rule, expect.kind)
    out: dict[str, Any] = {"fault": fault.name, "title": fault.title, "nproc": nproc, "seed": d.seed,
                           "culprit": d.culprit, "step": d.step, "injected_at": injected,
                           "exit_codes": [p.returncode for p in procs], "timed_out": timed_out,
                           "run_dirs": [str(d) for d in watch.run_dirs],
                           "deadline_s": deadline, "bounded_by": fault.bounded_by,
                           "expected": {**asdict(expect), "culprits": sorted(expect.culprits)}}
    if injected is None:
        return {**out, "named_right": False, "cell": "fault never injected", "seconds": None,
                "reads": "(the run ended before the fault)", "lines": [asdict(e) for e in watch.events[-40:]]}
    return verdict({**out, "lines": [asdict(e) for e in watch.events if e.t >= injected - 1]})


def verdict(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with the verdict on its recorded lines (also what `--rejudge` redoes on a saved JSON)."""
    if row["injected_at"] is None:
        return row
    e = row["expected"]
    expect = Expect(frozenset(e["culprits"]), e["what"], e["where"], e["rule"], e["kind"])
    lines = [Event(**line) for line in row["lines"]]
    for run_dir in row.get("run_dirs", []):  # a path is no evidence (the run's folder may be named after the fault)
        lines = [Event(e.t, e.source, e.text.replace(run_dir, "RUN_DIR")) for e in lines]
    v = judge(lines, expect, injected=row["injected_at"])
    return {**row, "named_right": v.named_right, "cell": v.cell(), "seconds": v.seconds, "reads": v.reads,
            "what_found": v.what_found, "where_found": v.where_found, "wrong_first": v.wrong_first,
            "claim": None if v.claim is None else asdict(v.claim),
            "first_claim": None if v.first_claim is None else asdict(v.first_claim)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help=f"comma-separated faults (default all): {','.join(BY_NAME)}")
    ap.add_argument("--nproc", type=int, default=2, help="ranks per run, 2 to 4 (two nodes: half on each)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each fault (each draws its own rank and step)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, help="seconds after the injection before a run is killed "
                                                    "(default: per fault, past the timeout that bounds it)")
    ap.add_argument("--port", type=int, default=29631, help="the two-node rendezvous port (the culprit gets +1)")
    ap.add_argument("--json", type=Path, help="write every run's record here")
    ap.add_argument("--md", type=Path, help="write the table and every fault's lines as the user reads them here")
    ap.add_argument("--workdir", type=Path, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--rejudge", type=Path, help="run nothing: judge the lines a saved --json recorded again")
    args = ap.parse_args(argv)
    if args.rejudge:
        rows = [verdict(r) for r in json.loads(args.rejudge.read_text())["rows"]]
        return report(rows, args)
    if not 2 <= args.nproc <= 4:
        ap.error(f"--nproc {args.nproc}: 2 to 4 ranks")
    names = args.only.split(",") if args.only else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"--only: unknown fault(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp:
        work = args.workdir or Path(tmp)
        for repeat in range(args.repeat):
            for name in names:
                fault = BY_NAME[name]
                why = (unavailable_reason() if fault.kind == "nodes"
                       else cgroup_unavailable() if fault.name == "oom" else None)
                if why is not None:
                    print(f"{name}: skipped ({why})", file=sys.stderr)
                    continue
                row = run_fault(fault, nproc=args.nproc, seed=args.seed, repeat=repeat, deadline_s=args.deadline,
                                work=work / f"run{len(rows):02d}", port=args.port)
                print(f"{name} #{repeat}: culprit rank {row['culprit']} at step {row['step']}: {row['cell']}, "
                      f"{row['seconds'] if row['seconds'] is None else round(row['seconds'], 1)} s, "
                      f"exit {row['exit_codes']}", file=sys.stderr, flush=True)
                rows.append(row)
    return report(rows, args)


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> int:
    print(table(rows))
    if args.md:
        args.md.write_text(f"{table(rows)}\n\n{messages(rows)}")
    if args.json:
        args.json.write_text(json.dumps({"nproc": args.nproc, "seed": args.seed, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
