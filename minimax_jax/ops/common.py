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
    "match_vma",
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


def match_vma(x: jax.Array, like: jax.Array) -> jax.Array:
    """Mark ``x`` as varying over the manual mesh axes that ``like`` varies over (``shard_map`` typing).

    Inside ``shard_map`` every value carries the set of mesh axes it varies over ("vma"). Values
    made from scratch (``jnp.zeros``) or returned by kernels that do not propagate the type (a
    ``pallas_call``, e.g. tokamax's grouped matmul) come out invariant, and a custom VJP whose
    cotangent is varying then fails JAX's type check. Outside ``shard_map`` this is the identity.
    """
    missing = tuple(sorted(set(getattr(jax.typeof(like), "vma", ())) - set(getattr(jax.typeof(x), "vma", ()))))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
