"""`dptrain bench`: plan the cells, one torchrun launch per world size, then the report.

Each launch runs `python -m dptrain.tools.bench.worker SPEC.json` (bench/worker.py) with the launch's
variants; the spec names one YAML config per variant (written whole, as `dptrain run` writes the
config its workers read) and the result file rank 0 writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dptrain.config import Config, ConfigError, resolve
from dptrain.config.load import dump_yaml
from dptrain.launch import torchrun as launch
from dptrain.tools.bench import report
from dptrain.tools.bench.cells import BenchOptions, Cell, plan_cells

WORKER = "dptrain.tools.bench.worker"


@contextlib.contextmanager
def _threads(nproc: int) -> Iterator[None]:
    """OMP threads per rank, the same in every launch (unless the user set OMP_NUM_THREADS): the cores
    split over the largest world N. A rank is one device of the scaling study: its share of the
    machine must not grow when the world is smaller (at world 1, all cores for one rank would make the
    baseline something else; on a loaded machine, oversubscribed OpenMP threads also spin)."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def _spec(cells: list[Cell], *, world: int, opts: BenchOptions, out: Path) -> Path:
    """Write each cell's config and the launch's spec; return the spec's path."""
    variants = []
    for c in cells:
        assert c.config is not None
        run_dir = out / "runs" / c.label
        cfg = dataclasses.replace(c.config, log=dataclasses.replace(c.config.log, out_dir=str(run_dir)))
        path = out / "configs" / f"{c.label}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_yaml(cfg))
        res = resolve(cfg, world_size=world)
        variants.append({"variant": c.variant, "world": world, "mode": c.mode, "config": str(path),
                         "run_dir": str(run_dir), "global_batch_size": res.global_batch_size})
    spec = {"world": world, "steps": opts.steps, "warmup": opts.warmup, "chunk": opts.chunk, "variants": variants,
            "result": str(out / f"result-w{world}.json")}
    path = out / f"spec-w{world}.json"
    path.write_text(json.dumps(spec, indent=1) + "\n")
    return path


def _launch(cfg: Config, *, world: int, spec: Path, nproc: int) -> int:
    launch_cfg = dataclasses.replace(cfg.launch, max_restarts=0)
    argv = launch.torchrun_args(launch_cfg, nproc_per_node=world, module=WORKER, module_args=[str(spec)])
    with _threads(nproc):
        return launch.run_torchrun(argv, restarts=False)


def run_bench(cfg: Config, *, opts: BenchOptions, out_dir: str | Path, check: Callable[[Config], Any] | None = None,
              ) -> int:
    """Run the benchmark; print the table; write bench.json and the plots into `out_dir`. Exit code.
    `check(cfg)`: the launcher's pre-flight of the recipe's factories, after the plan, before anything is written."""

    if cfg.launch.nnodes != 1:
        raise ConfigError(f"launch.nnodes={cfg.launch.nnodes}: dptrain bench runs on one node (use launch.nnodes=1)")
    cells = plan_cells(cfg, opts=opts)
    if check is not None:
        check(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    skipped = [{"variant": c.variant, "world": c.world, "mode": c.mode, "skipped": c.skipped}
               for c in cells if c.skipped]
    for world in sorted({c.world for c in cells}):
        runnable = [c for c in cells if c.world == world and c.skipped is None]
        if not runnable:
            continue
        print(f"dptrain bench: world size {world}: {len(runnable)} variant(s), {opts.warmup} warm-up + "
              f"{opts.steps} timed steps each, interleaved {opts.chunk} at a time", file=sys.stderr, flush=True)
        rc = _launch(cfg, world=world, spec=_spec(runnable, world=world, opts=opts, out=out),
                     nproc=opts.nproc)
        if rc != 0:
            print(f"dptrain bench: the world-size-{world} launch failed (exit {rc})", file=sys.stderr)
            return rc
        result = json.loads((out / f"result-w{world}.json").read_text())
        results.append(result)
        skipped += result["skipped"]
    summary = report.summarize(results, skipped=skipped, opts=opts)
    report.print_table(summary)
    report.write(summary, out=out)
    return 0
