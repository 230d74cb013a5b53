"""Ops: one op per concern, each with an ``implementation=`` choice, an XLA reference and its kernels.

Every op registers its implementations with ``minimax_jax.ops.registry`` when its package is imported;
importing ``minimax_jax.ops`` imports them all, so the registry is complete (``registry.get_op(name)``).
"""

from minimax_jax.ops import attention, moe, msa, paged, prefill  # noqa: F401  (each registers its op(s))
from minimax_jax.ops.registry import (ImplementationUnavailable, assume_backend, clear_implementation_report,
                                      default_backend, implementation_report, record_implementation)

__all__ = ["ImplementationUnavailable", "assume_backend", "clear_implementation_report", "default_backend",
           "implementation_report", "record_implementation"]
