"""DeepSpeed's engine and dptrain train the same model on the same data from the same DeepSpeed JSON, 2 CPU
processes with gloo (tests/support/deepspeed_engine.py): per-step loss and final weights compared.

The DeepSpeed side is `deepspeed.initialize` on the toy MLP (seeded as dptrain seeds it), fed this rank's
micro-batches in dptrain's data order (GlobalBatchSampler), `engine.backward` / `engine.step` per micro-batch.
The dptrain side is `Trainer(load_config(ds.json))` on the same file (its `dptrain` section names the model and
data; DeepSpeed ignores it). The file: torch_adam (torch.optim.AdamW on both sides; weight_decay 0: dptrain does
not decay 1-D parameters, DeepSpeed decays every parameter), WarmupLR, gradient clipping by DeepSpeed's default
(1.0), global batch 16 = micro 4 x GAS 2 x dp 2.

ZeRO 0 here: the final weights are bitwise DeepSpeed's (same all-reduce average, the same AdamW kernel on each
parameter, the same clipping); the logged loss within 1e-6 relative (each side averages its micro-batch losses in
its own order: one float32 rounding). ZeRO 1 (bitwise too) and 2 (flat partitions reduced in DeepSpeed's own
buckets: 1.5e-8 absolute) take about 20 s each and run in benchmarks/acceptance/deepspeed_conformance.py
(docs/results/deepspeed_conformance.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed (the reference) is not installed: .ci/run installs it")

from support.deepspeed_engine import deepspeed_rank, diffs, dptrain_rank, dptrain_result, ds_config  # noqa: E402
from support.mp import run_ranks  # noqa: E402


@pytest.mark.timeout(120)
def test_deepspeed_engine_and_dptrain_train_alike_zero0(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config(0)))
    ds_losses, ds_weights = run_ranks(deepspeed_rank, 2, str(path), timeout=90)[0]
    run_ranks(dptrain_rank, 2, str(path), str(tmp_path / "run"), timeout=90)
    ours, weights = dptrain_result(tmp_path / "run")
    assert ours == pytest.approx(ds_losses, rel=1e-6) and len(ours) == len(ds_losses)
    assert all(torch.equal(weights[k], ds_weights[k]) for k in ds_weights), diffs(weights, ds_weights)
