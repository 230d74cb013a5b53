"""Ops: one op per concern, each with an ``implementation=`` choice and an XLA reference."""

from minimax_jax.ops.common import ImplementationUnavailable, implementation_report, record_implementation

__all__ = ["ImplementationUnavailable", "implementation_report", "record_implementation"]
