"""DeepSpeed as the oracle: every config read by DeepSpeed 0.19's own code (DeepSpeedConfig, the optimizer its
engine builds, its scheduler objects stepped for the whole run, its fp16 config) and by dptrain, compared row by
row (tests/support/deepspeed_oracle.py). Configs: DeepSpeed's own unit-test cases (tests/support/deepspeed_cases.py),
the public configs of tests/test_deepspeed_configs.py, and configs drawn at random (seeded) within DeepSpeed's
schema. Every disagreement must be one of the listed remaining differences, each with its reason.
benchmarks/acceptance/deepspeed_conformance.py prints the table (docs/results/deepspeed_conformance.md).
"""

from __future__ import annotations

import random

import pytest

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed (the oracle) is not installed: .ci/run installs it")

from support.deepspeed_cases import deepspeed_unit_cases  # noqa: E402
from support.deepspeed_oracle import (  # noqa: E402
    compare,
    deepspeed_reading,
    dptrain_reading,
    known_difference,
    lr_agree,
    random_config,
)
from support.public_deepspeed_configs import CASES  # noqa: E402

pytestmark = pytest.mark.fast

UNIT = deepspeed_unit_cases()


def _unexplained(ds: dict, dp: int) -> list[tuple[str, str]]:
    return [(row, detail) for row, ok, detail in compare(ds, dp=dp) if not ok and not known_difference(ds, row)]


@pytest.mark.timeout(120)
def test_deepspeed_unit_test_cases_read_as_deepspeed_reads_them() -> None:
    assert len(UNIT) > 90
    bad = {name: d for name, ds, dp in UNIT if (d := _unexplained(ds, dp))}
    assert bad == {}


@pytest.mark.timeout(120)
def test_public_configs_read_as_deepspeed_reads_them() -> None:
    bad = {src: d for src, ds, _ in CASES if (d := _unexplained(ds, 2))}
    assert bad == {}


@pytest.mark.timeout(120)
def test_random_configs_within_deepspeeds_schema() -> None:
    rng = random.Random(22)
    rows = agree = 0
    for i in range(120):
        ds, dp = random_config(rng)
        result = compare(ds, dp=dp)
        rows += len(result)
        agree += sum(ok for _, ok, _ in result)
        assert _unexplained(ds, dp) == [], (i, ds, dp)
    assert rows > 500 and agree == rows


def test_a_difference_is_caught() -> None:
    """The harness can fail: a WarmupLR run with a changed warmup length disagrees with DeepSpeed on the lr row."""
    ds = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    rows = dict((r, ok) for r, ok, _ in compare(ds, dp=1))
    assert all(rows.values())
    ds_other = {**ds, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}}}
    theirs = deepspeed_reading(ds, dp=1, steps=30).rows["lr"]
    assert not lr_agree(theirs, dptrain_reading(ds_other, dp=1, steps=30).rows["lr"])
