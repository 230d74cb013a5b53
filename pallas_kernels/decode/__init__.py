"""Pallas decode kernels (paged MSA page scoring + top-k, split-KV paged attention) for GPU and TPU.

Modules: ``gpu_select`` (GPU page scoring and in-kernel top-k), ``gpu_attention`` (GPU split-KV paged
attention), ``gpu_config`` (the GPU launch table), ``tpu`` (Mosaic scoring and attention), ``common``
(row packing, split combination). Called through ``minimax_jax.ops.paged``, which validates inputs.
"""
