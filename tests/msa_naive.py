"""Full-materialisation plain-JAX MSA reference, for tests only (memory O(T * S * NB)).

Written independently of ``minimax_jax.ops.msa.reference`` (no query chunking, one-hot block
pooling, selection by a lexicographic sort instead of ``top_k``, membership by direct comparison
with every selected id) so that comparing the two checks the chunked reference. Same math: MSA_SPEC.md sections 1-4.
Inputs are validated arrays as in that module.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["index_scores", "select_blocks", "attention", "indexer_kl"]

_HI = jax.lax.Precision.HIGHEST


def _visible(q_pos, q_seg, kv_pos, kv_seg):
    return ((q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] >= 0)
            & (kv_pos[:, None, :] <= q_pos[:, :, None]))


def _nb(s, block_size):
    return -(-s // block_size)


def index_scores(qi, ki, q_pos, kv_pos, q_seg, kv_seg, *, block_size):
    """Block scores ``[B, Hi, T, NB]`` float32 by one-hot max pooling of all token scores."""
    s = jnp.einsum("bthd,bsd->bhts", qi.astype(jnp.float32), ki.astype(jnp.float32), precision=_HI)
    s = s / math.sqrt(qi.shape[-1])
    vis = _visible(q_pos, q_seg, kv_pos, kv_seg)[:, None]
    nb = _nb(ki.shape[1], block_size)
    onehot = (kv_pos[:, :, None] // block_size) == jnp.arange(nb)[None, None, :]  # [B, S, NB]
    onehot = onehot & (kv_seg >= 0)[:, :, None]
    cell = jnp.where(vis[..., None] & onehot[:, None, None], s[..., None], -jnp.inf)  # [B,Hi,T,S,NB]
    return jnp.max(cell, axis=-2)


def select_blocks(qi, ki, q_pos, kv_pos, q_seg, kv_seg, *, block_size, topk, init_blocks, local_blocks):
    """Selected ids ``[B, Hi, T, K]`` int32, reference order, by a lexicographic sort of the blocks."""
    bs = index_scores(qi, ki, q_pos, kv_pos, q_seg, kv_seg, block_size=block_size)
    b, hi, t, nb = bs.shape
    ids = jnp.broadcast_to(jnp.arange(nb), bs.shape)
    local = (q_pos // block_size)[:, None, :, None]
    cand = jnp.isfinite(bs)
    is_local = ids == local
    forced = cand & (ids < local) & ((ids < init_blocks) | (ids >= local - local_blocks + 1))
    # category: 0 forced non-local, 1 ranked non-local, 2 excluded (local or no visible key)
    cat = jnp.where(is_local | ~cand, 2, jnp.where(forced, 0, 1))
    neg_score = jnp.where(cat == 1, -bs, 0.0)
    order = jnp.lexsort((ids, neg_score, cat), axis=-1)
    n_lead = topk - 1
    picked = order[..., :n_lead]
    picked_cat = jnp.take_along_axis(cat, picked, axis=-1)
    picked = jnp.where(picked_cat < 2, picked, -1)
    if picked.shape[-1] < n_lead:
        picked = jnp.concatenate([picked, jnp.full((b, hi, t, n_lead - picked.shape[-1]), -1, picked.dtype)], -1)
    out = jnp.concatenate([picked, jnp.full((b, hi, t, 1), -1, picked.dtype)], -1).astype(jnp.int32)
    n_valid = jnp.sum(out >= 0, axis=-1, keepdims=True)
    has_local = jnp.any(is_local & cand, axis=-1, keepdims=True)
    slots = jnp.arange(topk)
    return jnp.where((slots == n_valid) & has_local, local, out).astype(jnp.int32)


def _support(block_ids, q_pos, kv_pos, q_seg, kv_seg, block_size):
    vis = _visible(q_pos, q_seg, kv_pos, kv_seg)[:, None]  # [B, 1, T, S]
    if block_ids is None:
        return vis
    kv_blk = jnp.where(kv_seg >= 0, kv_pos // block_size, -2)
    hit = block_ids[..., :, None] == kv_blk[:, None, None, None, :]  # [B, G, T, K, S]
    hit = hit & (block_ids[..., :, None] >= 0)
    return vis & jnp.any(hit, axis=-2)


def _log_softmax_on(logits, mask):
    lse = jax.nn.logsumexp(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
    ok = jnp.isfinite(lse)
    logp = jnp.where(mask & ok, logits - jnp.where(ok, lse, 0.0), -jnp.inf)
    return logp, lse[..., 0]


def attention(q, k, v, block_ids, q_pos, kv_pos, q_seg, kv_seg, *, block_size):
    """``(o [B, T, H, D] in q.dtype, lse [B, T, H] float32)`` from the full ``[B, H, T, S]`` mask."""
    b, t, h, d = q.shape
    g = k.shape[2]
    mask = _support(block_ids, q_pos, kv_pos, q_seg, kv_seg, block_size)  # [B, G, T, S]
    mask_h = jnp.repeat(mask, h // g, axis=1)  # [B, H, T, S]
    k_h = jnp.repeat(k.astype(jnp.float32), h // g, axis=2)
    v_h = jnp.repeat(v.astype(jnp.float32), h // g, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k_h, precision=_HI) / math.sqrt(d)
    logp, lse = _log_softmax_on(logits, mask_h)
    p = jnp.exp(logp)
    o = jnp.einsum("bhts,bshd->bthd", p, v_h, precision=_HI)
    return o.astype(q.dtype), jnp.transpose(lse, (0, 2, 1))


def indexer_kl(q, k, qi, ki, block_ids, q_pos, kv_pos, q_seg, kv_seg, *, block_size):
    """``(kl_sum float32, count int32)``; same definition as ``minimax_jax.ops.msa.kl``."""
    b, t, h, d = q.shape
    g = k.shape[2]
    r = h // g
    support = _support(block_ids, q_pos, kv_pos, q_seg, kv_seg, block_size)
    support = jnp.broadcast_to(support, (b, g, t, k.shape[1]))
    qm = jax.lax.stop_gradient(q).astype(jnp.float32).reshape(b, t, g, r, d)
    km = jax.lax.stop_gradient(k).astype(jnp.float32)
    main = jnp.einsum("btgrd,bsgd->bgrts", qm, km, precision=_HI) / math.sqrt(d)
    logp_main, _ = _log_softmax_on(main, support[:, :, None])
    teacher = jax.lax.stop_gradient(jnp.mean(jnp.exp(logp_main), axis=2))  # [B, G, T, S]
    idx = jnp.einsum("btgd,bsd->bgts", qi.astype(jnp.float32), ki.astype(jnp.float32), precision=_HI)
    idx = idx / math.sqrt(qi.shape[-1])
    logp_idx, lse_idx = _log_softmax_on(idx, support)
    pos = support & (teacher > 0)
    term = jnp.where(pos, teacher * (jnp.log(jnp.where(pos, teacher, 1.0)) - jnp.where(pos, logp_idx, 0.0)), 0.0)
    count = jnp.sum(jnp.isfinite(lse_idx).astype(jnp.int32))
    return jnp.sum(term), count
