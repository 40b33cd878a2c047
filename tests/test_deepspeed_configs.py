"""Real public DeepSpeed configs: each loads with the meaning DeepSpeed gives it, or is refused with a
reason and an alternative. Every case names its source (repository and path); the JSON is trimmed to
the keys that matter to the mapping plus a few that dptrain ignores ("auto" values kept as they are).

Expected values are DeepSpeed's reading at a data-parallel size of 2:
batch sizes by `_set_batch_related_parameters`; "Adam" is AdamW unless adam_w_mode is false; missing
optimizer params take FusedAdam's defaults (weight_decay 0, betas (0.9, 0.999), eps 1e-8); no scheduler
block is a constant lr; WarmupLR's warmup is `log` over warmup_num_steps (default 1000); fp16's
loss_scale_window defaults to 1000 and initial_scale_power to 16.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dptrain.config import ConfigError, resolve
from dptrain.config.deepspeed import from_deepspeed
from dptrain.config.load import build_config
from support import ROOT
from support.public_deepspeed_configs import CASES

pytestmark = pytest.mark.fast

def _check(cfg: Any, expected: dict[str, Any]) -> None:
    expected = dict(expected)
    r = resolve(cfg, world_size=expected.pop("world", 2), cuda_available=False)
    o, p = cfg.optim, cfg.parallel
    got = {
        "strategy": p.strategy,
        "offload": p.cpu_offload,
        "batch": (r.global_batch_size, r.micro_batch_size, r.grad_accum_steps),
        "optim": (o.name, o.lr, o.weight_decay, o.betas),
        "lr": o.lr,
        "sched": (o.schedule, o.schedule_convention, o.warmup_type, o.warmup_steps),
        "dtype": cfg.precision.dtype,
        "growth": cfg.precision.growth_interval,
        "init_scale": cfg.precision.init_scale,
        "bucket_cap_mb": p.bucket_cap_mb,
        "clip": o.grad_clip,
        "pp": (r.dims.pp, p.pp_microbatches, p.pp_schedule),
        "lamb": (o.max_coeff, o.min_coeff, o.bias_correction, o.eps_inside_sqrt),
        "freeze_step": o.freeze_step,
        "nvme": p.nvme_offload_dir,
    }
    assert {k: got[k] for k in expected} == expected


def test_at_least_29_of_30_real_configs_load_with_deepspeeds_meaning() -> None:
    """Issue 22: each loading case's meaning is checked by test_real_deepspeed_config (and against DeepSpeed itself
    in test_deepspeed_conformance); the one refused is bing_bert's sparse_attention file, which DeepSpeed 0.19
    refuses too."""
    assert len(CASES) == 30
    assert len({src for src, _, _ in CASES}) == len(CASES)
    refused = [src for src, _, expected in CASES if isinstance(expected, str)]
    assert refused == ["microsoft/DeepSpeedExamples bing_bert/deepspeed_bsz64k_lamb_config_seq128.json"]


@pytest.mark.parametrize(("source", "ds", "expected"), CASES, ids=[c[0].split(" ")[-1] for c in CASES])
def test_real_deepspeed_config(source: str, ds: dict[str, Any], expected: dict[str, Any] | str) -> None:
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            from_deepspeed(ds)
        return
    d, _ = from_deepspeed(ds)
    _check(build_config(d), expected)


@pytest.mark.timeout(120)
def test_every_real_config_through_the_cli_is_clean(tmp_path: Path) -> None:
    """`dptrain config show FILE`: exit 0 with the mapping section, or exit 2 with one error line; never a traceback."""
    for i, (source, ds, expected) in enumerate(CASES[:6]):
        p = tmp_path / f"c{i}.json"
        p.write_text(json.dumps(ds))
        r = subprocess.run(
            [sys.executable, "-m", "dptrain", "config", "show", str(p), "--nproc-per-node", "2"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert "Traceback" not in r.stderr, (source, r.stderr)
        if isinstance(expected, str):
            assert r.returncode == 2, (source, r.stderr)
        else:
            assert r.returncode == 0, (source, r.stderr)
            assert "# DeepSpeed keys -> dptrain fields:" in r.stdout
            assert all(line.startswith("dptrain: warning: ") for line in r.stderr.splitlines()), r.stderr
