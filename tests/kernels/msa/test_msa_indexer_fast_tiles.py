"""The GPU indexer's mask-free prefix (``fast_tile_ends``) against a semantic oracle, and the
selection it produces against the dense reference on layouts where that prefix is long."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.msa import layout
from pallas_kernels.msa.gpu_indexer import fast_tile_ends, msa_select_blocks_gpu
from tests.kernels.msa.test_msa_kernels_gpu import _check_selection
from tests.kernels.msa.test_msa_kernels_oracle import make_case, positions, visible

BLK = 16


def _oracle_ends(qpos, qseg, base, kv_pos, kv_seg, blk, tq):
    """First key tile >= the row tile's first tile where some row does not see every key whole
    and inside its block ``floor((tile*B - base)/B)``; clipped to [t_lo, t_hi] like the kernel."""
    bsz, tp = qpos.shape
    n_tiles = kv_pos.shape[1] // blk
    vis = visible(qpos, kv_pos, qseg, kv_seg)                         # [B, Tp, Sp]
    ends = np.zeros((bsz, tp // tq), np.int64)
    for b in range(bsz):
        for r in range(tp // tq):
            rows = slice(r * tq, (r + 1) * tq)
            t_lo = max(int(base[b, rows].min()), 0) // blk
            t_hi = min(max(int((base[b, rows] + qpos[b, rows]).max()), 0) // blk + 1, n_tiles)
            end = t_lo
            while end < t_hi:
                keys = slice(end * blk, (end + 1) * blk)
                n0 = (end * blk - base[b, rows]) // blk                 # floor, per row
                ok = vis[b, rows, keys].all() and all(
                    (kv_pos[b, keys] // blk == n).all() for n in n0)
                if not ok:
                    break
                end += 1
            ends[b, r] = max(min(end, t_hi), t_lo)
    return ends


def _prepared(c, tq):
    qi = jnp.zeros(c["q"].shape[:2] + (1, 4), jnp.float32)
    prep = layout.prepare(jnp.zeros(c["k"].shape[:2] + (1, 4)), None, jnp.asarray(c["q_pos"]),
                          jnp.asarray(c["kv_pos"]), jnp.asarray(c["q_seg"]), jnp.asarray(c["kv_seg"]),
                          BLK)
    _, qpos, qseg, base, _ = layout.pad_query_rows(qi, jnp.asarray(c["q_pos"]), prep, tq)
    return qpos, qseg, base, prep


@pytest.mark.parametrize("kw", [
    dict(bsz=1, t=200, s=200),                                      # causal self-attention
    dict(bsz=2, t=37, s=150),                                       # queries a suffix, padded rows
    dict(bsz=1, t=180, s=180, segments=[[64, 48, 30, 38]]),          # packed, aligned + unaligned
    dict(bsz=1, t=120, s=160, segments=[[23, 90, 20]]),              # unaligned bases, empty tail
])
@pytest.mark.parametrize("tq", [4, 16])
def test_fast_tile_ends_match_semantic_oracle(kw, tq):
    c = make_case(np.random.default_rng(0), h=2, g=1, d=4, **kw)
    qpos, qseg, base, prep = _prepared(c, tq)
    got = fast_tile_ends(qpos, qseg, base, prep.kv_pos, prep.kv_seg, blk=BLK, rows_per_tile=tq)
    n_tiles = prep.s_pad // BLK
    t_lo = np.maximum(np.asarray(base).reshape(qpos.shape[0], -1, tq).min(-1), 0) // BLK
    t_hi = np.minimum(np.maximum(np.asarray(base + qpos).reshape(qpos.shape[0], -1, tq).max(-1), 0)
                      // BLK + 1, n_tiles)
    got = np.clip(np.asarray(got), t_lo, t_hi)                       # what the kernel uses
    want = _oracle_ends(np.asarray(qpos), np.asarray(qseg), np.asarray(base), np.asarray(prep.kv_pos),
                        np.asarray(prep.kv_seg), BLK, tq)
    np.testing.assert_array_equal(got, want)
    if kw.get("segments") is None:
        assert (want > t_lo).any()                                   # the mask-free loop is exercised


@pytest.mark.parametrize("kw", [dict(bsz=1, t=256, s=256), dict(bsz=1, t=100, s=300),
                                dict(bsz=1, t=200, s=200, segments=[[96, 64, 40]])])
def test_selection_with_long_mask_free_prefix(kw):
    """Long unpacked / suffix / aligned-packed layouts: most tiles take the mask-free loop."""
    rng = np.random.default_rng(1)
    c = make_case(rng, h=4, g=2, d=16, **kw)
    hi = 2
    qi = rng.standard_normal((kw["bsz"], kw["t"], hi, 16)).astype(np.float32)
    ki = rng.standard_normal((kw["bsz"], kw["s"], 16)).astype(np.float32)
    f = jax.jit(lambda qi, ki: msa_select_blocks_gpu(qi, ki, block_size=BLK, topk=4, rows=16,
                                                     interpret=True, **positions(c)))
    ids = f(jnp.asarray(qi), jnp.asarray(ki))
    ref = _check_selection(ids, c, qi, ki, 4)
    np.testing.assert_array_equal(np.asarray(ids), ref)
