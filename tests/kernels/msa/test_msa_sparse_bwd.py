"""KV-outer MSA backward (pallas_kernels/msa/gpu_sparse_bwd.py) in Pallas interpret mode: dq, dk, dv
against the gradient of a dense jnp oracle (every element).

Edge cases of the schedule: runs of one K/V window split over many programs (small ``chunk``: the
piece buffer and its merge kernel), row tiles ending inside runs, GQA groups of 1, 3, 6 and 16 heads,
packed segments with unaligned (and clamped) windows, tokens with no valid slot, duplicates, the
query-chunk loop with a clamped last chunk (no token counted twice in dk / dv), queries as a suffix
of the keys, and bitwise repeatability.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.msa import gpu_sparse_bwd as gb
from pallas_kernels.msa import gpu_sparse_fwd as gs
from tests.kernels.msa.test_msa_kernels_oracle import (attention_jnp, make_case, random_ids,
                                                       selected_mask, visible)

BLK = 16


def _reference(c, ids):
    vis = jnp.asarray(visible(c["q_pos"], c["kv_pos"], c["q_seg"], c["kv_seg"])[:, None]
                      & selected_mask(ids, c["kv_pos"], BLK))
    q, k, v = (jnp.asarray(c[n], jnp.float32) for n in ("q", "k", "v"))
    with jax.default_matmul_precision("highest"):
        return jax.grad(lambda q, k, v: jnp.sum(attention_jnp(q, k, v, vis) * c["do"]),
                        argnums=(0, 1, 2))(q, k, v)


def _bwd(c, ids, dtype=jnp.float32, **kw):
    q, k, v = (jnp.asarray(c[n], dtype) for n in ("q", "k", "v"))
    pos = tuple(jnp.asarray(c[n]) for n in ("q_pos", "kv_pos", "q_seg", "kv_seg"))

    @jax.jit
    def f(q, k, v, ids, do):
        o, lse = gs.sparse_fwd_kv_outer(q, k, v, ids, *pos, block_size=BLK, interpret=True)
        return gb.sparse_bwd_kv_outer(q, k, v, ids, *pos, o, lse, do, block_size=BLK,
                                      interpret=True, **kw)
    return [np.asarray(x, np.float64) for x in f(q, k, v, jnp.asarray(ids), jnp.asarray(c["do"], dtype))]


def _check(c, ids, got, atol=3e-5):
    for a, b in zip(got, _reference(c, ids)):
        np.testing.assert_allclose(a, np.asarray(b, np.float64), atol=atol, rtol=atol)


def _case(rng, **kw):
    c = make_case(rng, **kw)
    c["do"] = rng.standard_normal(c["q"].shape[:3] + (c["v"].shape[-1],)).astype(np.float32)
    return c


# H/G = 1, 3, 6, 16; 6 (rows left unused in a 32-row tile, as 3 does) only in the slow run
@pytest.mark.parametrize("h,g", [(4, 4), (6, 2), pytest.param(12, 2, marks=pytest.mark.slow), (32, 2)])
def test_gqa_groups_and_runs_split_over_programs(h, g):
    rng = np.random.default_rng(0)
    c = _case(rng, bsz=1, t=64, s=64, h=h, g=g, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], g, 4, BLK)
    _check(c, ids, _bwd(c, ids, chunk=8, rows=32))     # popular windows span several programs


def test_long_programs_of_the_default_chunk():
    """chunk = 512 (``default_bwd_chunk``'s largest): 1,280 selections per group over three programs."""
    rng = np.random.default_rng(3)
    c = _case(rng, bsz=1, t=320, s=320, h=8, g=2, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 4, BLK)
    _check(c, ids, _bwd(c, ids, chunk=512))


def test_packed_unaligned_windows_empty_tokens_and_duplicates():
    rng = np.random.default_rng(1)
    c = _case(rng, bsz=2, t=72, s=72, h=6, g=2, d=16, segments=[[21, 30, 13, 8], [72]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, BLK)
    ids[0, :, 5:9] = -1                    # tokens with no valid slot
    ids[1, 0, 40, :] = ids[1, 0, 40, 0]    # duplicates count once
    _check(c, ids, _bwd(c, ids, chunk=16))
    _check(c, ids, _bwd(c, ids, chunk=4, rows=16))


def test_clamped_windows():
    """Windows clamped at both ends of storage: keys stored from position 5 on (block 0's window
    starts before storage index 0) and a last segment whose final block starts in the last tile."""
    rng = np.random.default_rng(2)
    c = _case(rng, bsz=2, t=40, s=72, h=4, g=2, d=16, segments=[[6, 66], [72]])
    c["kv_pos"][1] += 5
    c["q_pos"] = np.ascontiguousarray(c["kv_pos"][:, -40:])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 4, BLK)
    _check(c, ids, _bwd(c, ids, chunk=8))


def test_query_chunk_loop_counts_each_token_once():
    rng = np.random.default_rng(3)
    c = _case(rng, bsz=1, t=50, s=130, h=4, g=2, d=16)        # queries: a suffix of the keys
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 4, BLK)
    one = _bwd(c, ids, chunk=8)
    _check(c, ids, one)
    for qc in (16, 24):                    # 50 = 3 x 16 + 2, 2 x 24 + 2: the last chunk is clamped
        looped = _bwd(c, ids, chunk=8, query_chunk=qc)
        _check(c, ids, looped)
        np.testing.assert_array_equal(looped[0], one[0])      # dq: the same partial sums


