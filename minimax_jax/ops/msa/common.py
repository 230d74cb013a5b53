"""Shared pieces of the MSA references: token visibility, key block ids, query chunking.

Visibility contract (docs/ARCHITECTURE.md "Ops"): key ``j`` is visible to query ``i`` iff
``kv_seg[j] == q_seg[i] and kv_seg[j] >= 0 and kv_pos[j] <= q_pos[i]``. The block of a key is
``kv_pos // block_size`` (positions restart per packed document, so blocks are per document), and
the local block of a query is ``q_pos // block_size`` (MSA_SPEC.md section 2).

These helpers take already-validated arrays (``minimax_jax.ops.msa.api`` validates the public inputs).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

__all__ = ["visible", "tree_query_args", "num_key_blocks", "key_block_ids", "map_query_chunks", "unchunk", "masked_softmax", "HIGHEST"]

HIGHEST = jax.lax.Precision.HIGHEST


def num_key_blocks(num_keys: int, block_size: int) -> int:
    """Number of key blocks ``NB = ceil(S / block_size)`` (static). Keys must have ``kv_pos < NB * block_size``."""
    return -(-num_keys // block_size)


def key_block_ids(kv_positions: jax.Array, kv_segment_ids: jax.Array, block_size: int, nb: int) -> jax.Array:
    """Block id of every key, ``kv_pos // block_size``, with invalid keys mapped to the spare id ``nb``.

    Args:
      kv_positions: ``[B, S]`` int32 key positions.
      kv_segment_ids: ``[B, S]`` int32 key segment ids (``< 0`` = empty slot).
      block_size: tokens per block.
      nb: number of real blocks; ids ``>= nb`` and invalid keys become ``nb``.
    Returns: ``[B, S]`` int32 in ``[0, nb]``.
    """
    blk = kv_positions // block_size
    ok = (kv_segment_ids >= 0) & (kv_positions >= 0) & (blk < nb)
    return jnp.where(ok, blk, nb).astype(jnp.int32)


def visible(q_positions: jax.Array, q_segment_ids: jax.Array, kv_positions: jax.Array,
            kv_segment_ids: jax.Array, q_index: jax.Array | None = None,
            kv_subtree_end: jax.Array | None = None) -> jax.Array:
    """Token visibility mask ``[B, T, S]`` bool (see the module docstring for the rule).

    Args:
      q_positions, q_segment_ids: ``[B, T]`` int32.
      kv_positions, kv_segment_ids: ``[B, S]`` int32.
      q_index, kv_subtree_end: prefix-tree rows (``minimax_jax.data.prefix_tree``), both or neither:
        ``[B, T]`` the queries' storage slots among the keys, ``[B, S]`` one past each key's subtree;
        key slot ``j`` is then visible only to queries at slots ``j <= q_index < kv_subtree_end[j]``
        (its own trajectory's ancestors), so positions and blocks are those of the query's trajectory.
    """
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    valid = (kv_segment_ids >= 0)[:, None, :]
    causal = kv_positions[:, None, :] <= q_positions[:, :, None]
    m = same & valid & causal
    if kv_subtree_end is not None:
        slot = jnp.arange(kv_positions.shape[1], dtype=jnp.int32)[None, None, :]
        qi = q_index[:, :, None]
        m &= (slot <= qi) & (qi < kv_subtree_end[:, None, :])
    return m


def tree_query_args(b: int, t: int, kv_subtree_end: jax.Array | None) -> tuple[tuple, tuple, tuple]:
    """Extra per-query chunk inputs for prefix-tree visibility: ``((q_index [B, T],), (pad,), (t_axis,))``
    with ``q_index`` the query slots ``0..T-1`` (self-attention), padding ``-1`` (sees no key); empty
    tuples without ``kv_subtree_end``."""
    if kv_subtree_end is None:
        return (), (), ()
    return (jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),), (-1,), (1,)


def map_query_chunks(fn: Callable, q_args: tuple, chunk_size: int, *, pad_values: tuple,
                     t_axes: tuple, remat: bool = True):
    """Apply ``fn`` to consecutive query chunks with ``jax.lax.map`` (memory O(chunk), not O(T)).

    Args:
      fn: ``fn(*chunk_args) -> pytree``; every output leaf has its query axis where the inputs do
        (given per input by ``t_axes``) -- outputs are stacked along a new leading chunk axis and
        returned as such (the caller reassembles them).
      q_args: arrays carrying a query axis of length ``T`` at ``t_axes[k]``.
      chunk_size: queries per chunk; the last chunk is padded with ``pad_values[k]``.
      pad_values: fill value per input for the padding queries (choose values that make padded
        queries see no key, e.g. segment id ``-1``).
      t_axes: the query axis of each input.
      remat: wrap ``fn`` in ``jax.checkpoint`` so reverse-mode autodiff also keeps O(chunk) memory.
    Returns: ``(stacked_outputs, num_chunks, chunk, T)`` where ``stacked_outputs`` leaves have a
      leading ``[num_chunks]`` axis.
    """
    t = q_args[0].shape[t_axes[0]]
    chunk = max(1, min(int(chunk_size), t))
    n = -(-t // chunk)
    pad = n * chunk - t
    xs = []
    for arr, ax, fill in zip(q_args, t_axes, pad_values):
        if pad:
            widths = [(0, 0)] * arr.ndim
            widths[ax] = (0, pad)
            arr = jnp.pad(arr, widths, constant_values=fill)
        shape = arr.shape[:ax] + (n, chunk) + arr.shape[ax + 1:]
        xs.append(jnp.moveaxis(arr.reshape(shape), ax, 0))
    body = jax.checkpoint(lambda a: fn(*a)) if remat else (lambda a: fn(*a))
    if n == 1:
        out = jax.tree_util.tree_map(lambda y: y[None], body(tuple(x[0] for x in xs)))
    else:
        out = jax.lax.map(body, tuple(xs))
    return out, n, chunk, t


def unchunk(y: jax.Array, axis: int, t: int) -> jax.Array:
    """Inverse of the chunking for one stacked output: ``[n, ..., chunk(at axis), ...]`` -> ``[..., T, ...]``."""
    y = jnp.moveaxis(y, 0, axis)  # [..., n, chunk, ...]
    shape = y.shape[:axis] + (y.shape[axis] * y.shape[axis + 1],) + y.shape[axis + 2:]
    y = y.reshape(shape)
    return jax.lax.slice_in_dim(y, 0, t, axis=axis)


def masked_softmax(logits: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax of ``logits`` over the last axis restricted to ``mask``, safe for empty rows.

    Args:
      logits: ``[..., S]`` float32.
      mask: bool, broadcastable to ``logits``.
    Returns:
      ``(p, lse)``: ``p [..., S]`` float32 (0 off the mask; all 0 on an empty row) and
      ``lse [...]`` float32 natural-log sum-exp over the mask (``-inf`` on an empty row).
      Masked entries never feed ``exp`` so gradients stay finite.
    """
    neg = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(neg, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.exp(jnp.where(mask, logits - m, -jnp.inf))
    denom = jnp.sum(e, axis=-1, keepdims=True)
    nonempty = denom > 0
    p = e / jnp.where(nonempty, denom, 1.0)
    lse = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, denom, 1.0)), -jnp.inf)
    return p, lse[..., 0]
