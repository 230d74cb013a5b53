"""Plain-JAX attention: the chunked reference (``"xla"``) and the banded sliding-window path (``"xla_banded"``).

Masking as in ``minimax_jax.ops.attention.api`` (positions, segment ids and, for prefix-tree rows,
``kv_subtree_end``); scale ``1/sqrt(D)``,
float32 logits and softmax, probabilities cast to the value dtype before the PV product, output in
``q.dtype``; rows with no visible key return zeros.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["visibility_mask", "xla", "xla_banded", "banded_unsupported"]

_NEG = -1e30


def visibility_mask(q_pos, kv_pos, q_seg, kv_seg, sliding_window=None, q_index=None, kv_subtree_end=None):
    """Boolean mask ``[B, T, S]`` of visible (query, key) pairs: same segment, segment >= 0,
    ``kv_pos <= q_pos``, with a window W ``q_pos - kv_pos < W`` and, with ``kv_subtree_end`` ``[B, S]``
    (prefix-tree rows; ``q_index`` ``[B, T]``: the queries' storage slots among the keys), key slot j
    only for queries at slots ``j <= q_index < kv_subtree_end[j]`` (its subtree)."""
    m = kv_pos[:, None, :] <= q_pos[:, :, None]
    m &= kv_seg[:, None, :] == q_seg[:, :, None]
    m &= kv_seg[:, None, :] >= 0
    if sliding_window is not None:
        m &= (q_pos[:, :, None] - kv_pos[:, None, :]) < sliding_window
    if kv_subtree_end is not None:
        slot = jnp.arange(kv_pos.shape[1], dtype=jnp.int32)[None, None, :]
        qi = q_index[:, :, None]
        m &= (slot <= qi) & (qi < kv_subtree_end[:, None, :])
    return m


def _segments(q, k, q_seg, kv_seg):
    """The segment ids, all zero where not given."""
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    return (jnp.zeros((b, t), jnp.int32) if q_seg is None else q_seg,
            jnp.zeros((b, s), jnp.int32) if kv_seg is None else kv_seg)


def xla(q, k, v, *, q_positions, kv_positions, q_segment_ids, kv_segment_ids, sliding_window, chunk_size,
        kv_subtree_end=None):
    """The reference: queries in chunks of ``chunk_size``, memory O(chunk * S)."""
    q_seg, kv_seg = _segments(q, k, q_segment_ids, kv_segment_ids)
    return _xla_chunked(q, k, v, q_positions, kv_positions, q_seg, kv_seg, sliding_window, chunk_size,
                        kv_subtree_end)


def banded_unsupported(q, k, v, *, q_positions, kv_positions, sliding_window, **_) -> str | None:
    """Why ``"xla_banded"`` cannot serve the call (None when it can)."""
    t, s = q.shape[1], k.shape[1]
    if sliding_window is None or t != s or q_positions is not kv_positions:
        return ("needs a sliding window and self-attention with one positions array for queries and keys "
                f"(got window={sliding_window}, T={t}, S={s}, same positions: {q_positions is kv_positions})")
    return None


def xla_banded(q, k, v, *, q_positions, kv_positions, q_segment_ids, kv_segment_ids, sliding_window, chunk_size,
               **_):
    """Sliding-window self-attention over the band only: query chunk ``[c, c + C)`` attends to the key
    slice ``[c - W, c + C)`` (memory and FLOPs O(T * (C + W))); the mask is applied exactly inside it."""
    assert banded_unsupported(q, k, v, q_positions=q_positions, kv_positions=kv_positions,
                              sliding_window=sliding_window) is None
    q_seg, kv_seg = _segments(q, k, q_segment_ids, kv_segment_ids)
    return _xla_banded(q, k, v, q_positions, q_seg, kv_seg, int(sliding_window), chunk_size)


def _attend(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, q_index=None, kv_end=None):
    b, t, h, d = q.shape
    g = k.shape[2]
    qg = q.reshape(b, t, g, h // g, d)
    logits = jnp.einsum("btgjd,bsgd->bgjts", qg, k, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(d))
    mask = visibility_mask(q_pos, kv_pos, q_seg, kv_seg, window, q_index, kv_end)[:, None, None]
    logits = jnp.where(mask, logits, _NEG)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    o = jnp.einsum("bgjts,bsgd->btgjd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, h, d).astype(q.dtype)


def _xla_chunked(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, chunk, kv_end=None):
    b, t, h, d = q.shape
    q_idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if t <= chunk:
        return _attend(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, q_idx, kv_end)
    n = -(-t // chunk)
    pad = n * chunk - t
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    pp = jnp.pad(q_pos, ((0, 0), (0, pad)))
    sp = jnp.pad(q_seg, ((0, 0), (0, pad)), constant_values=-2)
    ip = jnp.pad(q_idx, ((0, 0), (0, pad)))

    def one(args):
        qc, pc, sc, ic = args
        return _attend(qc, k, v, pc, kv_pos, sc, kv_seg, window, ic, kv_end)

    qs = qp.reshape(b, n, chunk, h, d).transpose(1, 0, 2, 3, 4)
    ps, ss, is_ = (x.reshape(b, n, chunk).transpose(1, 0, 2) for x in (pp, sp, ip))
    out = jax.lax.map(one, (qs, ps, ss, is_))
    return out.transpose(1, 0, 2, 3, 4).reshape(b, n * chunk, h, d)[:, :t]


def _xla_banded(q, k, v, pos, q_seg, kv_seg, window, chunk):
    b, t, h, d = q.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad_t = n * c - t
    w = window                                  # keys [start - w, start + c) cover every visible one
    qp = jnp.pad(q, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
    pq = jnp.pad(pos, ((0, 0), (0, pad_t)))
    sq = jnp.pad(q_seg, ((0, 0), (0, pad_t)), constant_values=-2)
    kp = jnp.pad(k, ((0, 0), (w, pad_t), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (w, pad_t), (0, 0), (0, 0)))
    pk = jnp.pad(pos, ((0, 0), (w, pad_t)))
    sk = jnp.pad(kv_seg, ((0, 0), (w, pad_t)), constant_values=-1)   # padding keys are never visible

    def one(i):
        start = i * c                            # query start; key slice starts at start - w (+ w pad)
        sl = lambda x, size: jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)
        return _attend(sl(qp, c), sl(kp, c + w), sl(vp, c + w), sl(pq, c), sl(pk, c + w),
                       sl(sq, c), sl(sk, c + w), window)

    out = jax.lax.map(one, jnp.arange(n))       # [n, B, c, H, D]
    return out.transpose(1, 0, 2, 3, 4).reshape(b, n * c, h, d)[:, :t]
