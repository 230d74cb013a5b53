"""Context-parallel chunked prefill: one prefill chunk's tokens split over the mesh's sequence axes.

Inside ``sharding.use_mesh`` with a ``sequence`` axis that divides the chunk, ``model_step``'s "gather"
path runs each layer's projections and MLP on the local tokens (GSPMD: the activations are constrained
to the sequence axes) and its attention in ``jax.shard_map`` (``minimax_jax.ops.context_parallel.run``):

- every device all-gathers the chunk's new K/V (and index keys) with their positions and writes them
  into its copy of the paged cache. The cache is replicated (``DecodeEngine`` places it so) and every
  device writes the same values, so the copies stay equal;
- it gathers the rows' pages and runs the ordinary prefill ops (MSA selection + sparse attention, or
  ``prefill_attention``) on its local queries against the whole key axis (queries may sit anywhere:
  MSA_SPEC.md sections 3 and 5), with their global positions.

Load balance: the chunk is laid out in zig-zag order (``context_parallel.zigzag``) when 2n divides it,
so the causal part of the chunk costs every device the same; the prefix part is the same for all.
Batch rows and heads are not split here (each cache copy must receive every row's keys): other mesh
axes repeat the attention. The implementation report records ``context_parallel/prefill``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from minimax_jax.config import ModelConfig
from minimax_jax.decode.cache import CacheSpec, write_layer
from minimax_jax.ops import context_parallel

__all__ = ["plan", "order", "constrain", "write_and_attend"]


def plan(cfg: ModelConfig, batch: int, tokens: int) -> context_parallel.Plan | None:
    """The plan for a ``[batch, tokens]`` prefill chunk (tokens on the sequence axes only), or None: no
    mesh, no sequence axis, or one that does not divide ``tokens`` (the step then runs replicated)."""
    p = context_parallel.plan(batch, tokens, (cfg.num_heads, cfg.num_kv_heads))
    return None if p is None else dataclasses.replace(p, batch=(), heads=())


def order(p: context_parallel.Plan | None) -> np.ndarray | None:
    """Zig-zag token order of the chunk for plan ``p`` when ``2n`` divides it, else None."""
    if p is None or p.tokens % (2 * p.size):
        return None
    return context_parallel.zigzag(p.tokens, p.size)


def constrain(p: context_parallel.Plan, x: jax.Array) -> jax.Array:
    """``x`` ``[B, T, ...]`` sharded over the plan's sequence axes along T."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(p.mesh, PS(None, p.seq)))


def write_and_attend(p: context_parallel.Plan, attend: Callable, cache: dict, spec: CacheSpec, q, k, v, qi, ki,
                     page_table, positions):
    """Write the chunk's keys into the (replicated) layer cache and attend, local queries per device.

    Args:
      p: from ``plan``. attend: ``attend(cache, q, qi, page_table, positions) -> o [B, Tl, Hq, D]`` (the
        "gather" path of ``model_step``). cache: one layer's cache dict. q ``[B, T, Hq, D]``, k / v
        ``[B, T, G, D]``, qi ``[B, T, Hi, Di]`` / ki ``[B, T, Di]`` or None (non-MSA layers), page_table
        ``[B, n]``, positions ``[B, T]`` (``-1`` = padding), in the step's token order.
    Returns: ``(o [B, T, Hq, D] sharded like q, updated cache dict, replicated)``.
    """
    names = sorted(cache)
    q_side = [(q, "bt.."), (positions, "bt")] + ([(qi, "bt..")] if qi is not None else [])
    kv_side = [(k, "bt.."), (v, "bt.."), (positions, "bt")] + ([(ki, "bt.")] if ki is not None else [])

    def local(q, qpos, *rest):
        qi_l = rest[0] if qi is not None else None
        rest = rest[1:] if qi is not None else rest
        k_g, v_g, kpos = rest[:3]
        ki_g = rest[3] if ki is not None else None
        rest = rest[4:] if ki is not None else rest[3:]
        table, arrays = rest[0], rest[1:]
        c = write_layer(dict(zip(names, arrays)), k_g, v_g, ki_g, table, kpos, spec)
        return (attend(c, q, qi_l, table, qpos), *(c[n] for n in names))

    out = context_parallel.run(p, local, q_side, kv_side, ["bt..", *([""] * len(names))], name="prefill",
                               shared=[page_table, *(cache[n] for n in names)])
    return out[0], dict(zip(names, out[1:]))
