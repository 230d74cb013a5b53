"""Independent NumPy oracle for MSA (no JAX): explicit loops over (batch, query, head), float64 math.

Written from MSA_SPEC.md and docs/ARCHITECTURE.md only; it shares no code with ``minimax_jax``.
Visibility: key j is visible to query i iff same segment, kv_seg[j] >= 0 and kv_pos[j] <= q_pos[i];
a key's block is kv_pos // block_size; a query's local block is q_pos // block_size.
Everything is computed in float64 (stricter than the float32 op under test).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["visible_keys", "block_scores", "select_blocks", "attention", "indexer_kl"]


def visible_keys(b, i, q_pos, kv_pos, q_seg, kv_seg):
    """Indices j of the keys visible to query (b, i)."""
    out = []
    for j in range(kv_pos.shape[1]):
        if kv_seg[b, j] >= 0 and kv_seg[b, j] == q_seg[b, i] and kv_pos[b, j] <= q_pos[b, i]:
            out.append(j)
    return out


def block_scores(qi, ki, q_pos, kv_pos, q_seg, kv_seg, block_size):
    """``[B, Hi, T, NB]`` float64 block max of <qi, ki>/sqrt(Di) over visible keys; -inf if none."""
    bsz, t, hi, di = qi.shape
    s = ki.shape[1]
    nb = -(-s // block_size)
    out = np.full((bsz, hi, t, nb), -np.inf)
    for b in range(bsz):
        for i in range(t):
            keys = visible_keys(b, i, q_pos, kv_pos, q_seg, kv_seg)
            for r in range(hi):
                for j in keys:
                    blk = kv_pos[b, j] // block_size
                    sc = float(np.dot(qi[b, i, r].astype(np.float64), ki[b, j].astype(np.float64))) / math.sqrt(di)
                    if sc > out[b, r, i, blk]:
                        out[b, r, i, blk] = sc
    return out


def select_blocks(qi, ki, q_pos, kv_pos, q_seg, kv_seg, block_size, topk, init_blocks=0, local_blocks=1):
    """``(ids [B, Hi, T, K] int, scores [B, Hi, T, NB])`` in the reference order of MSA_SPEC.md."""
    sc = block_scores(qi, ki, q_pos, kv_pos, q_seg, kv_seg, block_size)
    bsz, hi, t, nb = sc.shape
    ids = np.full((bsz, hi, t, topk), -1, np.int64)
    for b in range(bsz):
        for r in range(hi):
            for i in range(t):
                local = int(q_pos[b, i]) // block_size
                cands = [c for c in range(nb) if sc[b, r, i, c] > -np.inf]
                before = [c for c in cands if c < local]
                forced = sorted(c for c in before if c < init_blocks or c > local - local_blocks)
                ranked = sorted((c for c in before if c not in forced), key=lambda c: (-sc[b, r, i, c], c))
                picks = (forced + ranked)[: topk - 1]
                if local in cands:
                    picks.append(local)
                ids[b, r, i, : len(picks)] = picks
    return ids, sc


def _lse(x):
    m = max(x)
    return m + math.log(sum(math.exp(v - m) for v in x))


def _support(b, r, i, block_ids, q_pos, kv_pos, q_seg, kv_seg, block_size):
    keys = visible_keys(b, i, q_pos, kv_pos, q_seg, kv_seg)
    if block_ids is None:
        return keys
    chosen = {int(c) for c in block_ids[b, r, i] if c >= 0}
    return [j for j in keys if kv_pos[b, j] // block_size in chosen]


def attention(q, k, v, block_ids, q_pos, kv_pos, q_seg, kv_seg, block_size):
    """``(o [B, T, H, Dv], lse [B, T, H])`` float64; ``block_ids=None`` gives dense causal attention."""
    bsz, t, h, d = q.shape
    g = k.shape[2]
    o = np.zeros((bsz, t, h, v.shape[-1]))
    lse = np.full((bsz, t, h), -np.inf)
    for b in range(bsz):
        for i in range(t):
            for hh in range(h):
                r = hh // (h // g)
                keys = _support(b, r, i, block_ids, q_pos, kv_pos, q_seg, kv_seg, block_size)
                if not keys:
                    continue
                logits = [float(np.dot(q[b, i, hh].astype(np.float64), k[b, j, r].astype(np.float64))) / math.sqrt(d)
                          for j in keys]
                z = _lse(logits)
                lse[b, i, hh] = z
                for j, lg in zip(keys, logits):
                    o[b, i, hh] += math.exp(lg - z) * v[b, j, r].astype(np.float64)
    return o, lse


def indexer_kl(q, k, qi, ki, block_ids, q_pos, kv_pos, q_seg, kv_seg, block_size):
    """``(kl_sum, count, dqi, dki)``: KL(teacher || student) summed over (b, i, r), the number of
    non-empty rows, and its gradient wrt qi / ki from the closed form d/ds_j = p_j - t_j."""
    bsz, t, h, d = q.shape
    g = k.shape[2]
    rep = h // g
    di = qi.shape[-1]
    total = 0.0
    count = 0
    dqi = np.zeros(qi.shape)
    dki = np.zeros(ki.shape)
    for b in range(bsz):
        for i in range(t):
            for r in range(g):
                keys = _support(b, r, i, block_ids, q_pos, kv_pos, q_seg, kv_seg, block_size)
                if not keys:
                    continue
                count += 1
                teacher = np.zeros(len(keys))
                for hh in range(r * rep, (r + 1) * rep):
                    lg = [float(np.dot(q[b, i, hh].astype(np.float64), k[b, j, r].astype(np.float64))) / math.sqrt(d)
                          for j in keys]
                    z = _lse(lg)
                    teacher += np.array([math.exp(x - z) for x in lg]) / rep
                s = [float(np.dot(qi[b, i, r].astype(np.float64), ki[b, j].astype(np.float64))) / math.sqrt(di)
                     for j in keys]
                zs = _lse(s)
                logp = np.array(s) - zs
                for n in range(len(keys)):
                    if teacher[n] > 0:
                        total += teacher[n] * (math.log(teacher[n]) - logp[n])
                coef = (np.exp(logp) - teacher) / math.sqrt(di)
                for n, j in enumerate(keys):
                    dqi[b, i, r] += coef[n] * ki[b, j].astype(np.float64)
                    dki[b, j] += coef[n] * qi[b, i, r].astype(np.float64)
    return total, count, dqi, dki
