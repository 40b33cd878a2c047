"""One world size of `dptrain bench`: `python -m dptrain.tools.bench.worker SPEC.json` on every rank (torchrun).

Every variant of the launch lives in this one process group, on the same batches: each dptrain
variant is a real `Trainer` (set up as `dptrain run` sets it up) stepped with
`end_step(train_step())`, exactly `dptrain run`'s per-step path; `raw` is the hand-written DDP loop
(bench/raw_ddp.py). The variants take turns, `chunk` steps each, the order rotating every round,
so this machine's noise hits them alike. Each step starts after a barrier and, on a GPU, ends with a
device synchronisation (the work is timed, not its launch); a step's time is the slowest rank's.
Rank 0 writes SPEC's `result` file (JSON).
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dptrain.config import ConfigError, resolve
from dptrain.config.load import load_config
from dptrain.distributed.env import DistEnv
from dptrain.distributed.process_group import bind_device, process_group
from dptrain.tools.bench.harness import run_step
from dptrain.tools.bench.raw_ddp import RawDDP
from dptrain.train.trainer import Trainer


class Runner:
    """One variant in the launch: its step function and what is measured of it."""

    def __init__(self, spec: dict[str, Any], *, step: Callable[[], torch.Tensor], group: Any,
                 trainer: Trainer | None = None, module: torch.nn.Module | None = None) -> None:
        self.spec, self.step_fn, self.group, self.trainer = spec, step, group, trainer
        self.module = trainer.model if trainer is not None else module
        self.optimizer = trainer.optimizer if trainer is not None else None
        self.tokens: int | None = trainer.tokens_per_sample if trainer is not None else None
        self.times: list[float] = []
        self.cuda_peak = 0
        self.rss_setup = 0
        self.last_loss = torch.zeros(())

    def run(self, n: int, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(n):
            dist.barrier()
            t = time.perf_counter()
            self.last_loss = self.step_fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.times.append(time.perf_counter() - t)
        if device.type == "cuda":
            self.cuda_peak = max(self.cuda_peak, torch.cuda.max_memory_allocated(device))


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t  # DTensor: this rank's shard
            total += local.numel() * local.element_size()
    return total


def state_bytes(runner: Runner) -> int:
    """This rank's parameters plus optimizer state (local shards only): what zero1/zero2/fsdp shrink."""
    assert runner.module is not None
    n = _local_bytes(runner.module.parameters())
    opt = runner.optimizer
    opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer holds this rank's partition in .optim
    if opt is not None:
        n += sum(_local_bytes(s.values()) for s in opt.state.values())
    return n


def _trainer_runner(spec: dict[str, Any], cfg: Any, env: DistEnv) -> Runner:
    trainer = Trainer(cfg, out_dir=spec["run_dir"], env=env)
    trainer.setup()

    # the same step boundary as `dptrain run`
    return Runner(spec, step=lambda: run_step(trainer), group=trainer.mesh.dp_group, trainer=trainer)


def build_runners(specs: list[dict[str, Any]], *, env: DistEnv, device: torch.device, total_steps: int,
                  ) -> tuple[list[Runner], list[dict[str, Any]]]:
    """Set up every variant; a ConfigError only a worker can find makes that variant skipped."""
    import psutil

    runners, skipped = [], []
    for spec in specs:
        cfg = load_config(spec["config"])
        rss = psutil.Process().memory_info().rss
        try:
            if spec["variant"] == "raw":
                raw = RawDDP(cfg, device=device, steps=total_steps, bucket_cap_mb=cfg.parallel.bucket_cap_mb)
                runners.append(Runner(spec, step=raw.step, group=None, module=raw.ddp))
                runners[-1].optimizer, runners[-1].tokens = raw.opt, raw.tokens_per_sample
            else:
                runners.append(_trainer_runner(spec, cfg, env))
        except ConfigError as e:
            skipped.append({**_key(spec), "skipped": str(e)})
            continue
        runners[-1].rss_setup = psutil.Process().memory_info().rss - rss  # what building this variant added
    return runners, skipped


def interleave(runners: list[Runner], *, total: int, chunk: int, device: torch.device) -> None:
    """Round-robin `chunk` steps each until every runner has run `total`; the order rotates by one each round."""
    done, rnd = 0, 0
    while done < total:
        n = min(chunk, total - done)
        k = rnd % len(runners)
        for r in runners[k:] + runners[:k]:
            r.run(n, device)
        done, rnd = done + n, rnd + 1


def _key(spec: dict[str, Any]) -> dict[str, Any]:
    return {"variant": spec["variant"], "world": spec["world"], "mode": spec["mode"]}


def _comm_bytes(run_dir: str) -> float | None:
    """The trainer's own `comm_bytes` metric from its last log record that has one (None: not logged)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    value = None
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("comm_bytes") is not None:
            value = float(record["comm_bytes"])
    return value


def measure(runners: list[Runner], *, warmup: int, device: torch.device) -> list[dict[str, Any]]:
    """Per variant: step times (the slowest rank's), loss after the last step (mean over its dp group),
    memory. Collective: every rank calls it."""
    rows = []
    for r in runners:
        times = torch.tensor(r.times[warmup:], dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        loss = r.last_loss.detach().double().to(device).clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=r.group)
        loss /= dist.get_world_size(r.group)
        mem = torch.tensor([float(state_bytes(r)), float(r.cuda_peak), float(r.rss_setup)], dtype=torch.float64,
                           device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        ts = times.tolist()
        q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0], ts[0], ts[0]]
        rows.append({
            **_key(r.spec), "times_s": ts, "median_s": statistics.median(ts), "q1_s": q[0], "q3_s": q[2],
            "min_s": min(ts), "max_s": max(ts), "loss": float(loss), "global_batch_size": r.spec["global_batch_size"],
            "tokens_per_sample": r.tokens, "state_mib": mem[0].item() / 2**20,
            "cuda_peak_mib": mem[1].item() / 2**20 if device.type == "cuda" else None,
            "rss_setup_mib": mem[2].item() / 2**20, "comm_bytes": _comm_bytes(r.spec["run_dir"]) if r.trainer else None,
        })
    return rows


def peak_rss_mib() -> float:
    """This process's peak resident set size (all variants of the launch share the process)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

def release(runners: list[Runner]) -> None:
    """Stop each trainer's diagnostics and checkpoint manager, then drop wrappers and meshes while
    their process groups exist (last set up, first closed: signal handlers are restored in order)."""
    for r in reversed(runners):
        if r.trainer is not None:
            r.trainer.close()
            r.trainer.model = r.trainer.parallel.release()
            r.trainer.mesh.release()
        r.trainer = r.module = r.optimizer = None
    runners.clear()
    gc.collect()


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    env = DistEnv.from_env()
    first = load_config(spec["variants"][0]["config"])
    res = resolve(first, world_size=env.world_size)
    device = bind_device(env, res.device)
    total = spec["warmup"] + spec["steps"]
    with process_group(env, backend=res.backend, device=device, timeout_s=first.parallel.timeout_s):
        runners, skipped = build_runners(spec["variants"], env=env, device=device, total_steps=total)
        interleave(runners, total=total, chunk=spec["chunk"], device=device)
        rows = measure(runners, warmup=spec["warmup"], device=device)
        rss = torch.tensor([peak_rss_mib()], dtype=torch.float64, device=device)
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        release(runners)
        if env.is_main:
            out = {"world": env.world_size, "rows": rows, "skipped": skipped, "peak_rss_mib": rss.item(),
                   "device": device.type, "backend": res.backend}
            Path(spec["result"]).write_text(json.dumps(out, indent=1) + "\n")
        dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
