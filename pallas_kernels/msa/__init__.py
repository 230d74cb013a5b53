"""Pallas kernels for MiniMax Sparse Attention (MSA): GPU (Triton lowering) and TPU (Mosaic).

Use through ``minimax_jax.ops.msa`` (implementation="pallas_gpu" | "pallas_tpu" |
"pallas_gpu_interpret" | "pallas_tpu_interpret"), which registers these kernels and checks when
they apply. Kernel entry points: ``gpu_attention.msa_attention_gpu``,
``gpu_indexer.msa_select_blocks_gpu``, ``gpu_kl.indexer_kl_gpu`` and their ``tpu_*`` twins; each
takes ``interpret=`` to run in Pallas interpret mode.
"""
