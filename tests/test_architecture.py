"""The package's architecture as checks that can fail (docs/architecture.md explains it; the layer
contract itself is `lint-imports`, run by .ci/run with pyproject.toml's [tool.importlinter]):

- no private name (`_x`) is imported from another package of dptrain;
- the top of the package holds only the public face (`__init__`, `__main__`, the `api` package);
- the old module names users store in configs and scripts still import, as the same module;
- docs/architecture.md names only paths and modules that exist, quotes the layer contract, and mentions
  every package.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dptrain

pytestmark = pytest.mark.fast
SRC = Path(dptrain.__file__).resolve().parent


def _package(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return parts[0] if len(parts) > 1 else ""


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("dptrain"):
            yield node.lineno, node.module, [a.name for a in node.names]


def test_no_private_name_is_imported_across_packages():
    found = []
    for path in SRC.rglob("*.py"):
        here = _package(path)
        for line, module, names in _imports(path):
            there = module.split(".")[1] if "." in module else ""
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and there != here:
                found.append(f"{path.relative_to(SRC)}:{line}: from {module} import {', '.join(private)}")
    assert not found, "private names imported across packages:\n" + "\n".join(found)


def test_the_top_of_the_package_is_only_the_public_face():
    assert sorted(p.name for p in SRC.glob("*.py")) == ["__init__.py", "__main__.py"]
    assert (SRC / "api" / "__init__.py").is_file()  # the own-loop API, a package of small modules


def test_config_import_paths_of_the_built_in_recipe_resolve():
    from dptrain.config import Config
    from dptrain.train.build import import_object

    cfg = Config()
    assert callable(import_object(cfg.model.factory)) and callable(import_object(cfg.data.factory))


def _function_imports(path: Path):
    """(line, import block's first line) of every first-party import inside a function of `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            for body in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
                if not isinstance(body, list):
                    continue
                first = None
                for st in body:
                    first_party = isinstance(st, ast.ImportFrom) and (st.module or "").startswith("dptrain")
                    first = (first or st.lineno) if first_party else None
                    if first_party:
                        yield st.lineno, first


def test_every_import_inside_a_function_says_why_it_is_lazy():
    """First-party imports belong at the top of a module; one inside a function stays only with a
    `# lazy: reason` comment above its block (torch kept out of `dptrain --help`, an optional extra).
    docs/architecture.md states the count."""
    missing, count = [], 0
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text().splitlines()
        for line, first in _function_imports(path):
            count += 1
            if not lines[first - 2].strip().startswith("# lazy:"):
                missing.append(f"{path.relative_to(SRC)}:{line}")
    assert not missing, "imports inside functions without a `# lazy: reason` comment:\n" + "\n".join(missing)
    assert count <= 40, f"{count} imports inside functions: hoist the ones no longer needed lazily"


def test_help_imports_no_torch():
    code = "import sys; from dptrain.cli.main import main; main(['--help']); assert 'torch' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------ docs/architecture.md stays true
ROOT = SRC.parents[1]
DOC = ROOT / "docs" / "architecture.md"
PY_PATH = re.compile(r"(?<![\w./-])((?:[a-z_][a-z0-9_]*/)+[a-z_][a-z0-9_]*\.py)\b")
FOLDER = re.compile(r"`((?:[a-z_][a-z0-9_]*/)+)`")
DOTTED = re.compile(r"(?<![\w.])dptrain(?:\.[a-z_][a-z0-9_]*)+")
TOP_LEVEL = ("tests/", "benchmarks/", "docs/", "src/", "examples/")


def _exists(path: str) -> bool:
    """A path as the doc writes it: from the checkout's root (tests/, benchmarks/, ...) or inside the package."""
    return (ROOT / path).exists() if path.startswith(TOP_LEVEL) else (SRC / path).exists()


def _module_exists(dotted: str) -> bool:
    """`dptrain.a.b` is a module or package, or `dptrain.a` is one and `b` a name in it; `dptrain.x`: a module,
    or a name the package exports."""
    parts = dotted.split(".")[1:]
    if len(parts) == 1 and parts[0] in dptrain.__all__:
        return True
    for keep in (len(parts), len(parts) - 1):
        base = SRC.joinpath(*parts[:keep])
        if keep and (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
            return True
    return False


def _contract_layers() -> list[str]:
    """The `layers` list of pyproject's layers contract (read as text: tomllib is Python 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text[text.index('type = "layers"'):]
    return re.findall(r'"([^"]+)"', block[block.index("layers = ["):block.index("]")])


def test_every_module_path_named_in_the_architecture_doc_exists():
    text = DOC.read_text()
    paths = set(PY_PATH.findall(text)) | set(FOLDER.findall(text))
    assert {"train/trainer.py", "parallel/compose.py", "tests/test_parity.py"} <= paths  # the scan sees them
    missing = sorted(p for p in paths if not _exists(p))
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    dotted = set(DOTTED.findall(text))
    assert "dptrain.tools.bench.harness" in dotted
    unknown = sorted(d for d in dotted if not _module_exists(d))
    assert not unknown, f"docs/architecture.md names modules that do not exist: {unknown}"


def test_the_layers_table_is_the_import_contract_and_its_packages_exist():
    text = DOC.read_text()
    layers = _contract_layers()
    quoted = text.index("layers = [")
    for layer in layers:  # the contract is quoted verbatim, in order
        at = text.find(f'"{layer}"', quoted)
        assert at > quoted, f"docs/architecture.md does not quote the layer {layer!r} of pyproject's contract in order"
        quoted = at
    section = text[text.index("## Layers"):text.index("## The step")]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    in_table = [name.rstrip("/") for row in rows for name in FOLDER.findall(row.split("|")[1])]
    in_contract = [p.removeprefix("dptrain.") for layer in layers for p in layer.split(" | ")]
    assert in_table == in_contract, "the layers table lists other packages than pyproject's contract, or another order"
    assert all((SRC / name / "__init__.py").is_file() for name in in_table)


def test_every_top_level_package_is_in_the_architecture_doc():
    text = DOC.read_text()
    packages = sorted(p.parent.name for p in SRC.glob("*/__init__.py"))
    assert "train" in packages
    missing = [p for p in packages if f"`{p}/`" not in text]
    assert not missing, f"docs/architecture.md never mentions these packages: {missing}"
