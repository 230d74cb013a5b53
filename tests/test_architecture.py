"""The layering contract (pyproject.toml ``[tool.importlinter]``, checked by import-linter) and the
hygiene rules of docs/ARCHITECTURE.md: imports point down, kernels are a leaf over jax, no import cycles
between subpackages, no importlib dispatch, no package file over 600 lines, no benchmark history in
package code. The contract is also shown to FAIL on a deliberately added upward import."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("minimax_jax", "pallas_kernels")


def _lint_imports(root: str) -> subprocess.CompletedProcess:
    """``lint-imports`` over the packages under ``root`` with ``root``'s pyproject.toml."""
    env = dict(os.environ, PYTHONPATH=root)
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    cmd = [lint] if os.path.exists(lint) else [sys.executable, "-m", "importlinter.cli"]
    return subprocess.run([*cmd, "--no-cache", "--no-logo", os.path.join(root, "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def _package_files(root: str = REPO):
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    yield os.path.join(d, f)


def test_import_contracts_are_kept():
    r = _lint_imports(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"Contracts: [1-9]\d* kept, 0 broken", r.stdout), r.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory):
    """A copy of the packages and pyproject.toml, to break on purpose."""
    root = str(tmp_path_factory.mktemp("layering"))
    for pkg in PACKAGES:
        shutil.copytree(os.path.join(REPO, pkg), os.path.join(root, pkg),
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, "pyproject.toml"), root)
    return root


@pytest.mark.parametrize("importer, line", [
    ("pallas_kernels/msa/layout.py", "from minimax_jax.ops import registry\n"),    # a kernel importing upward
    ("minimax_jax/ops/registry.py", "import minimax_jax.model\n"),                # ops importing the model
    ("minimax_jax/model/layers.py", "def _late():\n    import minimax_jax.train.loop\n"),   # function-level
])
def test_an_upward_import_breaks_the_contract(tree_copy, importer, line):
    path = os.path.join(tree_copy, importer)
    with open(path, encoding="utf-8") as f:
        original = f.read()
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n" + line)
        r = _lint_imports(tree_copy)
        assert r.returncode != 0, r.stdout
        assert re.search(r"Contracts: \d+ kept, [1-9]\d* broken", r.stdout), r.stdout
        module = importer[:-3].replace("/", ".")
        assert f"{module} -> " in r.stdout, r.stdout      # the report names the offending import
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original)


def test_no_importlib_dispatch_in_the_packages():
    hits = []
    for p in _package_files():
        for n in ast.walk(ast.parse(open(p, encoding="utf-8").read())):
            if isinstance(n, ast.Call):
                name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                if name in ("import_module", "__import__"):
                    hits.append(f"{os.path.relpath(p, REPO)}:{n.lineno}")
    assert not hits, hits


def test_no_package_file_over_600_lines():
    long = {os.path.relpath(p, REPO): n for p in _package_files() if (n := sum(1 for _ in open(p, encoding="utf-8"))) > 600}
    assert not long, long


_HISTORY = re.compile(r"\bsession \d+|\bH[12]00\b|\bH800\b|\bB200\b|\b20\d\d-\d\d-\d\d\b")


def test_no_benchmark_history_in_package_code():
    """Dates, device names and session numbers belong in BENCHMARKS.md, not in the code."""
    hits = [f"{os.path.relpath(p, REPO)}:{i}" for p in _package_files()
            for i, line in enumerate(open(p, encoding="utf-8"), 1) if _HISTORY.search(line)]
    assert not hits, hits
