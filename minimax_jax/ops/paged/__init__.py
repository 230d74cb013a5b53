"""Paged decode ops: attention over paged K/V caches and MSA page selection (MSA_SPEC.md section 5).

Modules: ``api`` (the public functions, their validation and registry entries), ``xla`` (the
plain-JAX references and ``dequantize`` of the cache format), ``pallas`` (the kernel
implementations of ``pallas_kernels.decode`` and when they apply).
"""

from minimax_jax.ops.paged.api import IMPLEMENTATIONS, msa_decode, msa_decode_select, paged_attention
from minimax_jax.ops.paged.xla import dequantize, select_from_page_scores

__all__ = ["paged_attention", "msa_decode_select", "msa_decode", "select_from_page_scores", "dequantize",
           "IMPLEMENTATIONS"]
