"""`dptrain bench`: dptrain's strategies and compressions against a raw PyTorch DDP loop, side by side.

plan.py (variants, world sizes, scaling modes, refusals: before launch), run.py (one torchrun launch
per world size), worker.py (every variant in one process group, interleaved, on the same batches),
raw_ddp.py (the reference loop), report.py (table, bench.json, plots).
"""

from dptrain.tools.bench.cells import BenchOptions, all_variants, parse_options

__all__ = ["BenchOptions", "all_variants", "parse_options"]
