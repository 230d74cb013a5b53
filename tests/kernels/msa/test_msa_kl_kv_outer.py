"""KV-outer indexer KL (pallas_kernels/msa/gpu_kl.py) in Pallas interpret mode: the schedule's edge
cases against the XLA reference (minimax_jax.ops.msa.kl): loss, row count and the gradients wrt qi
and ki of a unit cotangent, every element.

Runs split over many programs (small ``chunk``: the d ki pieces and their merge), row tiles ending
inside runs, GQA groups of 1, 3, 6 and 16 heads, packed segments with unaligned and clamped windows,
tokens with no valid slot, duplicates, and the query-chunk loop with a clamped last chunk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import msa as msa_ops
from pallas_kernels.msa import gpu_kl as gk
from tests.kernels.msa.test_msa_kernels_oracle import make_case, positions, random_ids

BLK = 16


def _inputs(rng, c, g, di=16):
    bsz, t = c["q_pos"].shape
    qi = rng.standard_normal((bsz, t, g, di)).astype(np.float32)
    ki = rng.standard_normal((bsz, c["k"].shape[1], di)).astype(np.float32)
    return qi, ki


def _reference(c, ids, qi, ki):
    pos = positions(c)
    f = lambda qi, ki: msa_ops.indexer_kl(jnp.asarray(c["q"]), jnp.asarray(c["k"]), qi, ki,
                                          jnp.asarray(ids), block_size=BLK, implementation="xla", **pos)
    (kl, cnt), vjp = jax.vjp(f, jnp.asarray(qi), jnp.asarray(ki))
    dqi, dki = vjp((jnp.float32(1.0), np.zeros((), jax.dtypes.float0)))
    return float(kl), int(cnt), np.asarray(dqi), np.asarray(dki)


def _kernel(c, ids, qi, ki, **kw):
    pos = tuple(jnp.asarray(c[n]) for n in ("q_pos", "kv_pos", "q_seg", "kv_seg"))
    f = jax.jit(lambda q, k, qi, ki, ids: gk._run(q, k, qi, ki, ids, *pos, BLK, True, True, **kw))
    kl, cnt, dqi, dki = f(jnp.asarray(c["q"]), jnp.asarray(c["k"]), jnp.asarray(qi), jnp.asarray(ki),
                          jnp.asarray(ids))
    return float(kl), int(cnt), np.asarray(dqi), np.asarray(dki)


def _check(got, want):
    assert got[1] == want[1]
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=1e-5)
    for a, b in zip(got[2:], want[2:]):
        np.testing.assert_allclose(a, b, atol=2e-5 * max(1.0, np.abs(b).max()), rtol=1e-4)


# H/G = 1, 3, 6, 16; 6 (rows left unused in a 32-row tile, as 3 does) only in the slow run
@pytest.mark.parametrize("h,g", [(4, 4), (6, 2), pytest.param(12, 2, marks=pytest.mark.slow), (32, 2)])
def test_gqa_groups_and_runs_split_over_programs(h, g):
    rng = np.random.default_rng(0)
    c = make_case(rng, bsz=1, t=64, s=64, h=h, g=g, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], g, 4, BLK)
    qi, ki = _inputs(rng, c, g)
    _check(_kernel(c, ids, qi, ki, chunk=8, rows=32), _reference(c, ids, qi, ki))


@pytest.mark.parametrize("h,g,rows,num_warps", [(12, 2, 64, 4), (32, 2, 128, 8), (4, 4, 64, 4)])
def test_row_tilings(h, g, rows, num_warps):
    """The tilings bench/msa_kl_probe.py times beside the default: larger row tiles, other warp counts."""
    rng = np.random.default_rng(1)
    c = make_case(rng, bsz=1, t=64, s=64, h=h, g=g, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], g, 4, BLK)
    qi, ki = _inputs(rng, c, g)
    _check(_kernel(c, ids, qi, ki, chunk=8, rows=rows, num_warps=num_warps),
           _reference(c, ids, qi, ki))


def test_bad_tiling_raises_value_error():
    q = jnp.zeros((1, 32, 4, 16), jnp.bfloat16)
    k = jnp.zeros((1, 32, 2, 16), jnp.bfloat16)
    qi, ki = jnp.zeros((1, 32, 2, 16), jnp.bfloat16), jnp.zeros((1, 32, 16), jnp.bfloat16)
    ids = jnp.zeros((1, 2, 32, 2), jnp.int32)
    pos = dict(q_positions=jnp.arange(32)[None], kv_positions=jnp.arange(32)[None], block_size=16)
    for kw in (dict(rows=48), dict(rows=16), dict(num_warps=3), dict(rows=64.0), dict(rows=None), dict(num_warps=True)):
        with pytest.raises(ValueError, match="indexer_kl_gpu"):
            gk.indexer_kl_gpu(q, k, qi, ki, ids, **pos, **kw)


def test_packed_clamped_windows_empty_tokens_and_duplicates():
    rng = np.random.default_rng(2)
    c = make_case(rng, bsz=2, t=72, s=72, h=6, g=2, d=16, segments=[[21, 30, 13, 8], [72]])
    c["kv_pos"][1] += 5                     # block 0's window starts before storage index 0
    c["q_pos"] = np.ascontiguousarray(c["kv_pos"][:, -72:])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, BLK)
    ids[0, :, 5:9] = -1                     # tokens with no valid slot (not counted)
    ids[1, 0, 40, :] = ids[1, 0, 40, 0]     # duplicates count once
    qi, ki = _inputs(rng, c, 2)
    want = _reference(c, ids, qi, ki)
    _check(_kernel(c, ids, qi, ki, chunk=16), want)
    _check(_kernel(c, ids, qi, ki, chunk=4, rows=16), want)


def test_query_chunk_loop_counts_each_token_once():
    rng = np.random.default_rng(7)
    c = make_case(rng, bsz=1, t=50, s=130, h=4, g=2, d=16)   # queries: a suffix of the keys
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 4, BLK)
    qi, ki = _inputs(rng, c, 2)
    want = _reference(c, ids, qi, ki)
    one = _kernel(c, ids, qi, ki, chunk=8)
    _check(one, want)
    for qc in (16, 24):                     # the last chunk is clamped and recomputes tokens
        looped = _kernel(c, ids, qi, ki, chunk=8, query_chunk=qc)
        _check(looped, want)
        # same partials; XLA sums the slots at another shape, so possibly in another order: equal up to
        # f32 rounding of the summands (a sum that cancels can move by ulps of its largest terms, which can
        # exceed the result's max: an unseeded CI case moved 1.4e-7 at a max of 0.28)
        np.testing.assert_allclose(looped[2], one[2], rtol=1e-6, atol=2e-6 * np.abs(np.asarray(one[2])).max())


def test_bitwise_repeatable():
    rng = np.random.default_rng(3)
    c = make_case(rng, bsz=1, t=48, s=48, h=8, g=2, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 4, BLK)
    qi, ki = _inputs(rng, c, 2)
    a, b = _kernel(c, ids, qi, ki, chunk=8), _kernel(c, ids, qi, ki, chunk=8)
    assert a[0] == b[0] and a[1] == b[1]
    for x, y in zip(a[2:], b[2:]):
        np.testing.assert_array_equal(x, y)


def test_primal_only_path_and_public_function_agree():
    rng = np.random.default_rng(4)
    c = make_case(rng, bsz=1, t=40, s=40, h=8, g=2, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, BLK)
    qi, ki = _inputs(rng, c, 2)
    pos = positions(c)
    kl, cnt = jax.jit(lambda qi, ki: gk.indexer_kl_gpu(jnp.asarray(c["q"]), jnp.asarray(c["k"]), qi, ki,
                                                       jnp.asarray(ids), block_size=BLK, interpret=True,
                                                       **pos))(jnp.asarray(qi), jnp.asarray(ki))
    want = _reference(c, ids, qi, ki)
    assert int(cnt) == want[1]
    np.testing.assert_allclose(float(kl), want[0], rtol=2e-5)


def test_public_chunk_argument_and_default_rule():
    """``indexer_kl_gpu(chunk=...)`` (the tiling the probe times) gives the reference's loss and gradients;
    without it a pass takes the attention backward's rule (``default_bwd_chunk``): 512 selections per
    program at the 64K training passes, 128 at small ones."""
    rng = np.random.default_rng(3)
    c = make_case(rng, bsz=1, t=48, s=48, h=8, g=2, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, BLK)
    qi, ki = _inputs(rng, c, 2)
    pos = positions(c)
    f = lambda qi, ki: gk.indexer_kl_gpu(jnp.asarray(c["q"]), jnp.asarray(c["k"]), qi, ki, jnp.asarray(ids),
                                         block_size=BLK, interpret=True, chunk=16, **pos)
    (kl, cnt), vjp = jax.vjp(f, jnp.asarray(qi), jnp.asarray(ki))
    dqi, dki = vjp((jnp.float32(1.0), np.zeros((), jax.dtypes.float0)))
    _check((float(kl), int(cnt), np.asarray(dqi), np.asarray(dki)), _reference(c, ids, qi, ki))
    qc = gk._query_chunk(1, 16, 4, 128, 16, 128, 128)                 # the training model's 64K passes
    assert gk.default_bwd_chunk(min(65536, qc) * 16 * 4) == 512
    assert gk.default_bwd_chunk(48 * 3 * 2) == 128


def _weighted_reference(c, ids, qi, ki, w):
    pos = positions(c)
    f = lambda qi, ki: msa_ops.indexer_kl(jnp.asarray(c["q"]), jnp.asarray(c["k"]), qi, ki, jnp.asarray(ids),
                                          block_size=BLK, implementation="xla", q_weights=jnp.asarray(w), **pos)
    (kl, cnt), vjp = jax.vjp(f, jnp.asarray(qi), jnp.asarray(ki))
    dqi, dki = vjp((jnp.float32(1.0), jnp.float32(0.0)))
    return float(kl), float(cnt), np.asarray(dqi), np.asarray(dki)


@pytest.mark.parametrize("query_chunk", [None, 16])
def test_weighted_rows_equal_the_xla_reference(query_chunk):
    """``q_weights`` (prefix-tree rows: a merged query stands for several unmerged ones): KL, weighted count
    and both gradients, queries a suffix of packed keys, weights 0..3, through the query-chunk loop too."""
    rng = np.random.default_rng(5)
    c = make_case(rng, bsz=2, t=40, s=96, h=6, g=2, d=16, segments=[[30, 66], [96]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, BLK)
    ids[0, :, 3:6] = -1                                        # tokens with no valid slot (not counted)
    qi, ki = _inputs(rng, c, 2)
    w = rng.integers(0, 4, c["q_pos"].shape).astype(np.float32)
    want = _weighted_reference(c, ids, qi, ki, w)
    pos = tuple(jnp.asarray(c[n]) for n in ("q_pos", "kv_pos", "q_seg", "kv_seg"))
    got = jax.jit(lambda qi, ki, w: gk._run(jnp.asarray(c["q"]), jnp.asarray(c["k"]), qi, ki, jnp.asarray(ids),
                                            *pos, BLK, True, True, q_weights=w, chunk=8,
                                            query_chunk=query_chunk))(jnp.asarray(qi), jnp.asarray(ki), jnp.asarray(w))
    assert got[1].dtype == jnp.float32 and float(got[1]) == want[1]
    np.testing.assert_allclose(float(got[0]), want[0], rtol=2e-5, atol=1e-5)
    for a, b in zip(got[2:], want[2:]):
        np.testing.assert_allclose(np.asarray(a), b, atol=2e-5 * max(1.0, np.abs(b).max()), rtol=1e-4)
    # the public function's custom VJP scales the weighted unit gradients by the cotangent
    f = lambda qi, ki: gk.indexer_kl_gpu(jnp.asarray(c["q"]), jnp.asarray(c["k"]), qi, ki, jnp.asarray(ids),
                                         block_size=BLK, interpret=True, q_weights=jnp.asarray(w),
                                         **positions(c))[0] * 3.0
    dqi, dki = jax.jit(jax.grad(f, argnums=(0, 1)))(jnp.asarray(qi), jnp.asarray(ki))
    for a, b in zip((dqi, dki), want[2:]):
        np.testing.assert_allclose(np.asarray(a), 3.0 * b, atol=6e-5 * max(1.0, np.abs(b).max()), rtol=1e-4)
