"""Chunked calls of the TPU (Mosaic) MSA kernels in Pallas interpret mode on CPU.

A tiny SMEM table budget (tpu_common.TABLE_WORDS, monkeypatched) forces many query chunks (T not a
multiple of the chunk, chunk edges inside segments, an overlapping last chunk), many dk/dv and d ki
entry windows (tile runs cut by a window edge and resumed from the carry) and several indexer row
chunks. Results must be bitwise those of one unchunked call (same summation order) and match the
fp32 XLA reference. The race-detecting TPU interpreter runs every attention and indexer kernel
(the KL kernels: test_msa_tpu_kl.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from minimax_jax.ops import msa as msa_ops
from pallas_kernels.msa import layout, tpu_common
from pallas_kernels.msa.tpu_attention import msa_attention_tpu
from pallas_kernels.msa.tpu_indexer import msa_select_blocks_tpu
from pallas_kernels.msa.tpu_kl import indexer_kl_tpu
from tests.kernels.msa.test_msa_kernels_oracle import cosine, make_case, positions, random_ids

BLK = 8
_F0 = np.zeros((), jax.dtypes.float0)


def _attn(c, ids, interpret=True):
    """(o, lse, dq, dk, dv) of the TPU kernels (or the XLA reference when interpret is None)."""
    pos = positions(c)

    @jax.jit
    def f(q, k, v):
        def fwd(q, k, v):
            if interpret is None:
                return msa_ops.msa_attention(q, k, v, jnp.asarray(ids), block_size=BLK,
                                             implementation="xla", **pos)
            return msa_attention_tpu(q, k, v, jnp.asarray(ids), block_size=BLK,
                                     interpret=interpret, **pos)
        (o, lse), vjp = jax.vjp(fwd, q, k, v)
        return (o, lse) + vjp((jnp.asarray(c["do"]), jnp.zeros_like(lse)))
    return [np.asarray(x) for x in f(*(jnp.asarray(c[n]) for n in ("q", "k", "v")))]


def _check_attention(got, ref):
    o, lse = got[:2]
    np.testing.assert_allclose(o, ref[0], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref[1]))
    fin = np.isfinite(ref[1])
    np.testing.assert_allclose(lse[fin], ref[1][fin], atol=1e-5)
    for a, b in zip(got[2:], ref[2:]):
        assert cosine(a, b) > 0.9999
        assert np.max(np.abs(a - b)) <= 1e-4 * np.abs(b).max()


def _split_runs(ids, c, per_group, words=6):
    """Number of entry windows that begin inside a tile's run (resume from the carry)."""
    prep = layout.prepare(jnp.asarray(c["k"]), None, jnp.asarray(c["q_pos"]),
                          jnp.asarray(c["kv_pos"]), jnp.asarray(c["q_seg"]),
                          jnp.asarray(c["kv_seg"]), BLK)
    ids = layout.dedupe_ids(jnp.asarray(ids))
    starts = layout.window_starts(ids, prep.base, BLK, prep.s_pad)
    tables, n_win = tpu_common.sorted_entries(ids, starts, jnp.asarray(c["q_pos"]), prep.q_seg,
                                              BLK, prep.s_pad // BLK, per_group=per_group,
                                              words_per_entry=words)
    flags = np.asarray(tables[-1])[1:int(n_win), 0]
    return int(np.sum((flags & 1) == 0))


