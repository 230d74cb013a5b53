"""Chunked plain-JAX (XLA) reference of the MSA indexer KL loss (MSA_SPEC.md section 4).

For query ``i`` and group ``r`` let the support ``U`` be the keys of the selected blocks of
``(i, r)`` visible to ``i`` (sparse mode) or every visible key (dense warm-up, ``block_ids=None``).

- teacher ``t = mean_{h in group r} softmax_U(<q_h, k_j> / sqrt(D))`` (main-branch probabilities
  renormalised on ``U``, averaged over the group's ``H/G`` heads), under ``stop_gradient``;
- student ``p = softmax_U(<qi_r, ki_j> / sqrt(Di))``;
- loss term ``KL(t || p) = sum_{j in U} t_j (log t_j - log p_j)``.

Returns the sum over ``(b, i, r)`` and the number of rows with a non-empty support, so callers
normalise by ``Hi * T_total`` (across devices and micro-batches) themselves. The gradient wrt the
student logits of one row is ``p - t``; it reaches only ``qi`` and ``ki``.
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
    visible,
)
from minimax_jax.ops.msa.reference import block_membership

__all__ = ["indexer_kl", "kl_rows"]


def kl_rows(main_logits: jax.Array, index_logits: jax.Array, support: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row KL(teacher || student) on a support.

    Args:
      main_logits: ``[..., R, S]`` float32 scaled main-branch logits of the group's ``R`` heads.
      index_logits: ``[..., S]`` float32 scaled index logits of the group.
      support: ``[..., S]`` bool.
    Returns: ``(kl [...] float32, nonempty [...] bool)``; empty rows give ``kl = 0``.
    """
    p_main, _ = masked_softmax(jax.lax.stop_gradient(main_logits), support[..., None, :])
    teacher = jax.lax.stop_gradient(jnp.mean(p_main, axis=-2))
    _, lse = masked_softmax(index_logits, support)
    nonempty = jnp.isfinite(lse)
    log_student = jnp.where(support, index_logits - jnp.where(nonempty, lse, 0.0)[..., None], 0.0)
    keep = support & (teacher > 0)
    log_teacher = jnp.log(jnp.where(keep, teacher, 1.0))
    kl = jnp.sum(jnp.where(keep, teacher * (log_teacher - log_student), 0.0), axis=-1)
    return kl, nonempty


@functools.partial(jax.jit, static_argnames=("block_size", "chunk_size"))
def indexer_kl(q, k, qi, ki, block_ids, q_pos, kv_pos, q_seg, kv_seg, *, block_size: int | None,
               chunk_size: int, kv_subtree_end=None, q_weights=None) -> tuple[jax.Array, jax.Array]:
    """KL sum and row count (see module docstring).

    Args:
      q: ``[B, T, H, D]``; k: ``[B, S, G, D]`` (main branch; no gradient flows to them).
      qi: ``[B, T, Hi, Di]`` with ``Hi == G``; ki: ``[B, S, Di]``.
      block_ids: ``[B, Hi, T, K]`` int32 or ``None`` (dense warm-up over the whole causal history).
      q_pos, q_seg: ``[B, T]`` int32; kv_pos, kv_seg: ``[B, S]`` int32.
      block_size: B (required when ``block_ids`` is given).
      kv_subtree_end: ``[B, S]`` int32 or None: prefix-tree visibility (``common.visible``).
      q_weights: ``[B, T]`` float32 or None: weight of each query's rows in the sum and the count.
    Returns: ``(kl_sum float32 [], count [])``: count int32, float32 with ``q_weights``.
    """
    b, _, h, d = q.shape
    g = k.shape[2]
    r = h // g
    di = qi.shape[-1]
    kf = jax.lax.stop_gradient(k).astype(jnp.float32)
    kif = ki.astype(jnp.float32)
    sparse = block_ids is not None
    if sparse:
        nb = num_key_blocks(k.shape[1], block_size)
        kv_blk = key_block_ids(kv_pos, kv_seg, block_size, nb)

    tree, tree_pads, tree_axes = tree_query_args(b, q.shape[1], kv_subtree_end)

    weighted = q_weights is not None
    wts = (q_weights.astype(jnp.float32),) if weighted else ()

    def body(q_c, qi_c, qpos_c, qseg_c, *rest):
        c = q_c.shape[1]
        qidx = rest[:len(tree)]
        rest = rest[len(tree):]
        if weighted:
            w_c, rest = rest[0][:, None, :], rest[1:]
        vis = visible(qpos_c, qseg_c, kv_pos, kv_seg, *qidx, kv_subtree_end)
        support = jnp.broadcast_to(vis[:, None], (b, g, c, kv_pos.shape[1]))
        if sparse:
            support = support & block_membership(rest[0], kv_blk, nb)
        qg = jax.lax.stop_gradient(q_c).astype(jnp.float32).reshape(b, c, g, r, d)
        main = jnp.einsum("bcgrd,bsgd->bgcrs", qg, kf, precision=HIGHEST) / math.sqrt(d)
        idx = jnp.einsum("bcgd,bsd->bgcs", qi_c.astype(jnp.float32), kif, precision=HIGHEST) / math.sqrt(di)
        kl, nonempty = kl_rows(main, idx, support)
        if weighted:
            return jnp.sum(kl * w_c), jnp.sum(jnp.where(nonempty, w_c, 0.0))
        return jnp.sum(kl), jnp.sum(nonempty.astype(jnp.int32))

    args = (q, qi, q_pos, q_seg) + tree + wts + ((block_ids,) if sparse else ())
    pads = (0, 0, 0, -1) + tree_pads + ((0,) if weighted else ()) + ((-1,) if sparse else ())
    axes = (1, 1, 1, 1) + tree_axes + ((1,) if weighted else ()) + ((2,) if sparse else ())
    (kl, cnt), _, _, _ = map_query_chunks(body, args, chunk_size, pad_values=pads, t_axes=axes)
    return jnp.sum(kl), jnp.sum(cnt)
