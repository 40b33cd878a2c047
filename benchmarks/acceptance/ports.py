"""The three ports of docs/guides/porting.md, measured.

    PYTHONPATH=src python benchmarks/acceptance/ports.py [--json OUT.json] [--docs]

`--docs` writes the three diffs into docs/guides/porting.md (between its `<!-- diff:NAME -->` markers;
tests/test_ports.py checks they are the files' diffs) and the measured table (between `<!-- results -->`).

For each of examples/ports/{mnist,word_lm,nlp}_base.py and its dptrain port it reports:

- lines changed: `diff -u base port | grep -c '^[+-][^+-]'`, split into added and removed, and the same
  without the module docstrings (whose text differs only in the run commands);
- parity: the per-step training loss of the port (as plain `python`: a world of one; and under
  `dptrain launch --nproc-per-node 2`) against the base's, with the global batch equal, dropout off (a
  dropout mask is drawn per rank, so 2 ranks draw other masks than 1 process for the same batch) and
  OMP_NUM_THREADS=1 for every run. The port records the mean over the ranks of their losses, which is the
  global batch's loss (equal shares). Also the evaluation results (test loss and accuracy; validation
  losses; accuracy and F1 on an uneven set);
- what was free: MNIST stopped after 2 of 3 epochs at world 2 (its Checkpointer saves at every epoch end)
  and run again with --epochs 3 at world 1, and at world 2: the third epoch's losses against the
  uninterrupted world-2 run.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PORTS = ROOT / "examples" / "ports"

# Each port: the arguments of a parity run (both scripts take them), and what only some runs need.
ARGS: dict[str, list[str]] = {
    "mnist": ["--epochs", "3", "--no-dropout"],
    "word_lm": ["--epochs", "3", "--dropout", "0"],
    "nlp": ["--num_epochs", "2", "--dropout", "0"],
}
TOLERANCE = 1e-4  # relative, per step, for runs whose arithmetic differs (2 ranks: half batches, all-reduce)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def run(script: str, args: list[str], *, nproc: int, cwd: Path) -> tuple[dict[str, Any], float]:
    """Run a script (nproc 0: plain python; else under dptrain launch) and return what it wrote to --losses."""
    out = cwd / f"losses_{time.monotonic_ns()}.json"
    head = [sys.executable, str(PORTS / script)]
    if nproc:
        head = [sys.executable, "-m", "dptrain", "launch", "--nproc-per-node", str(nproc), str(PORTS / script)]
    t0 = time.perf_counter()
    r = subprocess.run([*head, *args, "--losses", str(out)], cwd=cwd, env=env(), capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{script} {args} (nproc {nproc}) exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                           f"{r.stderr[-3000:]}")
    return json.loads(out.read_text()), time.perf_counter() - t0


def lines_changed(name: str) -> dict[str, int]:
    base, port = PORTS / f"{name}_base.py", PORTS / f"{name}_dptrain.py"
    counts = {}
    for key, (a, b) in {"all": (base, port), "code": (_code(base), _code(port))}.items():
        diff = subprocess.run(["diff", "-u", str(a), str(b)], capture_output=True, text=True).stdout.splitlines()
        changed = [d for d in diff if d[:1] in "+-" and d[1:2] not in ("+", "-")]
        counts[f"{key}_added"] = sum(d.startswith("+") for d in changed)
        counts[f"{key}_removed"] = sum(d.startswith("-") for d in changed)
    return counts


def _code(path: Path) -> Path:
    """The file without its module docstring (in a temporary file)."""
    text = path.read_text()
    end = text.index('"""', 3) + 3
    out = Path(tempfile.mkstemp(suffix=".py")[1])
    out.write_text(text[end:])
    return out


