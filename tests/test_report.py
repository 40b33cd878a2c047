"""`dptrain report`: a page and its PNGs from a real 2-rank run (forked gloo ranks through the real
`Trainer(cfg).fit()`, rank 1 made slow so that the straggler check names it, checkpoints, a restart
record written by checkpoint/attempts.py's own code), and from a copy that looks like a run still
going (metrics.jsonl cut in the middle of a line, no summary.json). Each page is copied elsewhere
and opened in headless Chromium (Debian's `chromium`), which must load it without errors and show
every image (naturalWidth > 0).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import subprocess_env
from support.mp import run_ranks
from support.parity import fit_items

pytest.importorskip(
    "matplotlib", reason="matplotlib is not installed (the optional extra: pip install 'dptrain[report]')"
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SLOW_S = 0.03
FIGURES = ("loss", "lr", "throughput", "step_time", "split", "memory", "events")

ITEMS = [
    "model.factory=dptrain.models.toy:build_mlp",
    "model.kwargs={}",
    "data.factory=dptrain.models.toy:build_regression_data",
    "data.kwargs={}",
    "data.num_workers=0",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=20",
    "train.log_every_steps=2",
    "train.eval_every_steps=10",
    "train.loss=test_report:rank1_slow_loss",
    "parallel.strategy=ddp",
    "parallel.device=cpu",
    "parallel.timeout_s=60",
    "log.progress=false",
    "checkpoint.every_steps=10",
    "diagnostics.straggler_every_steps=10",
    "diagnostics.rss_every_steps=5",
]


def rank1_slow_loss(model, batch):
    """The model's own loss; rank 1 sleeps first, so it is the straggler."""
    if os.environ.get("RANK") == "1":
        time.sleep(SLOW_S)
    return model(batch)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report") / "run"
    run_ranks(fit_items, 2, ITEMS, str(out), timeout=200)
    # A restart record as a restarted rank 0 writes it (the previous attempt's progress files).
    from dptrain.checkpoint.attempts import ProgressFile, report_restart

    for rank in (0, 1):
        p = ProgressFile(out, rank=rank, attempt=0)
        p.step(7)
        if rank == 1:
            p.error("Traceback ...\nRuntimeError: injected failure for the report test")
        p.close()
    assert report_restart(out, attempt=1) is not None
    return out


def _open_in_chromium(page: Path, tmp: Path) -> dict:
    """Load `page` from a copy of its folder (elsewhere, so only relative references can work) with
    a check script added: it records every error event (script errors and failed image loads,
    caught in the capture phase) and every image's natural size, and writes them into the DOM,
    which --dump-dom prints."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian package chromium)")
    copy = tmp / "copied_report"
    shutil.copytree(page.parent, copy)
    check = """<script>
