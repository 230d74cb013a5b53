"""Small independent FP32 oracles for the MSA kernel tests (dense masks; small shapes only).

Written from MSA_SPEC.md sections 1-4, independent of the kernels: every quantity is computed
densely over all (query, key) pairs with explicit masks.
"""

from __future__ import annotations

import numpy as np


def visible(q_pos, kv_pos, q_seg, kv_seg):
    """bool [B,T,S]: key j visible to query i (causal, same segment, non-empty slot)."""
    return ((kv_seg[:, None, :] == q_seg[:, :, None]) & (kv_seg[:, None, :] >= 0)
            & (kv_pos[:, None, :] <= q_pos[:, :, None]))


def selected_mask(block_ids, kv_pos, block_size):
    """bool [B,G,T,S]: key j's block (kv_pos // B) is among the selected ids of (g, i)."""
    kb = kv_pos // block_size                                    # [B,S]
    ids = block_ids[..., None]                                   # [B,G,T,K,1]
    hit = (ids == kb[:, None, None, None, :]) & (ids >= 0)
    return hit.any(axis=3)


def attention(q, k, v, block_ids, q_pos, kv_pos, q_seg, kv_seg, block_size):
    """FP64 sparse attention: (o [B,T,H,D], lse [B,T,H]); rows with no key give o=0, lse=-inf."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    bsz, t, h, d = q.shape
    g = k.shape[2]
    hg = h // g
    vis = visible(q_pos, kv_pos, q_seg, kv_seg)[:, None] & selected_mask(block_ids, kv_pos,
                                                                          block_size)  # [B,G,T,S]
    kh = np.repeat(k, hg, axis=2)
    vh = np.repeat(v, hg, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, kh) / np.sqrt(d)
    m = np.repeat(vis, hg, axis=1)
    s = np.where(m, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    p = np.exp(s - mx)
    l = p.sum(-1, keepdims=True)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l > 0, l, 1.0))[..., 0] + mx[..., 0], -np.inf)
    p = p / np.where(l > 0, l, 1.0)
    o = np.einsum("bhts,bshd->bthd", p, vh)
    return o, np.transpose(lse, (0, 2, 1))


def block_scores(qi, ki, q_pos, kv_pos, q_seg, kv_seg, block_size, n_blocks):
    """FP64 block max-pooled index scores [B,Hi,T,NB], -inf where the block has no visible key."""
    qi = np.asarray(qi, np.float64)
    ki = np.asarray(ki, np.float64)
    s = np.einsum("btrd,bsd->brts", qi, ki) / np.sqrt(qi.shape[-1])
    vis = visible(q_pos, kv_pos, q_seg, kv_seg)[:, None]
    s = np.where(vis, s, -np.inf)
    kb = kv_pos // block_size
    out = np.full(s.shape[:3] + (n_blocks,), -np.inf)
    for n in range(n_blocks):
        sel = (kb == n)[:, None, None, :]
        out[..., n] = np.where(sel, s, -np.inf).max(-1)
    return out


def select_sets(scores, q_pos, topk, block_size):
    """Reference block SETS per (b, r, i) from block scores (MSA_SPEC section 2)."""
    bsz, hi, t, nb = scores.shape
    sets = {}
    for b in range(bsz):
        for r in range(hi):
            for i in range(t):
                local = int(q_pos[b, i]) // block_size
                if local + 1 <= topk:
                    sel = set(range(local + 1))
                else:
                    sc = scores[b, r, i, :local]
                    order = sorted(range(local), key=lambda n: (-sc[n], n))[:topk - 1]
                    sel = set(order) | {local}
                sets[(b, r, i)] = sel
    return sets


def attention_jnp(q, k, v, vis_bgts):
    """Differentiable dense jnp oracle (fp32): vis_bgts bool [B,G,T,S] (visible & selected)."""
    import jax.numpy as jnp
    q = q.astype(jnp.float32)
    k = k.astype(jnp.float32)
    v = v.astype(jnp.float32)
    hg = q.shape[2] // k.shape[2]
    kh = jnp.repeat(k, hg, axis=2)
    vh = jnp.repeat(v, hg, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, kh, precision="highest") / np.sqrt(q.shape[-1])
    m = jnp.repeat(vis_bgts, hg, axis=1)
    s = jnp.where(m, s, -jnp.inf)
    mx = jnp.max(s, -1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.where(m, jnp.exp(s - mx), 0.0)
    l = jnp.sum(p, -1, keepdims=True)
    p = p / jnp.where(l > 0, l, 1.0)
    return jnp.einsum("bhts,bshd->bthd", p, vh, precision="highest")
