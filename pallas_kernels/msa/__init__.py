"""Pallas kernels for MiniMax Sparse Attention (MSA): GPU (Triton lowering) and TPU (Mosaic).

Use through ``minimax_jax.ops.msa`` (implementation="pallas_gpu" | "pallas_tpu" |
"pallas_interpret"), which calls ``pallas_kernels.msa.api``.
"""
