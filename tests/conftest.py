"""Suite-wide setup for a fast ``pytest -n 2`` on a CPU machine (the CI command).

1. One persistent JAX compilation cache for the whole test session. Many tests compile the same
   programs (the micro models' init, forward and train steps; the same ops at the same shapes), in
   this process, in the other xdist worker and in the subprocesses that tests start (``train.py``,
   8-device workers, notebooks' kernels), so every process of the session shares one cache
   directory: an identical program is compiled once and loaded afterwards. The cache is keyed by the
   program, its compile options, devices, XLA flags and the jax version, and a hit returns the
   executable the compile would have built, so no test's result changes. A reader that meets an
   entry another process is still writing fails to decode it and compiles instead (jax warns).
   The directory is created here, before JAX is imported, and exported through the environment so
   the xdist workers and every child process inherit it; it is removed when the session ends, so
   nothing outlives a session. Set ``JAX_COMPILATION_CACHE_DIR`` yourself to use (and keep)
   another directory, or ``MINIMAX_TEST_JAX_CACHE=0`` to compile everything afresh.
2. XLA's CPU compiler tuned for compile time (``_FAST_COMPILE`` below, also exported to children);
   ``MINIMAX_TEST_FAST_COMPILE=0`` keeps XLA's defaults.
3. Scheduling under xdist: a module with a module-scoped fixture runs on one worker, and the
   longest scheduling units (``tests/durations.txt``) start first.
4. Lowering Pallas Triton kernels for CUDA on a machine without a GPU (the ``lowering_platforms=("cuda",)``
   tests): jax >= 0.11 asks the local GPU for its compute capability and raises "No supported GPU devices
   found" on a CPU; there the target is taken to be a Hopper GPU, sm_90 (``pallas_kernels.common.triton_cuda_target``,
   entered for the session in this process; subprocesses that lower for CUDA go through
   ``assume_backend("gpu")``, which enters it too). A machine with a GPU keeps its own answer.
5. With jax >= 0.11 (the Mosaic GPU interpreter) and no ``NPROC`` set: ``NPROC`` (XLA's CPU client pool:
   executions at once) = max(8, cores), before JAX starts: the interpreter runs a kernel's three warpgroups
   as concurrent executions that wait on each other, which deadlocks on a 2-core machine's default pool
   (``pallas_kernels.common.mosaic_interpret_params``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile

_OWNER = "MINIMAX_TEST_JAX_CACHE_OWNER"
try:       # only where the Mosaic GPU interpreter exists (jax >= 0.11): elsewhere XLA's pool stays as it was
    _JAX = tuple(int(x) for x in importlib.metadata.version("jax").split(".")[:2])
except (importlib.metadata.PackageNotFoundError, ValueError):
    _JAX = (0, 0)
if _JAX >= (0, 11) and "NPROC" not in os.environ:
    os.environ["NPROC"] = str(max(8, os.cpu_count() or 1))

if os.environ.get("MINIMAX_TEST_JAX_CACHE", "1") != "0" and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="minimax-jax-test-cache-")
    os.environ[_OWNER] = str(os.getpid())
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The CLIs' own compilation cache (minimax_jax.cli_main) never writes to the user's home from a test:
# it uses the session's cache directory, or none.
os.environ.setdefault("MINIMAX_JAX_CACHE", os.environ.get("JAX_COMPILATION_CACHE_DIR") or "none")


# XLA's CPU compiler tuned for compile time: the suite's programs are tiny and run once or a few
# times, so compiling them dominates (thousands of compiles, most of them single eager ops). LLVM
# optimisation level 0 and the classic fusion emitters instead of the MLIR-based ones each cut the
# CPU time of a compile-bound test by about a third. Neither changes the HLO (fusion, layouts,
# buffer assignment) or which code of this project runs, only how XLA generates the machine code.
# XLA aborts on a flag it does not know, so a flag missing from the installed jaxlib is left out
# (tried once in a child process). MINIMAX_TEST_FAST_COMPILE=0 keeps XLA's defaults.
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flags: str) -> bool:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    try:
        return subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.ones(2).block_until_ready()"],
                              env=env, capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


if os.environ.get("MINIMAX_TEST_FAST_COMPILE", "1") != "0" and not os.environ.get("MINIMAX_TEST_FAST_COMPILE_SET"):
    os.environ["MINIMAX_TEST_FAST_COMPILE_SET"] = "1"      # xdist workers and children inherit the result
    _base = os.environ.get("XLA_FLAGS", "")
    _extra = [f for f in _FAST_COMPILE if f.split("=")[0] not in _base]
    if _extra and not _xla_accepts(" ".join([_base] + _extra)):
        _extra = [f for f in _extra if f.startswith("--xla_backend_optimization_level")]   # a long-standing flag
    os.environ["XLA_FLAGS"] = " ".join([_base] + _extra).strip()


def pytest_configure(config):
    from pallas_kernels.common import triton_cuda_target
    config._cuda_target = triton_cuda_target()      # 4.: for the whole session, this process
    config._cuda_target.__enter__()


def pytest_unconfigure(config):
    if getattr(config, "_cuda_target", None) is not None:
        config._cuda_target.__exit__(None, None, None)
    if os.environ.get(_OWNER) == str(os.getpid()):
        shutil.rmtree(os.environ.get("JAX_COMPILATION_CACHE_DIR", ""), ignore_errors=True)


_MODULE_FIXTURE = re.compile(r"@pytest\.fixture\(\s*scope\s*=\s*[\"']module[\"']")


@functools.lru_cache(maxsize=None)
def _has_module_fixture(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return bool(_MODULE_FIXTURE.search(f.read()))
    except OSError:
        return False


def _scope(nodeid: str, root: str) -> str:
    """The unit xdist schedules: the whole module if it has a module-scoped fixture, else the test."""
    module = nodeid.split("::", 1)[0]
    return module if _has_module_fixture(os.path.join(root, module)) else nodeid


@functools.lru_cache(maxsize=None)
def _durations(path: str) -> dict[str, float]:
    """``tests/durations.txt``: ``seconds node-id-prefix`` per line ('#' comments)."""
    out: dict[str, float] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                parts = line.split("#", 1)[0].split(None, 1)
                if len(parts) == 2:
                    out[parts[1].strip()] = float(parts[0])
    except OSError:
        pass
    return out


def _expected_seconds(nodeid: str, table: dict[str, float]) -> float:
    """The entry of the longest prefix of ``nodeid`` in ``table`` (0 if none)."""
    best, length = 0.0, -1
    for prefix, secs in table.items():
        if len(prefix) > length and nodeid.startswith(prefix) and (
                len(nodeid) == len(prefix) or nodeid[len(prefix)] in ":["):
            best, length = secs, len(prefix)
    return best


def pytest_collection_modifyitems(session, config, items):
    """Under xdist, the longest scheduling units first (expected times from tests/durations.txt,
    measured on a 2-core CPU; unlisted tests count 0 and keep their order): the workers start on
    the long tests and finish on short ones together, instead of one worker running a long test
    alone at the end. Only the workers' collection order matters (the controller schedules in that
    order), so a run without xdist keeps pytest's order."""
    if not hasattr(config, "workerinput"):
        return
    root = str(config.rootpath)
    table = _durations(os.path.join(root, "tests", "durations.txt"))
    cost: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        unit = _scope(item.nodeid, root)
        cost[unit] = cost.get(unit, 0.0) + _expected_seconds(item.nodeid, table)
        first.setdefault(unit, i)
    keys = {item.nodeid: (-cost[u], first[u]) for item in items for u in [_scope(item.nodeid, root)]}
    items.sort(key=lambda item: keys[item.nodeid])     # stable: a module's tests stay in order


def pytest_xdist_make_scheduler(config, log):
    """``-n N`` (xdist's default ``load`` distribution), except that the tests of a module that
    defines a module-scoped fixture (a training run, a converted checkpoint, a trained tokenizer) go
    to one worker together, so the fixture is built once per session instead of once per worker.
    (xdist's own ``--dist loadgroup`` renames node ids through an attribute pytest 9 no longer has.)
    Units are handed out in the workers' collection order (longest first, see
    ``pytest_collection_modifyitems``), not re-sorted by their number of tests. An explicit
    ``--dist`` other than ``load`` is left alone."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = str(config.rootpath)
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid, root)

    return ModuleFixtureScheduling(config, log)
