"""MoE op: routing (``routing``), the expert computation with an ``implementation=`` choice (``experts``,
registry op ``"moe"``), the grouped matmul it runs on (``grouped_matmul``, op ``"grouped_matmul"``), token
permutation (``permute``), expert parallelism in ``shard_map`` (``expert_parallel``) and FP8 block-scaled
weights kept in FP8 (``fp8_weight.Fp8Weight``); the gated activations as values the kernels can fuse
(``activation.GatedActivation``)."""

from minimax_jax.ops.moe.activation import GatedActivation
from minimax_jax.ops.moe.experts import (DENSE_MAX_EXPERT_BYTES, DENSE_MAX_TOKENS_X_EXPERTS, MOE_IMPLEMENTATIONS,
                                         capacity_of, moe_experts)
from minimax_jax.ops.moe.fp8_weight import Fp8Weight
from minimax_jax.ops.moe.grouped_matmul import sorted_expert_mlp
from minimax_jax.ops.moe.routing import load_balancing_loss, route, router_scores, update_router_bias

__all__ = ["DENSE_MAX_EXPERT_BYTES", "DENSE_MAX_TOKENS_X_EXPERTS", "MOE_IMPLEMENTATIONS", "router_scores", "route",
           "moe_experts", "sorted_expert_mlp", "Fp8Weight", "capacity_of", "update_router_bias",
           "load_balancing_loss", "GatedActivation"]
