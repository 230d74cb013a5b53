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


# ----------------------------------------------------------------------------- input builders

def make_case(rng, *, bsz, t, s, h, g, d, dv=None, segments=None, dtype=np.float32):
    """Fresh random inputs. segments: per batch row a list of document lengths (rest = empty
    slots, segment id -1). Queries are the last t keys. Returns a dict of numpy arrays."""
    dv = d if dv is None else dv
    if segments is None:
        kv_pos = np.broadcast_to(np.arange(s), (bsz, s)).astype(np.int32)
        kv_seg = np.zeros((bsz, s), np.int32)
    else:
        kv_pos = np.zeros((bsz, s), np.int32)
        kv_seg = np.full((bsz, s), -1, np.int32)
        for b, lens in enumerate(segments):
            o = 0
            for i, n in enumerate(lens):
                kv_pos[b, o:o + n] = np.arange(n)
                kv_seg[b, o:o + n] = i
                o += n
    return dict(q=rng.standard_normal((bsz, t, h, d)).astype(dtype),
                k=rng.standard_normal((bsz, s, g, d)).astype(dtype),
                v=rng.standard_normal((bsz, s, g, dv)).astype(dtype),
                do=rng.standard_normal((bsz, t, h, dv)).astype(np.float32),
                q_pos=np.ascontiguousarray(kv_pos[:, s - t:]), kv_pos=kv_pos,
                q_seg=np.ascontiguousarray(kv_seg[:, s - t:]), kv_seg=kv_seg)


def random_ids(rng, q_pos, q_seg, g, topk, block_size):
    """Random valid selections [B,G,T,K]: up to K-1 earlier blocks plus the local one, shuffled,
    -1 padded; nothing for queries in empty slots (q_seg < 0)."""
    bsz, t = q_pos.shape
    ids = np.full((bsz, g, t, topk), -1, np.int32)
    for b in range(bsz):
        for r in range(g):
            for i in range(t):
                if q_seg[b, i] < 0:
                    continue
                loc = int(q_pos[b, i]) // block_size
                n = min(topk - 1, loc)
                sel = list(rng.choice(loc, size=n, replace=False)) + [loc] if loc else [0]
                rng.shuffle(sel)
                ids[b, r, i, :len(sel)] = sel
    return ids


def positions(c):
    """Keyword arguments for the ops / kernels from a make_case dict (jnp arrays)."""
    import jax.numpy as jnp
    return dict(q_positions=jnp.asarray(c["q_pos"]), kv_positions=jnp.asarray(c["kv_pos"]),
                q_segment_ids=jnp.asarray(c["q_seg"]), kv_segment_ids=jnp.asarray(c["kv_seg"]))


def cosine(a, b):
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


def id_sets(ids):
    """{(b, r, i): set of valid ids} and a check that no row repeats an id."""
    out = {}
    for idx in np.ndindex(ids.shape[:3]):
        row = [int(x) for x in ids[idx] if x >= 0]
        assert len(row) == len(set(row)), f"duplicate ids at {idx}: {ids[idx]}"
        out[idx] = set(row)
    return out


# ----------------------------------------------------------------------------- oracle self-checks

def test_oracle_attention_matches_xla_reference():
    """Two independent oracles (this file's dense fp64 one and minimax_jax.ops.msa) agree."""
    from minimax_jax.ops import msa as msa_ops
    rng = np.random.default_rng(0)
    c = make_case(rng, bsz=2, t=40, s=90, h=4, g=2, d=8, segments=[[30, 50], [90]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 4, 16)
    o, lse = attention(c["q"], c["k"], c["v"], ids, c["q_pos"], c["kv_pos"], c["q_seg"],
                       c["kv_seg"], 16)
    ro, rlse = msa_ops.msa_attention(c["q"], c["k"], c["v"], ids, block_size=16,
                                     implementation="xla", **positions(c))
    np.testing.assert_allclose(np.asarray(ro), o, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.isfinite(np.asarray(rlse)), np.isfinite(lse))
    fin = np.isfinite(lse)
    np.testing.assert_allclose(np.asarray(rlse)[fin], lse[fin], atol=1e-5)


def test_oracle_selection_matches_xla_reference():
    from minimax_jax.ops import msa as msa_ops
    rng = np.random.default_rng(1)
    t = s = 200
    qi = rng.standard_normal((1, t, 2, 8)).astype(np.float32)
    ki = rng.standard_normal((1, s, 8)).astype(np.float32)
    pos = np.arange(s, dtype=np.int32)[None]
    z = np.zeros((1, s), np.int32)
    sc = block_scores(qi, ki, pos, pos, z, z, 16, 13)
    want = select_sets(sc, pos, 5, 16)
    got = np.asarray(msa_ops.msa_select_blocks(qi, ki, q_positions=pos, kv_positions=pos,
                                               block_size=16, topk=5, implementation="xla"))
    assert id_sets(got) == want
