"""Pallas grouped-matmul kernels for MoE experts (GPU, Triton lowering).

Use through ``minimax_jax.ops.grouped_matmul`` (implementation="pallas_gpu" |
"pallas_gpu_interpret"), or directly: ``gpu_gmm.gmm`` (differentiable), ``gpu_gmm.gmm_forward``
and ``gpu_gmm.tgmm`` (the three kernels without autodiff).
"""

from pallas_kernels.moe.gpu_gmm import (CANDIDATES, DEFAULT_CONFIG, DEFAULT_DLHS_CONFIG, DEFAULT_TGMM_CONFIG,
                                        TGMM_CANDIDATES, TileConfig, get_default_configs, gmm, gmm_forward, make_visits, num_visits,
                                        set_default_configs, tgmm)

__all__ = ["CANDIDATES", "DEFAULT_CONFIG", "DEFAULT_DLHS_CONFIG", "DEFAULT_TGMM_CONFIG", "TGMM_CANDIDATES",
           "TileConfig", "get_default_configs", "gmm", "gmm_forward", "make_visits", "num_visits", "set_default_configs", "tgmm"]
