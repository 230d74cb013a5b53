"""The aux-loss-free router-bias update over a whole params tree (every MoE layer's ``router_bias``)."""

from __future__ import annotations

from typing import Any

import jax

from minimax_jax.model.params import layer_segments
from minimax_jax.ops.moe import update_router_bias

__all__ = ["update_router_biases"]


def update_router_biases(params: dict[str, Any], cfg, router_load: jax.Array, rate: float | jax.Array) -> dict[str, Any]:
    """Apply ``minimax_jax.ops.moe.update_router_bias`` to every MoE layer of a params tree.

    Args:
      params: the model params; ``params["segments"][i]["mlp"]["router_bias"]`` is ``[L_i, E]``.
      cfg: the ModelConfig (segments come from ``layer_segments(cfg)``).
      router_load: ``[num_moe_layers, E]`` = ``forward(...).aux["router_load"]`` (MoE layers in order;
        sum it over micro-batches / data shards first if needed).
      rate: step size.
    Returns: a new params tree (other leaves shared, not copied); MTP layers are left unchanged.
    Raises: ValueError when ``router_load`` does not have one row per MoE layer.
    """
    if router_load.shape[0] != cfg.num_moe_layers:
        raise ValueError(f"router_load has {router_load.shape[0]} rows, the config has {cfg.num_moe_layers} MoE layers")
    out = dict(params)
    segs = list(params["segments"])
    row = 0
    for i, seg in enumerate(layer_segments(cfg)):
        if seg.mlp_type != "moe":
            continue
        mlp = dict(segs[i]["mlp"])
        mlp["router_bias"] = update_router_bias(mlp["router_bias"], router_load[row:row + seg.length], rate)
        segs[i] = {**segs[i], "mlp": mlp}
        row += seg.length
    out["segments"] = segs
    return out
