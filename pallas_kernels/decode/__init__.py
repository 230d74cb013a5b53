"""Pallas decode kernels (paged MSA page scoring, split-KV paged attention) for GPU and TPU.

Called only through ``minimax_jax.decode.ops`` (see ``api.py``).
"""
