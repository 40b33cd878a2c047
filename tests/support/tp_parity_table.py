"""Print the tensor-parallel parity ladder: max |w - w_ref| of the final weights per rung.

    python tests/tp_parity_table.py

Each rung (tests/test_tensor_parallel.py's layouts) trains the tiny LLaMA with `dptrain.train.trainer.Trainer` on
forked gloo ranks and is compared with the single-process SGD reference of
`tests/support/parity.py` at the data-parallel rungs' tolerance.
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the `support` package

import torch  # noqa: E402

from support import parity as tp  # noqa: E402

RUNGS = [(r, a, ()) for r in tp.RUNGS for a in (1, 2)] + [
    ("tp2", 2, ("parallel.sequence_parallel=false",)), ("tp2", 2, ("parallel.loss_parallel=true",)),
    ("tp2", 2, ("parallel.activation_checkpointing=selective",)),
    ("fsdp2xtp2", 2, ("parallel.sequence_parallel=false",)),
]


def main() -> int:
    warnings.filterwarnings("ignore")
    want, _ = tp.reference("llama", global_batch=tp.GLOBAL)
    print(f"tiny LLaMA {tp.LLAMA_KWARGS}, SGD lr={tp.LR}, {tp.STEPS} steps, global batch {tp.GLOBAL}; "
          f"tolerance rtol={tp.RTOL:g} atol={tp.ATOL:g}")
    print(f"{'rung':<10} {'option':<38} {'accum':>5} {'world':>5}  {'max |dw|':>10}  {'time':>6}  result")
    failures = 0
    for rung, accum, extra in RUNGS:
        with tempfile.TemporaryDirectory(prefix="tp-parity-") as d:
            t0 = time.perf_counter()
            got, _ = tp.train(tp.tp_items(rung, accum, *extra), tp.RUNGS[rung][2], Path(d), timeout=200)
            seconds = time.perf_counter() - t0
        ok = all(torch.allclose(got[k], want[k], rtol=tp.RTOL, atol=tp.ATOL) for k in want)
        failures += not ok
        print(f"{rung:<10} {' '.join(extra) or '-':<38} {accum:>5} {tp.RUNGS[rung][2]:>5}  "
              f"{tp.max_abs_diff(got, want):>10.3e}  {seconds:>5.1f}s  {'ok' if ok else 'FAIL'}", flush=True)
    print(f"{len(RUNGS) - failures}/{len(RUNGS)} rungs within tolerance")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
