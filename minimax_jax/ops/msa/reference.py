"""Chunked plain-JAX (XLA) reference of MSA: index scores, block selection, sparse attention.

Math: MSA_SPEC.md sections 1-3 (arXiv 2606.13392). Queries are processed in chunks of
``chunk_size`` with ``jax.lax.map`` so every intermediate is O(B * heads * chunk * S), never
O(T * S); each chunk body is rematerialised in reverse mode, so gradients keep the same bound.
The functions here take validated inputs (``minimax_jax.ops.msa.api`` is the public entry point):
positions and segment ids ``int32 [B, T] / [B, S]`` with segment ids already filled in.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from minimax_jax.ops.msa.common import (
    HIGHEST,
    key_block_ids,
    map_query_chunks,
    masked_softmax,
    num_key_blocks,
    tree_query_args,
    unchunk,
    visible,
)

__all__ = ["index_scores", "select_blocks", "attention", "select_from_block_scores", "block_membership"]


def _chunk_block_scores(qi_c, qpos_c, qseg_c, ki, kv_pos, kv_seg, kv_blk, nb, qidx_c=None, kv_subtree_end=None):
    """Block max-pool of token index scores for one query chunk -> ``[B, Hi, C, NB]`` f32."""
    di = qi_c.shape[-1]
    s = jnp.einsum("bchd,bsd->bhcs", qi_c.astype(jnp.float32), ki.astype(jnp.float32),
                   precision=HIGHEST) / math.sqrt(di)
    vis = visible(qpos_c, qseg_c, kv_pos, kv_seg, qidx_c, kv_subtree_end)  # [B, C, S]
    s = jnp.where(vis[:, None], s, -jnp.inf)

    def per_row(s_b, blk_b):  # s_b [Hi, C, S], blk_b [S] -> [NB + 1, Hi, C]
        return jax.ops.segment_max(jnp.moveaxis(s_b, -1, 0), blk_b, num_segments=nb + 1)

    bs = jax.vmap(per_row)(s, kv_blk)  # [B, NB + 1, Hi, C]
    bs = jnp.moveaxis(bs, 1, -1)[..., :nb]
    # segment_max of an empty block is the float minimum identity; make it exactly -inf.
    return jnp.where(bs > jnp.finfo(jnp.float32).min, bs, -jnp.inf)


def select_from_block_scores(block_scores: jax.Array, local: jax.Array, *, topk: int, init_blocks: int,
                             local_blocks: int) -> jax.Array:
    """Per-(query, group) block choice from block scores (MSA_SPEC.md section 2), reference order.

    Args:
      block_scores: ``[B, Hi, C, NB]`` float32, ``-inf`` for blocks with no visible key.
      local: ``[B, C]`` int32 local block ``q_pos // block_size``.
      topk: K slots; init_blocks: sink blocks always kept; local_blocks: the local block and the
        ``local_blocks - 1`` blocks before it are always kept.
    Returns: ``[B, Hi, C, K]`` int32. Forced non-local blocks first (ascending id), then ranked
      blocks by score descending (ties to the lower id, ``jax.lax.top_k`` order), then the local
      block in the last valid slot; ``-1`` after. Only blocks with at least one visible key are
      eligible, so ``valid = min(K, local + 1)`` for ordinary (gap-free) inputs.
    """
    nb = block_scores.shape[-1]
    ids = jnp.arange(nb, dtype=jnp.int32)
    loc = local[:, None, :, None]
    cand = block_scores > -jnp.inf
    is_local = ids == loc
    before_local = ids < loc
    forced = cand & before_local & ((ids < init_blocks) | (ids > loc - local_blocks))
    rank = jnp.where(is_local | ~cand, -jnp.inf, jnp.where(forced, jnp.inf, block_scores))
    n_ranked = topk - 1
    lead = block_scores.shape[:-1]
    if n_ranked > 0:
        if nb < n_ranked:
            rank = jnp.pad(rank, [(0, 0)] * 3 + [(0, n_ranked - nb)], constant_values=-jnp.inf)
        vals, idx = jax.lax.top_k(rank, n_ranked)
        ok = vals > -jnp.inf
        sel = jnp.where(ok, idx, -1).astype(jnp.int32)
        n_valid = jnp.sum(ok, axis=-1)
    else:
        sel = jnp.zeros(lead + (0,), jnp.int32)
        n_valid = jnp.zeros(lead, jnp.int32)
    out = jnp.concatenate([sel, jnp.full(lead + (1,), -1, jnp.int32)], axis=-1)
    local_ok = jnp.any(cand & is_local, axis=-1)  # [B, Hi, C]
    slot = jnp.arange(topk, dtype=jnp.int32)
    put = (slot == n_valid[..., None]) & local_ok[..., None]
    return jnp.where(put, jnp.broadcast_to(loc, out.shape), out).astype(jnp.int32)


def block_membership(block_ids: jax.Array, kv_blk: jax.Array, nb: int) -> jax.Array:
    """Whether each key's block is among the selected ones: ``[B, G, C, K], [B, S] -> [B, G, C, S]`` bool.

    Built through a ``[B, G, C, NB + 1]`` table (scatter, then gather by key block), so the
    intermediate is O(C * (NB + S)), not O(C * K * S). ``-1`` / out-of-range ids select nothing.
    """
    b, g, c, k = block_ids.shape
    idx = jnp.where((block_ids >= 0) & (block_ids < nb), block_ids, nb)
    bi = jnp.arange(b)[:, None, None, None]
    gi = jnp.arange(g)[None, :, None, None]
    ci = jnp.arange(c)[None, None, :, None]
    tbl = jnp.zeros((b, g, c, nb + 1), bool).at[bi, gi, ci, idx].set(True)
    tbl = tbl.at[..., nb].set(False)
    gather = jnp.broadcast_to(kv_blk[:, None, None, :], (b, g, c, kv_blk.shape[-1]))
    return jnp.take_along_axis(tbl, gather, axis=-1)


@functools.partial(jax.jit, static_argnames=("block_size", "chunk_size"))
def index_scores(qi, ki, q_pos, kv_pos, q_seg, kv_seg, *, block_size: int, chunk_size: int,
                 kv_subtree_end=None) -> jax.Array:
    """Block scores ``[B, Hi, T, NB]`` float32 (``-inf`` where a block has no visible key);
    ``kv_subtree_end``: prefix-tree visibility (``common.visible``)."""
    nb = num_key_blocks(ki.shape[1], block_size)
    kv_blk = key_block_ids(kv_pos, kv_seg, block_size, nb)
    tree, tree_pads, tree_axes = tree_query_args(qi.shape[0], qi.shape[1], kv_subtree_end)

    def body(qi_c, qpos_c, qseg_c, *qidx):
        return _chunk_block_scores(qi_c, qpos_c, qseg_c, ki, kv_pos, kv_seg, kv_blk, nb, *qidx, kv_subtree_end)

    out, _, _, t = map_query_chunks(body, (qi, q_pos, q_seg) + tree, chunk_size, pad_values=(0, 0, -1) + tree_pads,
                                    t_axes=(1, 1, 1) + tree_axes, remat=False)
    return unchunk(out, 2, t)


@functools.partial(jax.jit, static_argnames=("block_size", "topk", "init_blocks", "local_blocks",
                                             "chunk_size"))
def select_blocks(qi, ki, q_pos, kv_pos, q_seg, kv_seg, *, block_size: int, topk: int, init_blocks: int,
                  local_blocks: int, chunk_size: int, kv_subtree_end=None) -> jax.Array:
    """Selected block ids ``[B, Hi, T, K]`` int32 (see ``select_from_block_scores``)."""
    nb = num_key_blocks(ki.shape[1], block_size)
    kv_blk = key_block_ids(kv_pos, kv_seg, block_size, nb)
    qi = jax.lax.stop_gradient(qi)
    ki = jax.lax.stop_gradient(ki)
    tree, tree_pads, tree_axes = tree_query_args(qi.shape[0], qi.shape[1], kv_subtree_end)

    def body(qi_c, qpos_c, qseg_c, *qidx):
        bs = _chunk_block_scores(qi_c, qpos_c, qseg_c, ki, kv_pos, kv_seg, kv_blk, nb, *qidx, kv_subtree_end)
        return select_from_block_scores(bs, qpos_c // block_size, topk=topk, init_blocks=init_blocks,
                                        local_blocks=local_blocks)

    out, _, _, t = map_query_chunks(body, (qi, q_pos, q_seg) + tree, chunk_size, pad_values=(0, 0, -1) + tree_pads,
                                    t_axes=(1, 1, 1) + tree_axes, remat=False)
    return unchunk(out, 2, t)


@functools.partial(jax.jit, static_argnames=("block_size", "chunk_size"))
def attention(q, k, v, block_ids, q_pos, kv_pos, q_seg, kv_seg, *, block_size: int,
              chunk_size: int, kv_subtree_end=None) -> tuple[jax.Array, jax.Array]:
    """Block-sparse GQA attention: ``o [B, T, H, D]`` (``q.dtype``) and ``lse [B, T, H]`` float32.

    Query head ``h`` uses group ``r = h // (H / G)`` and attends the keys of ``block_ids[:, r]`` that are
    visible to it (``common.visible``, with ``kv_subtree_end`` prefix-tree visibility); fp32 logits
    (scale ``1/sqrt(D)``), softmax and accumulation. A query with no visible key gets ``o = 0`` and
    ``lse = -inf``.
    """
    b, _, h, d = q.shape
    g = k.shape[2]
    r = h // g
    nb = num_key_blocks(k.shape[1], block_size)
    kv_blk = key_block_ids(kv_pos, kv_seg, block_size, nb)
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    scale = 1.0 / math.sqrt(d)

    tree, tree_pads, tree_axes = tree_query_args(b, q.shape[1], kv_subtree_end)

    def body(q_c, ids_c, qpos_c, qseg_c, *qidx):
        c = q_c.shape[1]
        vis = visible(qpos_c, qseg_c, kv_pos, kv_seg, *qidx, kv_subtree_end)
        mask = block_membership(ids_c, kv_blk, nb) & vis[:, None]
        qg = q_c.astype(jnp.float32).reshape(b, c, g, r, d)
        logits = jnp.einsum("bcgrd,bsgd->bgrcs", qg, kf, precision=HIGHEST) * scale
        p, lse = masked_softmax(logits, mask[:, :, None])
        o = jnp.einsum("bgrcs,bsgd->bcgrd", p, vf, precision=HIGHEST)
        return o.reshape(b, c, h, d).astype(q.dtype), jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, c, h)

    (o, lse), _, _, t = map_query_chunks(body, (q, block_ids, q_pos, q_seg) + tree, chunk_size,
                                         pad_values=(0, -1, 0, -1) + tree_pads, t_axes=(1, 2, 1, 1) + tree_axes)
    return unchunk(o, 1, t), unchunk(lse, 1, t)
