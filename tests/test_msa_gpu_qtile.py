"""Query-tiled GPU MSA attention forward (gpu_attention_qtile.py), Pallas interpret mode on CPU.

Oracles: minimax_jax.ops.msa implementation="xla" (FP32 reference), the dense fp64 oracle of
tests/test_msa_kernels_oracle.py, and the default GPU forward (same contract; the qtile forward
must match it so the shared custom VJP stays valid). Fresh random inputs every run; every element
is compared. Cases: M3-like (QT*H/G rows exact) and M2-like (H/G = 6 padded to 8 per token) head
ratios, T not a multiple of QT, packed segments whose boundaries fall inside a tile, queries as a
suffix of keys, a stored run starting at position > 0 (unaligned, clamped windows), tokens with
fewer than K valid blocks, empty slots, duplicated / out-of-range ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import msa as msa_ops
from pallas_kernels.msa import layout
from pallas_kernels.msa.gpu_attention import msa_attention_gpu
from pallas_kernels.msa.gpu_attention_qtile import (msa_attention_gpu_qtile, row_pad, tile_union,
                                                    union_counts)
from tests.test_msa_kernels_gpu import _assert_grads_close
from tests.test_msa_kernels_oracle import attention, make_case, positions, random_ids

BLK = 16

CASES = {
    # name: (make_case kwargs, topk, query_tile, kv position offset)
    # M3-like: 4 heads per group, QT=4 -> 16 rows; two packed rows, T=70 (not a multiple of 4),
    # segment boundaries 21 / 51 inside tiles, 6 empty trailing slots in row 0.
    "m3like_packed": (dict(bsz=2, t=70, s=70, h=8, g=2, d=16, segments=[[21, 30, 13], [70]]),
                      4, 4, 0),
    # M2-like: 6 heads per group (padded to 8), QT=8 -> 64 rows; queries = last 22 of 150 keys.
    "m2like_suffix": (dict(bsz=1, t=22, s=150, h=12, g=2, d=16), 5, 8, 0),
    # stored run starting at position 9: windows unaligned, block 0 clamped; QT=2, 1 head/group
    # (rows padded to 8 per token so the tile has 16 rows).
    "offset_run": (dict(bsz=1, t=37, s=150, h=2, g=2, d=16), 4, 2, 9),
}


def _case(name, rng):
    kw, topk, qt, off = CASES[name]
    c = make_case(rng, **kw)
    if off:
        c["kv_pos"] = c["kv_pos"] + off
        c["q_pos"] = c["q_pos"] + off
    ids = random_ids(rng, c["q_pos"], c["q_seg"], kw["g"], topk, BLK)
    ids[rng.random(ids.shape) < 0.2] = -1         # fewer than K valid blocks anywhere
    ids[:, 0, 3] = -1                             # a token (group 0) that selects nothing
    return c, ids, qt


def _fwd(c, ids, dtype, qt):
    pos = positions(c)
    q, k, v = (jnp.asarray(c[n], dtype) for n in ("q", "k", "v"))
    f = jax.jit(lambda q, k, v, ids: msa_attention_gpu(q, k, v, ids, block_size=BLK,
                                                         interpret=True, query_tile=qt, **pos))
    o, lse = f(q, k, v, jnp.asarray(ids))
    return np.asarray(o, np.float32), np.asarray(lse)


def _reference(c, ids, dtype):
    """FP32 reference on the inputs rounded to ``dtype``."""
    q, k, v = (jnp.asarray(c[n], dtype).astype(jnp.float32) for n in ("q", "k", "v"))
    pos = positions(c)
    o, lse = jax.jit(lambda q, k, v, ids: msa_ops.msa_attention(q, k, v, ids, block_size=BLK, implementation="xla",
                                                                **pos))(q, k, v, jnp.asarray(ids))
    return np.asarray(o), np.asarray(lse)


def _check_lse(lse, rlse, tol):
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rlse))
    fin = np.isfinite(rlse)
    assert np.max(np.abs(lse[fin] - rlse[fin]), initial=0.0) <= tol


@pytest.mark.parametrize("name", sorted(CASES))
def test_qtile_bf16_matches_reference(name):
    rng = np.random.default_rng()
    c, ids, qt = _case(name, rng)
    assert (ids < 0).any()                        # some tokens have fewer than K valid blocks
    o, lse = _fwd(c, ids, jnp.bfloat16, qt)
    ro, rlse = _reference(c, ids, jnp.bfloat16)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.all(np.abs(o - ro) <= 3e-2 + 3e-2 * np.abs(ro)), np.max(np.abs(o - ro))
    _check_lse(lse, rlse, 1e-3)


def test_qtile_fp32_matches_oracles_and_default_forward():
    """fp32: tight agreement with the reference, the fp64 oracle and the default kernel, for
    messy ids (duplicates, out-of-range and negative entries), both head ratios."""
    rng = np.random.default_rng()
    for name in ("m3like_packed", "m2like_suffix"):
        c, ids, qt = _case(name, rng)
        messy = np.concatenate([ids, ids[..., :1], np.full(ids.shape[:3] + (1,), 99, np.int32),
                                np.full(ids.shape[:3] + (1,), -7, np.int32)], axis=-1)
        o, lse = _fwd(c, messy, jnp.float32, qt)
        ro, rlse = _reference(c, ids, jnp.float32)
        np.testing.assert_allclose(o, ro, atol=2e-5, rtol=2e-5)
        _check_lse(lse, rlse, 1e-5)
        o64, l64 = attention(c["q"], c["k"], c["v"], ids, c["q_pos"], c["kv_pos"], c["q_seg"],
                             c["kv_seg"], BLK)
        np.testing.assert_allclose(o, o64, atol=2e-5, rtol=2e-5)
        od, ld = _fwd(c, ids, jnp.float32, None)          # the default forward
        np.testing.assert_allclose(o, od, atol=1e-6, rtol=1e-6)
        _check_lse(lse, ld, 1e-6)


def test_qtile_grads_equal_default_grads():
    """The qtile forward feeds the default backward: grads match the default path's and the
    reference's (bf16 inputs; the default path is the baseline, tight; reference cosine > 0.99)."""
    rng = np.random.default_rng()
    c, ids, qt = _case("m3like_packed", rng)
    pos = positions(c)
    q, k, v = (jnp.asarray(c[n], jnp.bfloat16) for n in ("q", "k", "v"))
    do = jnp.asarray(c["do"], jnp.float32)
    ids = jnp.asarray(ids)

    def grads(query_tile):
        def loss(q, k, v):
            o, _ = msa_attention_gpu(q, k, v, ids, block_size=BLK, interpret=True,
                                     query_tile=query_tile, **pos)
            return jnp.sum(o.astype(jnp.float32) * do)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    gq, gd = grads(qt), grads(None)

    def loss_r(q, k, v):
        o, _ = msa_ops.msa_attention(q, k, v, ids, block_size=BLK, implementation="xla", **pos)
        return jnp.sum(o * do)
    gr = jax.jit(jax.grad(loss_r, argnums=(0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for a, b, r in zip(gq, gd, gr):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # o differs from the default at most by bf16 rounding of the output: grads likewise
        assert np.max(np.abs(a - b)) <= 1e-2 * (np.abs(b).max() + 1e-6)
        _assert_grads_close(a, r, 0.99, 5e-2)


def _union_brute(ids, base, blk, qt):
    """numpy: per tile the sorted distinct raw starts and per start the token bit mask."""
    bsz, g, t, k = ids.shape
    out = {}
    for b in range(bsz):
        for r in range(g):
            for i0 in range(0, t, qt):
                m = {}
                for j in range(qt):
                    if i0 + j >= t:
                        continue
                    for n in ids[b, r, i0 + j]:
                        if n >= 0:
                            c = int(base[b, i0 + j] + n * blk)
                            m[c] = m.get(c, 0) | (1 << j)
                out[(b, r, i0 // qt)] = sorted(m.items())
    return out


@pytest.mark.parametrize("qt", [1, 4, 16])
def test_tile_union_matches_brute_force(qt):
    rng = np.random.default_rng()
    c = make_case(rng, bsz=2, t=53, s=80, h=2, g=2, d=16, segments=[[17, 40, 20], [5, 75]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 5, BLK)
    pos = positions(c)
    prep = layout.prepare(jnp.zeros((2, 80, 2, 16)), None, pos["q_positions"],
                          pos["kv_positions"], pos["q_segment_ids"], pos["kv_segment_ids"], BLK)
    dd = layout.dedupe_ids(jnp.asarray(ids))
    keys, bits, count = (np.asarray(x) for x in tile_union(dd, prep.base, BLK, qt))
    want = _union_brute(np.asarray(dd), np.asarray(prep.base), BLK, qt)
    assert keys.shape == (2, 2, -(-53 // qt), qt * 5)
    for (b, r, i), items in want.items():
        n = count[b, r, i]
        assert n == len(items)
        assert [(int(x), int(y)) for x, y in zip(keys[b, r, i, :n], bits[b, r, i, :n])] == items
        assert (bits[b, r, i, n:] == 0).all()
    cnt = np.asarray(union_counts(jnp.asarray(ids), block_size=BLK, query_tile=qt, **pos))
    np.testing.assert_array_equal(cnt, count)


def test_qtile_argument_errors_and_row_padding():
    with pytest.raises(ValueError, match="query_tile"):
        msa_attention_gpu_qtile(jnp.zeros((1, 4, 2, 16)), jnp.zeros((1, 8, 2, 16)),
                                jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 2, 4, 2), jnp.int32),
                                q_positions=jnp.zeros((1, 4), jnp.int32),
                                kv_positions=jnp.zeros((1, 8), jnp.int32), block_size=16,
                                query_tile=3)
    assert row_pad(16, 4) == 16 and row_pad(6, 8) == 8 and row_pad(1, 2) == 8
    assert row_pad(6, 4) * 4 == 32 and row_pad(16, 8) * 8 == 128


def test_qtile_lowers_for_cuda():
    """The query-tiled forward (and the default backward behind it) lower for CUDA on this CPU
    machine, at the M3 (QT=4: 64 rows) and M2 (QT=8: 64 rows) shapes."""
    sd = jax.ShapeDtypeStruct
    for h, g, qt in ((64, 4, 4), (48, 8, 8)):
        b, t, d = 1, 512, 128
        args = (sd((b, t, h, d), jnp.bfloat16), sd((b, t, g, d), jnp.bfloat16),
                sd((b, t, g, d), jnp.bfloat16), sd((b, g, t, 16), jnp.int32),
                sd((b, t), jnp.int32))

        def f(q, k, v, ids, pos, qt=qt):
            loss = lambda q, k, v: msa_attention_gpu(
                q, k, v, ids, q_positions=pos, kv_positions=pos, block_size=128,
                query_tile=qt)[0].astype(jnp.float32).sum()
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert txt.count("__gpu$xla.gpu.triton") >= 3
        assert f"msa_fwd_qtile{qt}_gpu" in txt