const dptrainErrors = [];
window.addEventListener('error', e => dptrainErrors.push(e.message || ('failed to load ' + (e.target.src || e.target))), true);
window.addEventListener('load', () => {
  const imgs = Array.from(document.images).map(i => ({src: i.getAttribute('src'), w: i.naturalWidth, h: i.naturalHeight, complete: i.complete}));
  const out = document.createElement('pre');
  out.id = 'dptrain-check';
  out.textContent = JSON.stringify({imgs: imgs, errors: dptrainErrors});
  document.body.appendChild(out);
});
</script>"""  # noqa: E501 (the page's script, one statement a line)
    html = (copy / page.name).read_text()
    (copy / "check.html").write_text(html.replace("<head>", "<head>" + check, 1))
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp / 'chromium-profile'}"]
    proc = subprocess.run(
        [
            *base,
            "--virtual-time-budget=10000",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
            (copy / "check.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    m = re.search(r'<pre id="dptrain-check">(.*?)</pre>', proc.stdout, re.S)
    assert m, f"the check script did not run: rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    result = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    result["console"] = [line for line in proc.stderr.splitlines() if "CONSOLE" in line]
    shot = tmp / "screenshot.png"
    subprocess.run(
        [*base, "--hide-scrollbars", "--window-size=1100,3800", f"--screenshot={shot}", (copy / page.name).as_uri()],
        capture_output=True,
        timeout=90,
        check=True,
    )
    assert shot.stat().st_size > 10_000
    result["screenshot"] = shot
    return result


def _assert_loads(result: dict, expected: set[str]) -> None:
    assert result["errors"] == [] and result["console"] == [], result
    shown = {i["src"]: i for i in result["imgs"]}
    assert set(shown) == {f"{name}.png" for name in expected}, shown
    for src, img in shown.items():
        assert img["complete"] and img["w"] > 100 and img["h"] > 50, (src, img)


@pytest.mark.timeout(300)
def test_report_of_a_finished_two_rank_run(run_dir: Path, tmp_path: Path) -> None:
    from dptrain.tools.report import build_report

    page = build_report(run_dir, out_dir=tmp_path / "report")
    text = page.read_text()
    assert "Finished: 20 steps" in text and "Not shown" not in text
    for kind in ("checkpoint", "straggler", "restart"):
        assert f"<td>{kind}</td>" in text, kind
    assert "rank 1 on" in text and "injected failure" in text and "step_000020: committed" in text
    result = _open_in_chromium(page, tmp_path)
    _assert_loads(result, set(FIGURES))
    keep = os.environ.get("DPTRAIN_REPORT_SCREENSHOT")  # to look at it: a path to copy the screenshot to
    if keep:
        shutil.copy(result["screenshot"], keep)


@pytest.mark.timeout(300)
def test_report_of_a_run_still_going(run_dir: Path, tmp_path: Path) -> None:
    """metrics.jsonl cut in the middle of a line, no summary.json, diagnostics.jsonl cut too."""
    from dptrain.tools.report import build_report

    live = tmp_path / "live"
    shutil.copytree(run_dir, live)
    (live / "summary.json").unlink()
    shutil.rmtree(live / "final")
    metrics = (live / "metrics.jsonl").read_text()
    cut = metrics.index('"step": 12')  # inside the step-12 record: steps 2..10 and the first val stay whole
    (live / "metrics.jsonl").write_text(metrics[:cut])
    diag = (live / "diagnostics.jsonl").read_text()
    (live / "diagnostics.jsonl").write_text(diag[: len(diag) - 40])
    page = build_report(live, out_dir=tmp_path / "live_report")
    text = page.read_text()
    assert "In progress or stopped without a summary: last recorded step 10" in text
    assert "metrics.jsonl: 1" in text and "diagnostics.jsonl: 1" in text
    _assert_loads(_open_in_chromium(page, tmp_path), set(FIGURES))


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_report_of_a_run_that_has_written_nothing_yet(tmp_path: Path) -> None:
    from dptrain.tools.report import build_report

    (tmp_path / "run").mkdir()
    page = build_report(tmp_path / "run")
    assert page == tmp_path / "run" / "report" / "index.html"
    text = page.read_text()
    assert "<img" not in text and text.count("Not shown") == len(FIGURES)
    assert "last recorded step 0" in text


@pytest.mark.fast
def test_read_jsonl_skips_a_half_written_line(tmp_path: Path) -> None:
    from dptrain.tools.report.read import read_jsonl

    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"step": 1, "loss": 2.0}\n\n{"step": 2, "loss": null, "loss_nonfinite": "nan"}\n[1]\n{"step": 3, "lo'
    )
    records, bad = read_jsonl(path)
    assert records == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": None, "loss_nonfinite": "nan"}] and bad == 2


@pytest.mark.fast
def test_cli_report_errors(tmp_path: Path, monkeypatch, capsys) -> None:
    from dptrain.cli.main import main

    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")  # a run that has not logged yet
    assert main(["report", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'dptrain[report]'" in err and "matplotlib" in err
    assert not (tmp_path / "run" / "report").exists()  # nothing written


@pytest.mark.timeout(300)
def test_cli_report_on_the_run(run_dir: Path, tmp_path: Path) -> None:
    env = subprocess_env(tests=False)
    proc = subprocess.run(
        [sys.executable, "-m", "dptrain", "report", str(run_dir), "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted([*(f"{n}.png" for n in FIGURES), "index.html"])


@pytest.mark.timeout(300)
def test_the_browser_check_catches_a_missing_image(run_dir: Path, tmp_path: Path) -> None:
    """Guard: the Chromium check fails a page whose image is gone (so its passing means something)."""
    from dptrain.tools.report import build_report

    page = build_report(run_dir, out_dir=tmp_path / "report")
    (page.parent / "memory.png").unlink()
    result = _open_in_chromium(page, tmp_path)
    assert any("memory.png" in e for e in result["errors"]), result
    assert [i["w"] for i in result["imgs"] if i["src"] == "memory.png"] == [0]
    with pytest.raises(AssertionError):
        _assert_loads(result, set(FIGURES))


def test_mfu_and_cuda_memory_get_their_own_axes(tmp_path: Path) -> None:
    """Records as a GPU run with the MFU meter writes them (mfu is a fraction; CUDA memory per rank)."""
    from dptrain.tools.report import plots
    from dptrain.tools.report.read import read_run

    run = tmp_path / "gpu_run"
    run.mkdir()
    rows = [{"step": s, "loss": 3.0 - s / 10, "lr": 1e-3, "tokens_per_s": 1e5, "mfu": 0.41} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mem = {
        "kind": "memory",
        "step": 2,
        "ranks": [
            {
                "rank": r,
                "host": "h",
                "rss_mb": 900.0,
                "cuda_allocated_mb": 1000.0 + r,
                "cuda_reserved_mb": 1500.0,
                "cuda_peak_mb": 1200.0,
                "leaks": [],
            }
            for r in (0, 1)
        ],
    }
    (run / "diagnostics.jsonl").write_text(json.dumps(mem) + "\n")
    records = read_run(run)
    throughput, memory = plots.throughput_figure(records), plots.memory_figure(records)
    assert [ax.get_ylabel() for ax in throughput.axes] == ["tokens/s", "MFU (%)"]
    assert list(throughput.axes[1].lines[0].get_ydata()) == pytest.approx([41.0] * 3)
    assert [ax.get_ylabel() for ax in memory.axes] == ["host RSS (MiB)", "CUDA (MiB)"]
    assert len(memory.axes[1].lines) == 4  # allocated and peak of each rank
    records.train = [{k: v for k, v in r.items() if k != "mfu"} for r in records.train]
    assert len(plots.throughput_figure(records).axes) == 1  # no mfu key: no MFU axis
