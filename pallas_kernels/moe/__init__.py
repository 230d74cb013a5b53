"""Pallas grouped-matmul kernels for MoE experts (GPU: Triton lowering; Mosaic GPU for the
warp-specialized weight gradient, which the ops layer picks on Hopper).

Use through ``minimax_jax.ops.moe.grouped_matmul`` (implementation="pallas_gpu" |
"pallas_gpu_interpret"), or directly: ``gpu_gmm.gmm`` (differentiable; tile configs passed explicitly,
default ``gpu_gmm.DEFAULT_CONFIGS``), ``gpu_gmm.gmm_forward`` and ``gpu_gmm.tgmm`` (the three kernels
without autodiff); ``gpu_gmm_fp8.gmm_fp8`` for block-scaled FP8 weights dequantised in the kernel;
``gpu_gmm_gated.gmm_gated``: the first MoE matmul with its gated activation in the epilogue.
"""

from pallas_kernels.moe.gpu_gmm import (CANDIDATES, DEFAULT_CONFIG, DEFAULT_CONFIGS, DEFAULT_DLHS_CONFIG,
                                        DEFAULT_TGMM_CONFIG, TGMM_CANDIDATES, TileConfig, gmm, gmm_forward,
                                        make_visits, num_visits, tgmm)
from pallas_kernels.moe.gpu_gmm_fp8 import gmm_fp8
from pallas_kernels.moe.gpu_gmm_gated import gmm_gated

__all__ = ["CANDIDATES", "DEFAULT_CONFIG", "DEFAULT_CONFIGS", "DEFAULT_DLHS_CONFIG", "DEFAULT_TGMM_CONFIG",
           "TGMM_CANDIDATES", "TileConfig", "gmm", "gmm_forward", "make_visits", "num_visits", "tgmm",
           "gmm_fp8", "gmm_gated"]
