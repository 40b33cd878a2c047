"""The `diagnostics` config section: defaults, validation messages, overrides."""

from __future__ import annotations

import pytest

from dptrain.config import Config, ConfigError, hang_timeout, validate
from dptrain.config.load import load_config

pytestmark = pytest.mark.fast


@pytest.mark.timeout(30)
def test_defaults_are_valid_and_the_watchdog_fires_before_the_collective_timeout() -> None:
    cfg = Config()
    validate(cfg)
    assert hang_timeout(cfg.diagnostics, pg_timeout_s=cfg.parallel.timeout_s) == 300
    # a short collective timeout (as in tests) shortens the watchdog's instead of being refused
    validate(load_config(None, ["parallel.timeout_s=60"]))
    assert hang_timeout(cfg.diagnostics, pg_timeout_s=60) == 30
    assert cfg.diagnostics.nonfinite == "off"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "diagnostics.nonfinite=ignore",
            "diagnostics.nonfinite='ignore' is not valid; choose one of: skip, error, off",
        ),
        ("diagnostics.straggler_every_steps=-1", "diagnostics.straggler_every_steps=-1 is not valid"),
        (
            "diagnostics.max_consecutive_skips=0",
            "diagnostics.max_consecutive_skips=0 is not valid; it must be an integer >= 1",
        ),
        ("diagnostics.rss_window=2", "diagnostics.rss_window=2 is not valid; it must be an integer >= 3"),
        (
            "diagnostics.straggler_margin=0",
            "diagnostics.straggler_margin=0.0 is not valid; it must be a finite number > 0",
        ),
        (
            "diagnostics.hang_timeout_s=-5",
            "diagnostics.hang_timeout_s=-5.0 is not valid; it must be a finite number in \\[0, ",
        ),
        ("diagnostics.hang_timeout_s=700", "diagnostics.hang_timeout_s=700 must be below parallel.timeout_s=600"),
    ],
)
def test_bad_values_are_refused_with_the_value_named(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(load_config(None, [override]))


@pytest.mark.timeout(30)
def test_collective_checks_are_refused_under_ddp_which_crashes_with_them():
    with pytest.raises(ConfigError, match="check_collectives=true cannot be used with parallel.strategy='ddp'"):
        validate(load_config(None, ["diagnostics.check_collectives=true"]))
    validate(load_config(None, ["diagnostics.check_collectives=true", "parallel.strategy=fsdp"]))


@pytest.mark.timeout(30)
def test_overrides_reach_the_section_and_zero_turns_checks_off() -> None:
    cfg = load_config(
        None,
        [
            "diagnostics.hang_timeout_s=0",
            "diagnostics.drift_every_steps=0",
            "diagnostics.nonfinite=skip",
            "parallel.timeout_s=30",
        ],
    )
    validate(cfg)
    # YAML 1.1 reads `off` as False; the text field gets its word back
    assert load_config(None, ["diagnostics.nonfinite=off"]).diagnostics.nonfinite == "off"
    assert (cfg.diagnostics.hang_timeout_s, cfg.diagnostics.drift_every_steps, cfg.diagnostics.nonfinite) == (
        0,
        0,
        "skip",
    )
