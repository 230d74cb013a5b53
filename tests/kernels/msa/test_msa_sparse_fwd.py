"""KV-outer MSA forward (pallas_kernels/msa/gpu_sparse_fwd.py) in Pallas interpret mode: the schedule's
own edge cases against the fp64 dense oracle (every element).

Edge cases of the schedule: runs of one K/V window split over several programs (small ``chunk``),
row tiles that end inside a run, GQA groups of 1, 3, 6 and 16 heads (rows per tile not a multiple
of H/G), tokens with no valid slot, the query-chunk loop (T not a multiple of the chunk: the last
chunk is clamped and recomputes tokens), packed segments with unaligned windows, queries as a
suffix of the keys, and bitwise repeatability.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.msa import gpu_sparse_fwd as gs
from tests.kernels.msa.test_msa_kernels_oracle import attention, make_case, random_ids

BLK = 16


def _fwd(c, ids, dtype=jnp.float32, **kw):
    q, k, v = (jnp.asarray(c[n], dtype) for n in ("q", "k", "v"))
    f = jax.jit(lambda q, k, v, ids: gs.sparse_fwd_kv_outer(
        q, k, v, ids, jnp.asarray(c["q_pos"]), jnp.asarray(c["kv_pos"]), jnp.asarray(c["q_seg"]),
        jnp.asarray(c["kv_seg"]), block_size=BLK, interpret=True, **kw))
    o, lse = f(q, k, v, jnp.asarray(ids))
    return np.asarray(o, np.float64), np.asarray(lse, np.float64)


def _check(c, ids, o, lse, atol=2e-5):
    ro, rlse = attention(c["q"], c["k"], c["v"], ids, c["q_pos"], c["kv_pos"], c["q_seg"],
                         c["kv_seg"], BLK)
    np.testing.assert_allclose(o, ro, atol=atol, rtol=atol)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rlse))
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], atol=atol)
    assert np.all(o[~np.broadcast_to(fin[..., None], o.shape)] == 0.0)


# H/G = 1, 3, 6, 16; 6 (rows left unused in a 32-row tile, as 3 does) only in the slow run
@pytest.mark.parametrize("h,g", [(4, 4), (6, 2), pytest.param(12, 2, marks=pytest.mark.slow), (32, 2)])
def test_gqa_groups_and_split_runs(h, g):
    rng = np.random.default_rng(0)
    c = make_case(rng, bsz=1, t=80, s=80, h=h, g=g, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], g, 4, BLK)
    # chunk=8 splits every popular window's run over several programs; rows=32 tiles end inside
    # runs and, for H/G = 3 and 6, leave rows unused
    o, lse = _fwd(c, ids, chunk=8, rows=32)
    _check(c, ids, o, lse)


def test_packed_unaligned_windows_and_empty_tokens():
    rng = np.random.default_rng(1)
    c = make_case(rng, bsz=2, t=72, s=72, h=6, g=2, d=16, segments=[[21, 30, 13], [72]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, BLK)
    ids[0, :, 5:9] = -1                    # tokens with no valid slot: lse -inf, o = 0
    ids[1, 0, 40, :] = ids[1, 0, 40, 0]    # duplicates count once
    o, lse = _fwd(c, ids, chunk=16)
    _check(c, ids, o, lse)
    assert np.all(np.isneginf(lse[0, 5:9]))


def test_query_chunk_loop_equals_one_pass():
    # A row's tile (and so whether it runs the masked or the mask-free body) depends on the query
    # chunk; in interpret mode the two bodies compile separately and may round lse 1 ulp apart.
    # Repeating one call is bitwise (below).
    rng = np.random.default_rng(2)
    c = make_case(rng, bsz=1, t=50, s=130, h=4, g=2, d=16)      # queries: a suffix of the keys
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 4, BLK)
    one = _fwd(c, ids, dtype=jnp.bfloat16)
    for qc in (16, 24):                    # 50 = 3 x 16 + 2, 2 x 24 + 2: the last chunk is clamped
        looped = _fwd(c, ids, dtype=jnp.bfloat16, query_chunk=qc)
        np.testing.assert_allclose(np.asarray(looped[0], np.float32), np.asarray(one[0], np.float32),
                                   rtol=8e-3, atol=1e-6)          # one bf16 ulp
        np.testing.assert_allclose(looped[1], one[1], rtol=2e-6, atol=0)
    o, lse = _fwd(c, ids, query_chunk=16)
    _check(c, ids, o, lse)
    again = _fwd(c, ids, query_chunk=16)
    np.testing.assert_array_equal(again[0], o)


def test_worklist_sorted_runs():
    ids = jnp.asarray([[[[0, 2, -1], [2, 0, 1], [-1, -1, -1]]]], jnp.int32)    # [1,1,3,3]
    starts = ids * 16
    flat, key, run_end, n_valid = gs.worklist(ids, jnp.where(ids >= 0, starts, 0))
    assert int(n_valid[0, 0]) == 5
    np.testing.assert_array_equal(np.asarray(key[0, 0, :5]), [0, 0, 16, 32, 32])
    np.testing.assert_array_equal(np.asarray(flat[0, 0, :5]), [0, 4, 5, 1, 3])   # stable: t*K+slot
    np.testing.assert_array_equal(np.asarray(run_end[0, 0, :5]), [2, 2, 3, 5, 5])


def test_default_query_chunk_bounds_the_partials():
    qc = gs.default_query_chunk(1, 64, 128, 16, 2)
    assert qc & (qc - 1) == 0
    assert qc * 16 * 64 * (128 * 2 + 4) <= gs.PARTIALS_BUDGET < 2 * qc * 16 * 64 * (128 * 2 + 4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_keep_masks_garbage_partials_like_where(dtype):
    """``layout.keep`` (the partial sums' mask): NaN / Inf / any value of an unused slot becomes +0.0,
    a used slot keeps its value bit for bit."""
    from pallas_kernels.msa import layout
    x = jnp.asarray([[1.5, -np.nan, np.inf, -2.25], [-np.inf, 3.0, -0.0, np.nan]], dtype)
    valid = jnp.asarray([[True, False, False, True], [False, True, True, False]])
    got = np.asarray(jax.jit(layout.keep)(x, valid).astype(jnp.float32))
    want = np.asarray(jnp.where(valid, x, 0.0).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
    assert not np.signbit(got[~np.asarray(valid)]).any() and np.signbit(got[1, 2])
    col = jax.jit(layout.keep)(jnp.ones((2, 4, 3), dtype), valid[..., None])     # broadcast mask
    np.testing.assert_array_equal(np.asarray(col[..., 0], np.float32), np.asarray(valid, np.float32))