def max_rel(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise AssertionError(f"{len(a)} steps against {len(b)}")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def port_args(name: str, tmp: Path, tag: str) -> list[str]:
    extra = {"mnist": ["--out", str(tmp / f"ckpt_{tag}")], "word_lm": ["--save", str(tmp / f"model_{tag}.pt")]}
    return [*ARGS[name], *extra.get(name, [])]


def measure(name: str, tmp: Path) -> dict[str, Any]:
    base_extra = ["--save", str(tmp / "model_base.pt")] if name == "word_lm" else []
    base, t_base = run(f"{name}_base.py", [*ARGS[name], *base_extra], nproc=0, cwd=tmp)
    w1, t1 = run(f"{name}_dptrain.py", port_args(name, tmp, "w1"), nproc=0, cwd=tmp)
    w2, t2 = run(f"{name}_dptrain.py", port_args(name, tmp, "w2"), nproc=2, cwd=tmp)
    evals = {k: v for k, v in base.items() if k != "loss"}
    row: dict[str, Any] = {
        "port": name,
        **lines_changed(name),
        "steps": len(base["loss"]),
        "w1_bitwise": w1["loss"] == base["loss"],
        "w1_max_rel": max_rel(w1["loss"], base["loss"]),
        "w2_max_rel": max_rel(w2["loss"], base["loss"]),
        "eval_base": evals,
        "eval_w1": {k: w1[k] for k in evals},
        "eval_w2": {k: w2[k] for k in evals},
        "seconds": {"base": round(t_base, 1), "w1": round(t1, 1), "w2": round(t2, 1)},
    }
    if name == "mnist":
        row["resume"] = resume_mnist(tmp, w2)
    return row


def resume_mnist(tmp: Path, uninterrupted_w2: dict[str, Any]) -> dict[str, Any]:
    """Stop after epoch 2 of 3 at world 2; resume at world 1 and (a copy) at world 2."""
    first = [a if a != "3" else "2" for a in ARGS["mnist"]]  # --epochs 2
    ckpt = tmp / "ckpt_stop"
    run("mnist_dptrain.py", [*first, "--out", str(ckpt)], nproc=2, cwd=tmp)
    shutil.copytree(ckpt, tmp / "ckpt_stop_copy")
    at_w1, _ = run("mnist_dptrain.py", [*ARGS["mnist"], "--out", str(ckpt)], nproc=0, cwd=tmp)
    at_w2, _ = run("mnist_dptrain.py", [*ARGS["mnist"], "--out", str(tmp / "ckpt_stop_copy")], nproc=2, cwd=tmp)
    ref = uninterrupted_w2["loss"][16:]  # epoch 3: 8 steps of 512 // 64
    return {
        "resumed_steps": len(at_w1["loss"]),
        "w2_to_w2_bitwise": at_w2["loss"] == ref and at_w2["test"] == uninterrupted_w2["test"][2:],
        "w2_to_w1_max_rel": max_rel(at_w1["loss"], ref),
    }


def guide_diff(name: str) -> str:
    """The unified diff base -> port as the guide shows it."""
    a, b = (f"examples/ports/{name}_{kind}.py" for kind in ("base", "dptrain"))
    lines = difflib.unified_diff((ROOT / a).read_text().splitlines(keepends=True),
                                 (ROOT / b).read_text().splitlines(keepends=True), fromfile=a, tofile=b)
    return "".join(lines)


def replace_block(text: str, marker: str, body: str) -> str:
    """Replace what lies between `<!-- marker -->` and `<!-- /marker -->` (inserting the end marker the first time)."""
    start, end = f"<!-- {marker} -->\n", f"<!-- /{marker} -->\n"
    i = text.index(start) + len(start)
    j = text.index(end, i) if end in text[i:] else i
    return text[:i] + body + end + text[j + len(end) if j != i else i:]


def write_docs(rows: list[dict[str, Any]] | None) -> None:
    page = ROOT / "docs" / "guides" / "porting.md"
    text = page.read_text()
    for name in ARGS:
        text = replace_block(text, f"diff:{name}", f"```diff\n{guide_diff(name)}```\n")
    if rows:
        text = replace_block(text, "results", table(rows) + "\n")
    page.write_text(text)


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| port | lines +/− (code only) | steps | world 1 vs base | world 2 vs base (max rel.) "
        "| evaluation (base / w1 / w2) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        w1 = "bitwise" if r["w1_bitwise"] else f"{r['w1_max_rel']:.1e}"
        ev = " / ".join(_short(r[k]) for k in ("eval_base", "eval_w1", "eval_w2"))
        out.append(f"| {r['port']} | +{r['all_added']}/−{r['all_removed']} (+{r['code_added']}/−{r['code_removed']}) "
                   f"| {r['steps']} | {w1} | {r['w2_max_rel']:.1e} | {ev} |")
    for r in rows:
        if "resume" in r:
            res = r["resume"]
            out.append(f"\n{r['port']}: stopped after epoch 2 at world 2, resumed for {res['resumed_steps']} steps: "
                       f"at world 2 bitwise={res['w2_to_w2_bitwise']}, at world 1 max rel. "
                       f"{res['w2_to_w1_max_rel']:.1e} against the uninterrupted world-2 run")
    return "\n".join(out)


def _short(ev: dict[str, Any]) -> str:
    def last(v: Any) -> Any:
        return v[-1] if isinstance(v, list) else v
    parts = []
    for k, v in ev.items():
        v = last(v)
        if isinstance(v, dict):
            parts += [f"{kk} {vv:.4g}" for kk, vv in v.items()]
        else:
            parts.append(f"{k} {v:.4g}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the rows as JSON")
    p.add_argument("--only", choices=sorted(ARGS), action="append", help="measure only these ports")
    p.add_argument("--docs", action="store_true", help="write the diffs and the table into docs/guides/porting.md")
    p.add_argument("--diffs-only", action="store_true", help="with --docs: write only the diffs, measure nothing")
    a = p.parse_args(argv)
    if a.docs and a.diffs_only:
        write_docs(None)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in a.only or list(ARGS):
            rows.append(measure(name, Path(d)))
    print(table(rows))
    if a.docs:
        write_docs(rows)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    ok = all(r["w1_bitwise"] or r["w1_max_rel"] <= TOLERANCE for r in rows)
    ok = ok and all(r["w2_max_rel"] <= TOLERANCE for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