def test_bitwise_repeatable_bf16():
    rng = np.random.default_rng(4)
    c = _case(rng, bsz=1, t=64, s=64, h=8, g=2, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 4, BLK)
    a = _bwd(c, ids, dtype=jnp.bfloat16, chunk=8)
    b = _bwd(c, ids, dtype=jnp.bfloat16, chunk=8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a, _reference(c, ids)):
        y = np.asarray(y, np.float64)
        assert np.max(np.abs(x - y)) <= 0.05 * np.abs(y).max()


def test_chunk_budget_bounds_the_buffers():
    qc = gb.default_bwd_query_chunk(1, 64, 4, 128, 128, 16, 128, 128)
    per_token = 16 * (64 * 128 * 4 + 2 * 4 * 128 * 256 * 4 / 128)
    assert qc & (qc - 1) == 0 and qc * per_token <= gs.PARTIALS_BUDGET < 2 * qc * per_token


def test_default_chunk_keeps_enough_programs():
    """Selections per program: 512 at bench/train_step.py's 64K pass (16384 tokens x 16 slots x 4 groups),
    128 at M3 128K's 4096-token passes, 256 between; never fewer than 2,048 programs unless at 128."""
    assert gb.default_bwd_chunk(16384 * 16 * 4) == 512
    assert gb.default_bwd_chunk(4096 * 16 * 4) == 128
    assert gb.default_bwd_chunk(8192 * 16 * 4) == 256
    assert gb.default_bwd_chunk(100) == 128


def test_every_key_is_owned_by_exactly_its_own_window():
    """Ownership (what makes the dk / dv writes of concurrent programs disjoint): every stored key
    is owned by one window start only, the one its (segment, block) selections load."""
    from pallas_kernels.msa import layout
    rng = np.random.default_rng(5)
    c = _case(rng, bsz=2, t=40, s=72, h=4, g=2, d=16, segments=[[6, 21, 30, 7], [72]])
    c["kv_pos"][1] += 5
    c["q_pos"] = np.ascontiguousarray(c["kv_pos"][:, -40:])
    prep = layout.prepare(jnp.asarray(c["k"]), None, jnp.asarray(c["q_pos"]), jnp.asarray(c["kv_pos"]),
                          jnp.asarray(c["q_seg"]), jnp.asarray(c["kv_seg"]), BLK)
    kvp, kvs, sp = np.asarray(prep.kv_pos), np.asarray(prep.kv_seg), prep.s_pad
    for b in range(2):
        owners = {}
        for w in range(sp - BLK + 1):
            own = np.asarray(gb.owned(jnp.asarray(kvp[b, w:w + BLK]), jnp.asarray(kvs[b, w:w + BLK]),
                                       jnp.int32(w), BLK, sp))
            for r in np.nonzero(own)[0]:
                owners.setdefault(w + r, []).append(w)
        for x in range(sp):
            if kvs[b, x] < 0:
                assert x not in owners
                continue
            base = x - kvp[b, x]                               # one base per segment (layout.py)
            want = int(np.clip(base + (kvp[b, x] // BLK) * BLK, 0, sp - BLK))
            assert owners.get(x) == [want], (b, x, owners.get(x), want)


def test_dq_partials_in_q_dtype():
    """``dq_partial_bits=16`` (bf16 inputs): dk / dv bit for bit those of f32 partials, dq within the rounding of
    each partial (one bf16 rounding of each of the <= K terms before the f32 sum), over a chunked query loop."""
    rng = np.random.default_rng(16)
    c = _case(rng, bsz=1, t=96, s=96, h=8, g=2, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 4, BLK)
    f32 = _bwd(c, ids, jnp.bfloat16, chunk=16, query_chunk=40)
    b16 = _bwd(c, ids, jnp.bfloat16, chunk=16, query_chunk=40, dq_partial_bits=16)
    np.testing.assert_array_equal(b16[1], f32[1])
    np.testing.assert_array_equal(b16[2], f32[2])
    np.testing.assert_allclose(b16[0], f32[0], rtol=2.0 ** -6, atol=2.0 ** -7 * np.abs(f32[0]).max())
    assert not np.array_equal(b16[0], f32[0])          # the option changed something
    with pytest.raises(ValueError, match="dq_partial_bits must be 16 or 32, got 8"):
        _bwd(c, ids, jnp.bfloat16, dq_partial_bits=8)
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 1, got 0"):
        _bwd(c, ids, jnp.bfloat16, chunk=0)
    with pytest.raises(ValueError, match="query_chunk must be a positive int, got -1"):
        _bwd(c, ids, jnp.bfloat16, query_chunk=-1)