def test_attention_chunked_is_bitwise_unchunked_and_matches_reference(monkeypatch):
    rng = np.random.default_rng(0)
    c = make_case(rng, bsz=2, t=28, s=28, h=6, g=2, d=16, segments=[[11, 13, 2], [28]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, BLK)
    whole = _attn(c, ids)
    monkeypatch.setattr(tpu_common, "TABLE_WORDS", 162)
    assert tpu_common.query_chunk(28, 2, 3) == 5            # 28 = 5 * 5 + 3; edges inside segments
    assert tpu_common.entry_window(6) == 24
    assert _split_runs(ids, c, per_group=True) >= 2         # dk/dv runs cut by window edges
    chunked = _attn(c, ids)
    for a, b in zip(chunked, whole):
        assert a.tobytes() == b.tobytes()
    _check_attention(chunked, _attn(c, ids, interpret=None))


def _kl(c, blk, fn):
    pos = positions(c)

    @jax.jit
    def f(q, k, qi, ki):
        (kl, cnt), vjp = jax.vjp(lambda *a: fn(*a, jnp.asarray(c["ids"]), block_size=blk, **pos),
                                 q, k, qi, ki)
        return (kl, cnt) + vjp((jnp.float32(1.0), _F0))[2:]
    return [np.asarray(x) for x in f(*(jnp.asarray(c[n]) for n in ("q", "k", "qi", "ki")))]


def test_kl_chunked_is_bitwise_unchunked_and_matches_reference(monkeypatch):
    rng = np.random.default_rng(1)
    c = make_case(rng, bsz=2, t=30, s=40, h=4, g=2, d=16, segments=[[13, 27], [6, 34]])
    c["qi"] = rng.standard_normal((2, 30, 2, 16)).astype(np.float32)
    c["ki"] = rng.standard_normal((2, 40, 16)).astype(np.float32)
    c["ids"] = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, BLK)
    kern = lambda *a, **kw: indexer_kl_tpu(*a, interpret=True, **kw)  # noqa: E731
    whole = _kl(c, BLK, kern)
    monkeypatch.setattr(tpu_common, "TABLE_WORDS", 200)
    assert tpu_common.query_chunk(30, 2, 3) == 6
    assert _split_runs(c["ids"], c, per_group=False) >= 2   # d ki runs cut by window edges
    chunked = _kl(c, BLK, kern)
    for a, b in zip(chunked, whole):
        assert a.tobytes() == b.tobytes()
    ref = _kl(c, BLK, lambda *a, **kw: msa_ops.indexer_kl(*a, implementation="xla", **kw))
    assert int(chunked[1]) == int(ref[1])
    np.testing.assert_allclose(chunked[0], ref[0], rtol=1e-4)
    for a, b in zip(chunked[2:], ref[2:]):
        assert cosine(a, b) > 0.9999
        assert np.max(np.abs(a - b)) <= 1e-4 * np.abs(b).max()


def _select(c, qi, ki, interpret=True):
    kw = dict(block_size=BLK, topk=4, **positions(c))
    if interpret is None:
        return np.asarray(msa_ops.msa_select_blocks(qi, ki, implementation="xla", **kw))
    return np.asarray(jax.jit(lambda a, b: msa_select_blocks_tpu(a, b, rows=8, interpret=interpret,
                                                                 **kw))(qi, ki))


def test_indexer_row_chunks_bitwise_and_match_reference(monkeypatch):
    rng = np.random.default_rng(2)
    c = make_case(rng, bsz=2, t=38, s=38, h=2, g=2, d=8, segments=[[17, 18, 3], [38]])
    qi = rng.standard_normal((2, 38, 2, 16)).astype(np.float32)
    ki = rng.standard_normal((2, 38, 16)).astype(np.float32)
    whole = _select(c, qi, ki)
    monkeypatch.setattr(tpu_common, "TABLE_WORDS", 8)        # 3 of the 10 row tiles per call
    chunked = _select(c, qi, ki)
    assert chunked.tobytes() == whole.tobytes()
    np.testing.assert_array_equal(chunked, _select(c, qi, ki, interpret=None))


def race_states(monkeypatch):
    """The RaceDetectionState of every kernel interpreted from now on (a list filled in place)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret
    states = []

    class Recording(mosaic_interpret.RaceDetectionState):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            states.append(self)

    monkeypatch.setattr(mosaic_interpret, "RaceDetectionState", Recording)
    return states


def test_race_detection_attention_and_indexer_kernels(monkeypatch):
    """TPU-semantics interpreter, detect_races=True, on fwd, dq, dk/dv (several chunks and
    windows) and the indexer (several row chunks): no race, same values as the reference."""
    rng = np.random.default_rng(3)
    c = make_case(rng, bsz=1, t=10, s=20, h=2, g=1, d=8, segments=[[7, 13]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 1, 2, BLK)
    qi = rng.standard_normal((1, 10, 2, 16)).astype(np.float32)
    ki = rng.standard_normal((1, 20, 16)).astype(np.float32)
    ref = _attn(c, ids, interpret=None)
    ref_ids = _select(c, qi, ki, interpret=None)
    monkeypatch.setattr(tpu_common, "TABLE_WORDS", 48)     # 3-token chunks, 8-entry windows
    assert tpu_common.query_chunk(10, 1, 2) == 3 and _split_runs(ids, c, per_group=True) >= 1
    states = race_states(monkeypatch)
    params = pltpu.InterpretParams(detect_races=True)
    got = _attn(c, ids, interpret=params)
    assert len(states) >= 4 + 4 + 2                         # 4 fwd and 4 dq chunks, dk/dv windows
    _check_attention(got, ref)
    n_attn = len(states)
    np.testing.assert_array_equal(_select(c, qi, ki, interpret=params), ref_ids)
    assert len(states) > n_attn
    assert not any(s.races_found for s in states)
