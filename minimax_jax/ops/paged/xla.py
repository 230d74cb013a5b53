"""Plain-JAX references of the paged decode ops: gather the pages, dequantise, then dense math (every platform).

Math: MSA_SPEC.md section 5; contracts in ``minimax_jax.ops.paged.api``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from minimax_jax.ops.msa.reference import select_from_block_scores

__all__ = ["dequantize", "paged_attention", "page_scores", "select_from_page_scores", "msa_decode_select"]

_HIGHEST = jax.lax.Precision.HIGHEST


def dequantize(x: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """Inverse of ``minimax_jax.decode.cache.quantize``: ``x * scale`` (``scale`` broadcast over the last
    axis; None = a plain cast), returned in ``dtype``."""
    if scale is None:
        return x.astype(dtype)
    return (x.astype(jnp.float32) * scale[..., None]).astype(dtype)


def _gather_kv(pages, scale, page_table, dtype):
    """[G, P, page, D] -> [B, G, NP*page, D] in ``dtype`` (logical order)."""
    x = pages[:, page_table]                                 # [G, B, NP, page, D]
    s = None if scale is None else scale[:, page_table]
    x = dequantize(x, s, dtype)
    g, b, n, p, d = x.shape
    return jnp.moveaxis(x, 0, 1).reshape(b, g, n * p, d)


def paged_attention(q, k_pages, v_pages, page_table, q_pos, *, k_scale, v_scale, block_ids, sliding_window,
                    pages_per_split=None, launch_table=None):
    """Reference of ``paged_attention`` (``pages_per_split`` and ``launch_table`` tune only the GPU kernel)."""
    b, nq, h, d = q.shape
    g, _, p, _ = k_pages.shape
    k = _gather_kv(k_pages, k_scale, page_table, jnp.float32)
    v = _gather_kv(v_pages, v_scale, page_table, jnp.float32)
    s_len = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, nq, g, h // g, d)
    logits = jnp.einsum("bqgjd,bgsd->bgqjs", qg, k, precision=_HIGHEST) / math.sqrt(d)
    kpos = jnp.arange(s_len, dtype=jnp.int32)
    qp = q_pos[:, None, :, None, None]
    vis = (kpos <= qp) & (qp >= 0)
    if sliding_window is not None:
        vis &= qp - kpos < sliding_window
    if block_ids is not None:                                # [B, G, Q, K] logical pages
        sel = jnp.any(block_ids[..., None] == (kpos // p)[None, None, None, None, :], axis=3)
        vis &= sel[:, :, :, None, :]
    logits = jnp.where(vis, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(vis, jnp.exp(logits - m_safe), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("bgqjs,bgsd->bqgjd", e / jnp.where(den > 0, den, 1.0), v, precision=_HIGHEST)
    lse = jnp.where(den[..., 0] > 0, m_safe[..., 0] + jnp.log(jnp.where(den[..., 0] > 0, den[..., 0], 1.0)),
                    -jnp.inf)                                # [B, G, Q, J]
    return o.reshape(b, nq, h, d).astype(q.dtype), jnp.moveaxis(lse, 2, 1).reshape(b, nq, h)


def page_scores(qi, ki_pages, ki_scale, page_table):
    """Block scores of every logical page: ``[B, Hi, Q, NP]`` f32 (max over the page's tokens)."""
    ki = dequantize(ki_pages[page_table], None if ki_scale is None else ki_scale[page_table], jnp.float32)
    s = jnp.einsum("bqhd,bnpd->bhqnp", qi.astype(jnp.float32), ki, precision=_HIGHEST)
    return jnp.max(s, axis=-1) / math.sqrt(qi.shape[-1])


def select_from_page_scores(scores, q_positions, page_size, *, topk, init_blocks=0, local_blocks=1):
    """Selection from raw page scores ``[B, Hi, Q, NP]``: ranks only complete pages ``< local``.

    Pages at or after the local page are made ineligible; the local page itself is forced
    (MSA_SPEC.md sections 2 and 5). Rows with ``pos < 0`` select nothing. Returns ``[B, Hi, Q, K]``
    int32 logical page ids in reference order, ``-1`` padded.
    """
    n = scores.shape[-1]
    local = jnp.where(q_positions >= 0, q_positions // page_size, -1)            # [B, Q]
    ids = jnp.arange(n, dtype=jnp.int32)
    loc = local[:, None, :, None]
    s = jnp.where(ids < loc, scores, jnp.where(ids == loc, 0.0, -jnp.inf))
    return select_from_block_scores(s, local, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks)


def msa_decode_select(qi, ki_pages, page_table, q_positions, *, ki_scale, topk, init_blocks, local_blocks,
                      launch_table=None):
    """Reference of ``msa_decode_select``: ``page_scores`` then ``select_from_page_scores`` (``launch_table``
    tunes only the GPU kernels)."""
    scores = page_scores(qi, ki_pages, ki_scale, page_table)
    return select_from_page_scores(scores, q_positions, ki_pages.shape[1], topk=topk, init_blocks=init_blocks,
                                   local_blocks=local_blocks)
