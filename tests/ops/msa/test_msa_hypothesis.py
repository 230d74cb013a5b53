"""Property test: the chunked MSA reference equals the full-materialisation one (tests/msa_naive.py).

Hypothesis draws, per case, one of a few tiny static configurations (shapes, block size, top-k,
sink / local blocks, chunk size: few configurations keep XLA compiles bounded) and fresh random
content: key layouts (packed documents of random lengths with positions restarting, empty slots),
query rows taken anywhere among the keys (suffix, packed, decode-like, padding queries), values
that are gaussian or small integers (exact score ties), and random block ids (with duplicates and
-1) for the attention. Every element of every output is compared.
"""

from __future__ import annotations

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import msa_naive as naive
from minimax_jax.ops import msa

# (B, T, S, G, R, D, Di, block_size, topk, init_blocks, local_blocks, chunk_size)
CONFIGS = [
    (2, 10, 24, 2, 2, 4, 4, 3, 3, 0, 1, 4),
    (1, 7, 19, 1, 3, 4, 4, 2, 4, 1, 2, 3),
    (2, 5, 6, 2, 1, 4, 4, 4, 1, 0, 1, 2),
]


@functools.lru_cache(maxsize=None)
def _naive_fns(block_size, topk, init_blocks, local_blocks):
    return dict(
        scores=jax.jit(functools.partial(naive.index_scores, block_size=block_size)),
        select=jax.jit(functools.partial(naive.select_blocks, block_size=block_size, topk=topk,
                                         init_blocks=init_blocks, local_blocks=local_blocks)),
        attention=jax.jit(functools.partial(naive.attention, block_size=block_size)),
        kl=jax.jit(functools.partial(naive.indexer_kl, block_size=block_size)),
    )


@functools.lru_cache(maxsize=None)
def _chunked_fns(block_size, topk, init_blocks, local_blocks, chunk_size):
    """The chunked reference (minimax_jax.ops.msa, XLA) under jit, per static configuration."""
    kw = dict(block_size=block_size, chunk_size=chunk_size)

    def m(qp, kp, qs, ks):
        return dict(q_positions=qp, kv_positions=kp, q_segment_ids=qs, kv_segment_ids=ks)
    return dict(
        scores=jax.jit(lambda qi, ki, *mm: msa.msa_index_scores(qi, ki, **kw, **m(*mm))),
        select=jax.jit(lambda qi, ki, *mm: msa.msa_select_blocks(
            qi, ki, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks, **kw, **m(*mm))),
        attention=jax.jit(lambda q, k, v, ids, *mm: msa.msa_attention(q, k, v, ids, **kw, **m(*mm))),
        kl=jax.jit(lambda q, k, qi, ki, ids, *mm: msa.indexer_kl(q, k, qi, ki, ids, **kw, **m(*mm))),
    )


@st.composite
def cases(draw):
    cfg = draw(st.sampled_from(CONFIGS))
    b, t, s, g, r, d, di, block, topk, init, local, chunk = cfg
    seed = draw(st.integers(0, 2**32 - 1))
    integer_values = draw(st.booleans())
    kv_pos = np.zeros((b, s), np.int32)
    kv_seg = np.full((b, s), -1, np.int32)
    q_pos = np.zeros((b, t), np.int32)
    q_seg = np.zeros((b, t), np.int32)
    for row in range(b):
        used = draw(st.integers(1, s))
        lens = draw(st.lists(st.integers(1, used), min_size=1, max_size=4))
        start = 0
        for n, ln in enumerate(lens):
            ln = min(ln, used - start)
            if ln <= 0:
                break
            kv_pos[row, start:start + ln] = np.arange(ln)
            kv_seg[row, start:start + ln] = n
            start += ln
        if start < used:  # the rest of the used slots form a last document
            kv_pos[row, start:used] = np.arange(used - start)
            kv_seg[row, start:used] = len(lens)
        mode = draw(st.sampled_from(["suffix", "anywhere"]))
        if mode == "suffix" and used >= t:
            slots = np.arange(used - t, used)
        else:
            slots = np.asarray(draw(st.lists(st.integers(0, s - 1), min_size=t, max_size=t)))
        q_pos[row] = kv_pos[row, slots]
        q_seg[row] = kv_seg[row, slots]  # an empty slot gives a padding query (segment -1)
    nb = -(-s // block)
    block_ids = draw(hnp.arrays(np.int32, (b, g, t, max(topk, 2)), elements=st.integers(-1, nb - 1)))
    return cfg, seed, integer_values, kv_pos, kv_seg, q_pos, q_seg, block_ids


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_chunked_reference_equals_naive(case):
    cfg, seed, integer_values, kv_pos, kv_seg, q_pos, q_seg, rand_ids = case
    b, t, s, g, r, d, di, block, topk, init, local, chunk = cfg
    rng = np.random.default_rng(seed)

    def draw(*shape):
        if integer_values:
            return jnp.asarray(rng.integers(-1, 2, shape), jnp.float32)
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    q, k, v = draw(b, t, g * r, d), draw(b, s, g, d), draw(b, s, g, d)
    qi, ki = draw(b, t, g, di), draw(b, s, di)
    nv = _naive_fns(block, topk, init, local)
    ch = _chunked_fns(block, topk, init, local, chunk)
    m = (jnp.asarray(q_pos), jnp.asarray(kv_pos), jnp.asarray(q_seg), jnp.asarray(kv_seg))

    scores = np.asarray(ch["scores"](qi, ki, *m))
    want_scores = np.asarray(nv["scores"](qi, ki, *m))
    assert np.array_equal(np.isneginf(scores), np.isneginf(want_scores))
    np.testing.assert_allclose(scores[np.isfinite(scores)], want_scores[np.isfinite(want_scores)],
                               rtol=1e-6, atol=1e-6)

    ids = ch["select"](qi, ki, *m)
    want_ids = nv["select"](qi, ki, *m)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))

    for block_ids in (ids, jnp.asarray(rand_ids)):
        o, lse = ch["attention"](q, k, v, block_ids, *m)
        want_o, want_lse = nv["attention"](q, k, v, block_ids, *m)
        np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-5, atol=1e-6)
        lse, want_lse = np.asarray(lse), np.asarray(want_lse)
        assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
        np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-5, atol=1e-6)

    for block_ids in (ids, None):
        kl, count = ch["kl"](q, k, qi, ki, block_ids, *m)
        want_kl, want_count = nv["kl"](q, k, qi, ki, block_ids, *m)
        assert int(count) == int(want_count)
        np.testing.assert_allclose(float(kl), float(want_kl), rtol=1e-5, atol=1e-5)
