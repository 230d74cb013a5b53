"""The notebooks in notebooks/ run top to bottom headlessly on CPU, and are committed without outputs.

Each notebook is executed with ``nbclient`` in a fresh ``python3`` kernel (the interpreter running
pytest), with ``JAX_PLATFORMS=cpu`` and the working directory ``notebooks/``; any cell error fails
the test with the cell's traceback. Limits (seconds, override through the environment):
``MINIMAX_NB_TIMEOUT`` per notebook (default 300) and ``MINIMAX_NB_CELL_TIMEOUT`` per cell (default
240). ``MINIMAX_NB_KEEP=DIR`` writes the executed notebooks there for inspection.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import time

import pytest

from tests.xla_flags import running_xla_flags

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(NB_DIR, "*.ipynb")))
NB_TIMEOUT = float(os.environ.get("MINIMAX_NB_TIMEOUT", "300"))
CELL_TIMEOUT = int(os.environ.get("MINIMAX_NB_CELL_TIMEOUT", "240"))
EXPECTED = ["01_architecture.ipynb", "02_msa_selection.ipynb", "03_kernels.ipynb", "04_train_and_generate.ipynb"]
#: Notebooks whose time goes into running code (150 training steps) rather than compiling it: their kernel gets
#: tests/xla_flags.py's running flags instead of the suite's compile-time ones (only code generation changes).
RUNS_CODE = {"04_train_and_generate.ipynb"}


def test_all_notebooks_present():
    missing = sorted(set(EXPECTED) - {os.path.basename(p) for p in NOTEBOOKS})
    assert not missing, f"notebooks missing from {NB_DIR}: {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_committed_without_outputs(path):
    """Committed notebooks carry no outputs or execution counts (no stale numbers)."""
    with open(path) as f:
        nb = json.load(f)
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{os.path.basename(path)}: cells {dirty} have outputs; strip them before committing"
    assert "widgets" not in nb.get("metadata", {})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    if os.path.basename(path) in RUNS_CODE:
        monkeypatch.setenv("XLA_FLAGS", running_xla_flags(1))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3", allow_errors=False,
                                     resources={"metadata": {"path": NB_DIR}})
    t0 = time.perf_counter()
    try:
        asyncio.run(asyncio.wait_for(client.async_execute(), NB_TIMEOUT))
    except asyncio.TimeoutError:
        pytest.fail(f"{os.path.basename(path)} did not finish within {NB_TIMEOUT:.0f} s (MINIMAX_NB_TIMEOUT)")
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{os.path.basename(path)}: a cell failed:\n{e}", pytrace=False)
    finally:
        keep = os.environ.get("MINIMAX_NB_KEEP")
        if keep:
            os.makedirs(keep, exist_ok=True)
            nbformat.write(nb, os.path.join(keep, os.path.basename(path)))
    elapsed = time.perf_counter() - t0
    print(f"{os.path.basename(path)}: {elapsed:.1f} s")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
