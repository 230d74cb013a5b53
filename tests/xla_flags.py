"""XLA flags for the child processes of tests whose time goes into running code rather than compiling it.

tests/conftest.py exports compile-time flags to the whole session (``_FAST_COMPILE``: LLVM -O0 and the classic
fusion emitters): right for the suite's many compile-bound tests, but -O0 code runs the elementwise work of a
long prefill or of many training steps several times more slowly. A test whose child process mostly runs (an 8K
prefill, ten training steps) starts it with these flags instead. Only code generation changes, never the HLO or
which code of this project runs.
"""

from __future__ import annotations

import os

__all__ = ["CODEGEN_FLAGS", "running_xla_flags"]

#: The code-generation flags of tests/conftest.py's ``_FAST_COMPILE`` (by name).
CODEGEN_FLAGS = ("--xla_backend_optimization_level", "--xla_cpu_use_fusion_emitters")


def running_xla_flags(opt_level: int | None = None) -> str:
    """This process's ``XLA_FLAGS`` for a child that mostly runs code: ``opt_level`` None drops the suite's
    code-generation flags (XLA's defaults: the fastest code, the slowest compiles); an int keeps the classic
    emitters and compiles at ``--xla_backend_optimization_level=opt_level`` instead of 0."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(CODEGEN_FLAGS)]
    if opt_level is not None:
        kept += [f"--xla_backend_optimization_level={opt_level}", "--xla_cpu_use_fusion_emitters=false"]
    return " ".join(kept)
