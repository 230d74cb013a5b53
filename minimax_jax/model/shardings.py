"""The model's parameter shardings: its logical axis names (``param_axes``) through the rule table."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from minimax_jax.config import ModelConfig
from minimax_jax.model.params import abstract_params, param_axes
from minimax_jax.sharding import Rules, tree_shardings

__all__ = ["params_shardings"]


def params_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules, *, strict: bool = False) -> Any:
    """Pytree of ``NamedSharding`` with the structure of ``param_axes(cfg)`` (and of the params).

    Dimensions not divisible by their mesh axes are replicated over those axes (warning), or raise
    ShardingError when ``strict`` (``minimax_jax.sharding.tree_shardings``).
    """
    return tree_shardings(param_axes(cfg), abstract_params(cfg), mesh, rules, strict=strict)
