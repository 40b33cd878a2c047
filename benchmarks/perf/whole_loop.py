"""The whole `dptrain run` loop against a hand-written torchrun DDP loop of the same recipe.

    python benchmarks/perf/whole_loop.py                          # 8 pairs of 60 steps, 2 ranks, the default config
    python benchmarks/perf/whole_loop.py --pairs 2 --steps 30     # the short mode
    python benchmarks/perf/whole_loop.py --pairs 8 model.kwargs.dim=64   # config overrides go to both sides

Each pair runs, one after the other (which goes first alternates from pair to pair):

- `dptrain run --nproc-per-node N --resume none OVERRIDES train.max_steps=STEPS`: the real CLI (launcher,
  torchrun, the status thread, the watchdog, logging, evaluation and checkpoints as configured, at the
  defaults unless OVERRIDES say otherwise);
- a plain torchrun script (this file, `--raw-worker`) training the same recipe with the loop the field's
  guides teach (dptrain/tools/bench/raw_ddp.py: the same model under the same seed, the same micro-batches,
  loss, optimizer and schedule, DDP with the same bucket size; `no_sync` but the last micro-step, clip, step,
  zero_grad) and printing the mean loss over the ranks every `train.log_every_steps` steps, as a hand-written
  loop does.

Both measure the same way on rank 0: a clock stamp (`time.perf_counter`, and the process's CPU time over all
its threads) at the end of every step: for `dptrain run`, after `Trainer.end_step` (a `sitecustomize.py` this
script puts on the workers' PYTHONPATH wraps it; nothing else changes); for the raw loop, after its step and
its logging. A step's time is the difference of consecutive stamps, so everything the loop does between steps
counts; the first `--warmup` steps are left out. Each pair's ratio is dptrain's median step time over the raw
loop's; the script prints every pair, then the median of the pairs' ratios with their range, and the same for
the CPU time per step (less sensitive to other processes on the machine than wall time, though not immune).

Wall-clock ratios need a quiet machine: on a shared one, read the CPU-time ratio and the spread.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAMPS_ENV = "DPTRAIN_WHOLE_LOOP_STAMPS"

SITECUSTOMIZE = f'''
import os
if os.environ.get("{STAMPS_ENV}") and os.environ.get("RANK") == "0":
    import time
    from dptrain.train.trainer import Trainer

    _end_step, _out = Trainer.end_step, open(os.environ["{STAMPS_ENV}"], "w", buffering=1)

    def end_step(self, loss):
        stop = _end_step(self, loss)
        _out.write(f"{{time.perf_counter()}} {{time.process_time()}}\\n")
        return stop

    Trainer.end_step = end_step
'''


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps left out at the start of each run")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--keep", help="write the runs' directories, logs and stamps under this folder")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--raw-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stamps", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="config overrides (key=value) for both sides")
    return p.parse_args(argv)


# ---------------------------------------------------------------- the hand-written loop (a torchrun worker)
def raw_worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from dptrain.config.load import load_config
    from dptrain.tools.bench.raw_ddp import RawDDP

    cfg = load_config(None, [*a.overrides, f"train.max_steps={a.steps}"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = torch.device("cpu")
    raw = RawDDP(cfg, device=device, steps=a.steps, bucket_cap_mb=cfg.parallel.bucket_cap_mb)
    out = open(a.stamps, "w", buffering=1) if rank == 0 else None  # noqa: SIM115 - closed below
    every, window, steps = cfg.train.log_every_steps, torch.zeros(()), 0
    for step in range(1, a.steps + 1):
        window += raw.step()
        steps += 1
        if step % every == 0 or step == a.steps:  # the log line: the window's mean loss over the ranks
            dist.all_reduce(window)
            if rank == 0:
                print(f"step {step}/{a.steps} loss {window.item() / steps / dist.get_world_size():.4f}", flush=True)
            window, steps = torch.zeros(()), 0
        if out is not None:
            out.write(f"{time.perf_counter()} {time.process_time()}\n")
    if out is not None:
        out.close()
    del raw  # the DDP reducer goes before the process group (gloo's teardown can hang otherwise)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the driver
def _run(cmd: list[str], *, env: dict[str, str], log: Path, timeout_s: float) -> None:
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers: their own session
            proc.wait()
            raise SystemExit(f"{' '.join(cmd)} ran past --run-timeout={timeout_s:g}s; its output: {log}") from None
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {code}; its output: {log}\n" + log.read_text()[-3000:])


def _step_times(path: Path, *, warmup: int) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds per step after the first `warmup` steps, from a stamps file."""
    stamps = [tuple(map(float, line.split())) for line in path.read_text().splitlines() if line.strip()]
    pairs = list(zip(stamps, stamps[1:], strict=False))[warmup:]
    if not pairs:
        raise SystemExit(f"{path}: {len(stamps)} steps stamped; need more than --warmup={warmup}")
    return [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]


def one_side(side: str, a: argparse.Namespace, work: Path, pair: int) -> tuple[float, float]:
    """Run one side once; (median wall s per step, median CPU s per step) on rank 0."""
    stamps = work / f"{side}{pair}.stamps"
    env = {**os.environ, STAMPS_ENV: str(stamps)}
    common = [*a.overrides, f"train.max_steps={a.steps}"]
    if side == "dptrain":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(work / "site"), env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", str(a.nproc), "--resume", "none",
               "--out", str(work / f"run{pair}"), *common, "log.progress=false"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc), "--standalone",
               __file__, "--raw-worker", f"--stamps={stamps}", f"--steps={a.steps}", *a.overrides]
    _run(cmd, env=env, log=work / f"{side}{pair}.log", timeout_s=a.run_timeout)
    wall, cpu = _step_times(stamps, warmup=a.warmup)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str]) -> int:
    a = _args(argv)
    if a.raw_worker:
        raw_worker(a)
        return 0
    if a.steps <= a.warmup + 1:
        raise SystemExit(f"--steps={a.steps} leaves nothing after --warmup={a.warmup}: give more steps")
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="dptrain-whole-loop-"))
    (work / "site").mkdir(parents=True, exist_ok=True)
    (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    print(f"whole loop: dptrain run vs a hand-written DDP loop, {a.nproc} ranks, {a.steps} steps "
          f"(first {a.warmup} left out), {a.pairs} pairs; overrides: {' '.join(a.overrides) or '(defaults)'}")
    print(f"{'pair':>4}  {'dptrain s/step':>14}  {'raw s/step':>10}  {'ratio':>6}  {'CPU ratio':>9}", flush=True)
    ratios, cpu_ratios = [], []
    for pair in range(a.pairs):
        order = ("dptrain", "raw") if pair % 2 == 0 else ("raw", "dptrain")
        got = {side: one_side(side, a, work, pair) for side in order}
        ratio, cpu = got["dptrain"][0] / got["raw"][0], got["dptrain"][1] / got["raw"][1]
        ratios.append(ratio)
        cpu_ratios.append(cpu)
        print(f"{pair:>4}  {got['dptrain'][0]:>14.4f}  {got['raw'][0]:>10.4f}  {ratio:>6.3f}  {cpu:>9.3f}", flush=True)
    print(f"median ratio of the pairs' median step times: {statistics.median(ratios):.3f}x "
          f"({min(ratios):.3f}-{max(ratios):.3f})")
    print(f"median ratio of the pairs' median CPU time per step (rank 0, all threads): "
          f"{statistics.median(cpu_ratios):.3f}x ({min(cpu_ratios):.3f}-{max(cpu_ratios):.3f})")
    print(f"runs, logs and stamps: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
