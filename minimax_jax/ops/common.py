"""Shared plumbing for ops: implementation errors and a report of which implementation ran.

Ops record the implementation they resolved to at trace time (``"auto"`` resolves to a concrete
one), so runtimes and tests can say which path ran instead of guessing. Recording happens in Python
at trace time, which is exactly when the choice is made; it costs nothing at run time.
"""

from __future__ import annotations

import threading

import jax

__all__ = [
    "ImplementationUnavailable",
    "record_implementation",
    "implementation_report",
    "clear_implementation_report",
    "default_backend",
]


class ImplementationUnavailable(RuntimeError):
    """Raised when an explicitly requested implementation cannot run here (the message says why)."""


_lock = threading.Lock()
_report: dict[str, str] = {}


def record_implementation(op: str, implementation: str) -> None:
    """Record that ``op`` (e.g. ``"msa_attention"``) resolved to ``implementation`` at trace time."""
    with _lock:
        _report[op] = implementation


def implementation_report() -> dict[str, str]:
    """Return ``{op name: implementation}`` for every op traced so far in this process."""
    with _lock:
        return dict(_report)


def clear_implementation_report() -> None:
    """Forget what was recorded (tests use this to check a specific trace)."""
    with _lock:
        _report.clear()


def default_backend() -> str:
    """The default JAX backend: ``"cpu"``, ``"gpu"`` or ``"tpu"``."""
    return jax.default_backend()
