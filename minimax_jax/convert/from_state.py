"""Build our params tree from an in-memory mapping of HF tensors (and back).

For small models and tests; the streaming converter (``minimax_jax.convert``) uses the same
per-layer mapping (``hf_names``) one layer at a time for real checkpoints.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from minimax_jax.config import ModelConfig, dtype_of
from minimax_jax.convert.hf_names import (layer_from_hf, layer_to_hf, mtp_from_hf, mtp_to_hf, top_from_hf,
                                          top_to_hf)
from minimax_jax.model.params import stack_layers, unstack_layers

__all__ = ["params_from_hf_state", "params_to_hf_state"]


def params_from_hf_state(state: Mapping[str, Any], cfg: ModelConfig, *, dtype: str | None = None) -> dict:
    """HF tensors (numpy or torch, by name) -> our params tree, cast to ``dtype`` (default
    ``cfg.param_dtype``; router weights and bias stay float32).

    Raises: MissingTensorError naming a tensor the config needs.
    """
    def get(n):
        v = state[n]
        if hasattr(v, "detach"):  # torch tensor
            v = v.detach().float().numpy()
        return np.asarray(v, np.float32)

    has = state.__contains__
    layers = [layer_from_hf(get, has, f"model.layers.{i}.", cfg, cfg.layer_types[i], cfg.mlp_types[i])
              for i in range(cfg.num_layers)]
    params: dict[str, Any] = top_from_hf(get, has, cfg)
    params["segments"] = stack_layers(layers, cfg)
    if cfg.num_mtp_modules:
        params["mtp"] = [mtp_from_hf(get, has, cfg, i) for i in range(cfg.num_mtp_modules)]
    return cast_params(params, dtype or cfg.param_dtype)


def cast_params(params: dict, dtype: str) -> dict:
    """Cast every leaf to ``dtype`` except the float32 router weights and correction bias."""
    dt = dtype_of(dtype)

    def go(tree, path=()):
        if isinstance(tree, dict):
            return {k: go(v, path + (k,)) for k, v in tree.items()}
        if isinstance(tree, list):
            return [go(v, path + (i,)) for i, v in enumerate(tree)]
        keep32 = path and path[-1] in ("router", "router_bias")
        return jnp.asarray(tree, jnp.float32 if keep32 else dt)

    return go(params)


def params_to_hf_state(params: dict, cfg: ModelConfig, *, hub_layout: bool = True) -> dict[str, np.ndarray]:
    """Our params -> HF tensors (numpy, float32 unless the leaves are another dtype)."""
    out = top_to_hf(params, cfg)
    for i, lp in enumerate(unstack_layers(params, cfg)):
        lp = _np(lp)
        out.update(layer_to_hf(lp, f"model.layers.{i}.", cfg, cfg.layer_types[i], cfg.mlp_types[i],
                               hub_layout=hub_layout))
    for i, mod in enumerate(params.get("mtp", [])):
        out.update(mtp_to_hf(_np(mod), cfg, i))
    return out


def _np(tree):
    if isinstance(tree, dict):
        return {k: _np(v) for k, v in tree.items()}
    return np.asarray(tree)
