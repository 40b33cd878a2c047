"""Refusals before launch: `dptrain ARGS` run in this process must exit 2 with one clean message."""

from __future__ import annotations

import pytest

from dptrain.cli.main import main


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *named: str) -> str:
    """Run `dptrain argv` in this process; assert exit 2, no traceback, and every `named` text in the message."""
    rc = main(argv)
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 2, f"exit {rc} for {argv}:\n{text}"
    assert "Traceback" not in text, text
    for n in named:
        assert n in text, f"{n!r} not in the message for {argv}:\n{text}"
    return text
