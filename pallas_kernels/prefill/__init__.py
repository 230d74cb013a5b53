"""Pallas kernels for chunked prefill over a gathered (contiguous) cache view.

``gpu_attention.py``: dense / full causal GQA attention whose queries are any positions of the
key view (a prefill chunk is a suffix of the cached keys). Called through the op
``minimax_jax.ops.prefill.prefill_attention`` (the "gather" path of ``minimax_jax.decode.step``, for
full-attention layers); MSA layers use ``pallas_kernels.msa`` through ``minimax_jax.ops.msa``.
"""
