"""Print the parity ladder as a table: max |w - w_ref| of the final weights per rung.

    python tests/parity_table.py            # the toy MLP ladder + the LLaMA rungs
    python tests/parity_table.py --quick    # W=2 only

Each rung trains with `dptrain.train.trainer.Trainer` on W forked gloo ranks (strategy single runs in
this process) and is compared with the plain-PyTorch single-process reference of
`tests/support/parity.py`. "ok" means within the test's tolerance (assert_close rtol/atol).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the `support` package

import torch  # noqa: E402

from support import parity as tp  # noqa: E402

# label -> extra overrides of the rungs beyond the plain strategy
EXTRA = {"": (), "hsdp 2x2": tp.HSDP, "ac full": ("parallel.activation_checkpointing=full",),
         "ac selective": ("parallel.activation_checkpointing=selective",)}


def rung(strategy: str, accum: int, world_size: int, model: str = "mlp", label: str = "") -> tuple[float, bool, float]:
    with tempfile.TemporaryDirectory(prefix="parity-") as d:
        t0 = time.perf_counter()
        items = tp.overrides(strategy=strategy, world_size=world_size, accum=accum, model=model) + list(EXTRA[label])
        got, _ = tp.train(items, world_size, Path(d), timeout=120)
        seconds = time.perf_counter() - t0
    want, _ = tp.reference(model, global_batch=tp.GLOBAL_BATCH[world_size])
    ok = all(torch.allclose(got[k], want[k], rtol=tp.RTOL, atol=tp.ATOL) for k in want)
    return tp.max_abs_diff(got, want), ok, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="world size 2 only, no LLaMA rungs")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    rungs = [("single", a, 1, "mlp", "") for a in (1, 2)]
    sizes = (2,) if args.quick else (2, 3)
    rungs += [(s, a, w, "mlp", "") for s in tp.MULTI for a in (1, 2) for w in sizes]
    if not args.quick:
        rungs += [(s, 2, 2, "llama", "") for s in ("ddp", "fsdp")]
        rungs += [("fsdp", a, 4, "mlp", "hsdp 2x2") for a in (1, 2)]
        rungs += [("single", 2, 1, "mlp", "ac full"), ("ddp", 2, 2, "mlp", "ac selective"),
                  ("fsdp", 2, 2, "mlp", "ac full"), ("zero2", 2, 2, "mlp", "ac selective"),
                  ("fsdp", 2, 2, "llama", "ac selective")]
    print(f"parity vs plain single-process PyTorch on the global batch: SGD lr={tp.LR}, {tp.STEPS} steps, "
          f"tolerance rtol={tp.RTOL:g} atol={tp.ATOL:g}")
    header = (f"{'model':<6} {'strategy':<8} {'layout/option':<13} {'accum':>5} {'world':>5} {'global':>6} "
              f"{'micro':>5}  {'max |dw|':>10}  {'time':>6}  result")
    print(header)
    print("-" * len(header))
    failures = 0
    for strategy, accum, world, model, label in rungs:
        g = tp.GLOBAL_BATCH[world]
        diff, ok, seconds = rung(strategy, accum, world, model, label)
        failures += not ok
        print(
            f"{model:<6} {strategy:<8} {label or '-':<13} {accum:>5} {world:>5} {g:>6} {g // (world * accum):>5}  "
            f"{diff:>10.3e}  "
            f"{seconds:>5.1f}s  {'ok' if ok else 'FAIL'}",
            flush=True,
        )
    print(f"{len(rungs) - failures}/{len(rungs)} rungs within tolerance")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
