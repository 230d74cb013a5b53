"""Shared helpers of the decode kernels: row packing, pow2 padding, split combination, 2-D dots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MAX_BLOCK_ROWS", "next_pow2", "pad_rows", "pad_positions", "row_block", "pack_rows", "unpack_rows",
           "union_pages", "combine_splits", "compute_dtype", "dot_nt", "dot_nn"]


def next_pow2(n: int, minimum: int = 1) -> int:
    p = minimum
    while p < n:
        p *= 2
    return p


def pad_rows(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pad ``x`` along ``axis`` up to ``size`` with ``value``."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def pad_positions(q_positions: jax.Array) -> jax.Array:
    """``[B, Qp]`` int32 positions, Qp = next_pow2(Q), padding rows -1 (no XLA op when Q is a power of two):
    what a Triton kernel loads as one vector (block shapes are powers of two)."""
    nq = q_positions.shape[1]
    pos = q_positions.astype(jnp.int32)
    return pos if next_pow2(nq) == nq else pad_rows(pos, 1, next_pow2(nq), -1)


def compute_dtype(cache_dtype) -> jnp.dtype:
    """Matmul operand dtype for a cache dtype: fp8 and bf16 compute in bf16, f32 in f32."""
    return jnp.dtype(jnp.float32) if jnp.dtype(cache_dtype) == jnp.float32 else jnp.dtype(jnp.bfloat16)


#: Most query rows of one row block: shared sparse tiles keep a bit per row of a page in an int32 word
#: (``union_pages``' bits), so at most 31.
MAX_BLOCK_ROWS = 31


def row_block(nq: int, hg: int, dense: bool, m_min: int, max_m: int = 64) -> tuple[int, int]:
    """``(qpb, m)`` of ``pack_rows``: query rows per row block (at most ``MAX_BLOCK_ROWS``) and the block's
    padded row count, for ``nq`` query rows of ``hg`` heads per kv group (arguments as ``pack_rows``)."""
    qpb = max(1, min(nq, max_m // hg, MAX_BLOCK_ROWS)) if dense else 1
    return qpb, max(m_min, next_pow2(qpb * hg))


def pack_rows(q: jax.Array, q_positions: jax.Array, g: int, dense: bool, m_min: int, max_m: int = 64):
    """Arrange queries as kernel row blocks.

    Args: q ``[B, Q, H, D]``; q_positions ``[B, Q]``; g kv heads; dense: stack several query rows
      of a group into one row block (they share the pages; at most ``max_m // (H/G)`` rows and
      ``MAX_BLOCK_ROWS``, at least one) vs. one row block per query row (MSA: each row has its own
      pages); m_min: minimum padded row count.
    Returns: ``(qr [B, G, R, M, D], pos [B, R, M] int32, hg, m, qpb)`` with padding rows at
      position -1 and ``qpb`` query rows per row block.
    """
    b, nq, h, d = q.shape
    hg = h // g
    qpb, m = row_block(nq, hg, dense, m_min, max_m)
    nblk = -(-nq // qpb)
    qg = q.reshape(b, nq, g, hg, d).transpose(0, 2, 1, 3, 4)              # [B, G, Q, hg, D]
    pos = jnp.broadcast_to(q_positions[:, :, None], (b, nq, hg))           # [B, Q, hg]
    qg = pad_rows(qg, 2, nblk * qpb).reshape(b, g, nblk, qpb * hg, d)
    pos = pad_rows(pos, 1, nblk * qpb, -1).reshape(b, nblk, qpb * hg)
    return pad_rows(qg, 3, m), pad_rows(pos, 2, m, -1).astype(jnp.int32), hg, m, qpb


def unpack_rows(o: jax.Array, lse: jax.Array, nq: int, hg: int, qpb: int):
    """Inverse of ``pack_rows`` for outputs ``o [B, G, R, M, D]``, ``lse [B, G, R, M]``.

    Returns ``(o [B, Q, H, D], lse [B, Q, H])``.
    """
    b, g, nblk = o.shape[:3]
    d = o.shape[-1]
    o = o[:, :, :, : qpb * hg].reshape(b, g, nblk * qpb, hg, d)[:, :, :nq]
    lse = lse[:, :, :, : qpb * hg].reshape(b, g, nblk * qpb, hg)[:, :, :nq]
    o = o.transpose(0, 2, 1, 3, 4).reshape(b, nq, g * hg, d)
    lse = lse.transpose(0, 2, 1, 3).reshape(b, nq, g * hg)
    return o, lse


def union_pages(block_ids: jax.Array, qpb: int, nsplit: int = 1, n_pages: int | None = None):
    """Per row block of ``qpb`` query rows: the union of its rows' selected pages, who selected each, and
    its order over ``nsplit`` split-KV programs.

    Split ``s`` takes the union's pages with ``page % nsplit == s``, ascending. Whatever the other rows of
    a tile selected, a row then meets its own pages in the same splits and the same order (the pages it did
    not select are exact no-ops of the online softmax), so it rounds alike alone or among other rows
    (speculative verify rows vs plain decoding, issue 34). Interleaving by page id keeps the splits
    balanced (a run of consecutive local pages spreads over all of them).

    Args: block_ids ``[B, G, Q, K]`` int32 logical page ids (``-1`` = empty; repeats allowed); nsplit >= 1.
    Returns: ``(ids [B, G, R, U], bits [B, G, R, U], starts [B, G, R, nsplit + 1])`` int32, ``R = ceil(Q /
      qpb)`` row blocks (the ``pack_rows`` blocks), ``U = qpb * K``: the distinct pages of the block's rows,
      split ``s`` in slots ``[starts[s], starts[s + 1])`` (``starts[nsplit]`` = the count), ``-1`` after;
      bit ``j`` of ``bits`` set iff row ``r * qpb + j`` selected that page (0 for ``-1`` slots).
    ``n_pages``: optional static bound on the ids (``ids < n_pages``, the page table's width). Given and at
      most ``U``, the union is built on a per-page bitmap (``_union_by_bitmap``, O(n_pages + qpb K^2) per row
      block instead of O(U^2); same result), the faster of the two there (bench/decode_union.py).
    """
    assert 1 <= qpb <= 31 and nsplit >= 1
    b, g, nq, k = block_ids.shape
    nblk = -(-nq // qpb)
    blk = pad_rows(block_ids.astype(jnp.int32), 2, nblk * qpb, -1).reshape(b, g, nblk, qpb, k)
    if n_pages is not None and n_pages <= qpb * k:
        return _union_by_bitmap(blk, nsplit, int(n_pages))
    flat = blk.reshape(b, g, nblk, qpb * k)                                   # [.., U]
    u = qpb * k
    i = jnp.arange(u, dtype=jnp.int32)
    valid = flat >= 0
    same = flat[..., :, None] == flat[..., None, :]                          # [.., U, U] (i, j)
    first = valid & ~jnp.any(same & (i[None, :] < i[:, None]), axis=-1)      # no equal id before it
    # Slot of a first occurrence: the first occurrences ordered before it by (page % nsplit, page).
    res = jnp.where(valid, flat % nsplit, nsplit)
    ahead = (res[..., None, :] < res[..., :, None]) | ((res[..., None, :] == res[..., :, None])
                                                      & (flat[..., None, :] < flat[..., :, None]))
    dest = jnp.sum(first[..., None, :] & ahead, axis=-1, dtype=jnp.int32)
    put = first[..., :, None] & (dest[..., :, None] == i[None, :])           # [.., U (src), U (dst)]
    ids = jnp.sum(jnp.where(put, flat[..., :, None] + 1, 0), axis=-2) - 1
    member = jnp.any(ids[..., :, None, None] == blk[..., None, :, :], axis=-1) & (ids[..., :, None] >= 0)
    bits = jnp.sum(member.astype(jnp.int32) << jnp.arange(qpb, dtype=jnp.int32), axis=-1)   # [.., U]
    counts = jnp.sum(first[..., None, :] & (res[..., None, :] == jnp.arange(nsplit, dtype=jnp.int32)[:, None]),
                     axis=-1, dtype=jnp.int32)                                 # [.., nsplit]
    starts = jnp.concatenate([jnp.zeros(counts.shape[:-1] + (1,), jnp.int32), jnp.cumsum(counts, axis=-1)], -1)
    return ids.astype(jnp.int32), bits.astype(jnp.int32), starts.astype(jnp.int32)


def _union_by_bitmap(blk: jax.Array, nsplit: int, n_pages: int):
    """``union_pages`` on a bitmap over the ``n_pages`` logical pages: blk ``[B, G, R, qpb, K]`` int32 (ids in
    ``[0, n_pages)`` or -1). Each row's repeats are dropped (first occurrence kept), every (row, page) adds
    ``1 << row`` to the page's word (one scatter-add: distinct rows set distinct bits), and the pages are
    walked in the static (page % nsplit, page) order, compacted by a running count."""
    b, g, nblk, qpb, k = blk.shape
    u = qpb * k
    i = jnp.arange(k, dtype=jnp.int32)
    dup = jnp.any((blk[..., :, None] == blk[..., None, :]) & (i[None, :] < i[:, None]), axis=-1)
    add = jnp.where((blk >= 0) & ~dup, jnp.left_shift(1, jnp.arange(qpb, dtype=jnp.int32))[:, None], 0)
    lead = (b * g * nblk,)
    rows = jnp.broadcast_to(jnp.arange(lead[0], dtype=jnp.int32)[:, None], lead + (u,))
    col = jnp.where(blk >= 0, blk, n_pages).reshape(lead + (u,))
    words = jnp.zeros(lead + (n_pages,), jnp.int32).at[rows, col].add(add.reshape(lead + (u,)), mode="drop")
    order = np.lexsort((np.arange(n_pages), np.arange(n_pages) % nsplit)).astype(np.int32)   # static
    words = words[:, order]
    occ = words != 0
    cum = jnp.cumsum(occ, axis=-1, dtype=jnp.int32)
    dest = jnp.where(occ, cum - 1, u)                                      # u: dropped
    rows_n = jnp.broadcast_to(rows[:, :1], lead + (n_pages,))
    ids = jnp.full(lead + (u,), -1, jnp.int32).at[rows_n, dest].set(jnp.broadcast_to(jnp.asarray(order), lead + (
        n_pages,)), mode="drop")
    bits = jnp.zeros(lead + (u,), jnp.int32).at[rows_n, dest].set(words, mode="drop")
    cum0 = jnp.concatenate([jnp.zeros(lead + (1,), jnp.int32), cum], axis=-1)
    first = np.searchsorted(np.arange(n_pages)[order] % nsplit, np.arange(nsplit + 1), side="left")  # class starts
    starts = cum0[:, first]
    shape = (b, g, nblk)
    return ids.reshape(shape + (u,)), bits.reshape(shape + (u,)), starts.reshape(shape + (nsplit + 1,))


def _ordered_sum(x: jax.Array, axis: int) -> jax.Array:
    """Sum over ``axis`` as a fixed pairwise tree of elementwise adds (halves, the odd last entry carried). An
    XLA reduction may order its adds differently for arrays of other shapes (a row's result could then differ
    by an ulp between a 64-row and a 128-row tile); elementwise adds cannot."""
    n = x.shape[axis]
    while n > 1:
        h = n // 2
        y = jax.lax.slice_in_dim(x, 0, h, axis=axis) + jax.lax.slice_in_dim(x, h, 2 * h, axis=axis)
        if n % 2:
            y = jnp.concatenate([y, jax.lax.slice_in_dim(x, 2 * h, n, axis=axis)], axis=axis)
        x, n = y, y.shape[axis]
    return jnp.squeeze(x, axis)


def combine_splits(o_part: jax.Array, lse_part: jax.Array, axis: int):
    """Merge split-KV partial results by their log-sum-exp.

    Args: o_part ``[..., S, M, D]`` f32 (each normalised over its split), lse_part ``[..., S, M]``
      f32 (``-inf`` for an empty split); ``axis`` is the split axis of ``lse_part``.
    Returns: ``(o [..., M, D] f32, lse [..., M] f32)``; ``o = 0``, ``lse = -inf`` where every split is empty.
    Each row's result depends on its own partials only, bit for bit (``_ordered_sum``), so a query row rounds
    alike in a tile of any height (speculative verification rows vs plain decoding, issue 34).
    """
    m = jnp.max(lse_part, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(jnp.isfinite(lse_part), jnp.exp(lse_part - m_safe), 0.0)
    den = _ordered_sum(w, axis)
    o = _ordered_sum(o_part * jnp.expand_dims(w, -1), axis) / jnp.expand_dims(jnp.where(den > 0, den, 1.0), -1)
    lse = jnp.where(den > 0, jnp.squeeze(m_safe, axis) + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
    return o, lse


def _precision(a):
    # float32 operands: full-precision dots (Triton would otherwise use tf32); bf16 needs nothing.
    return jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None


def dot_nt(a, b):
    """``a [M, K] @ b[N, K]^T -> [M, N]`` float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a),
                               preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """``a [M, K] @ b[K, N] -> [M, N]`` float32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(a),
                               preferred_element_type=jnp.float32)
