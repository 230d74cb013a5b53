"""Indexer KL loss (minimax_jax.ops.msa.indexer_kl, MSA_SPEC.md section 4).

Checks: value and count against the NumPy oracle (sparse support and dense warm-up, packed
documents); the gradient wrt qi / ki against the closed form (p_student - p_teacher) and against
central finite differences; exactly zero gradient wrt the main-branch q / k; KL = 0 when the
student equals the teacher; chunked == unchunked; clear errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import msa_oracle as oracle
from tests.ops.msa.test_msa_reference import make_inputs, masks, oracle_masks, packed_inputs
from minimax_jax.ops import msa

BLOCK, TOPK = 8, 3


def _ids(x, chunk_size=None):
    return msa.msa_select_blocks(jnp.asarray(x["qi"]), jnp.asarray(x["ki"]), block_size=BLOCK, topk=TOPK,
                                 chunk_size=chunk_size, **masks(x))


def _kl_fn(x, ids, chunk_size=None):
    q, k = jnp.asarray(x["q"]), jnp.asarray(x["k"])

    def f(qi, ki):
        return msa.indexer_kl(q, k, qi, ki, ids, block_size=BLOCK, chunk_size=chunk_size, **masks(x))

    return f


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("layout", ["suffix", "packed"])
def test_kl_value_and_gradient_match_oracle(sparse, layout):
    rng = np.random.default_rng(2 * ["suffix", "packed"].index(layout) + int(sparse))
    if layout == "suffix":
        x = make_inputs(rng, b=2, t=20, s=60)
    else:
        x = packed_inputs(rng, [[23, 4, 30], [1, 50]], 64)
    ids = _ids(x, chunk_size=8) if sparse else None
    f = _kl_fn(x, ids, chunk_size=8)
    (kl, count), vjp = jax.vjp(f, jnp.asarray(x["qi"]), jnp.asarray(x["ki"]))
    dqi, dki = vjp((jnp.float32(1.0), np.zeros((), dtype=jax.dtypes.float0)))
    ref_kl, ref_count, ref_dqi, ref_dki = oracle.indexer_kl(
        x["q"], x["k"], x["qi"], x["ki"], None if ids is None else np.asarray(ids), *oracle_masks(x), BLOCK)
    assert count.dtype == jnp.int32 and int(count) == ref_count
    valid_q = int(np.sum(x["q_seg"] >= 0))
    assert ref_count == 2 * valid_q  # Hi * valid tokens
    assert ref_kl > 0
    np.testing.assert_allclose(float(kl), ref_kl, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dqi), ref_dqi, atol=2e-6, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(dki), ref_dki, atol=2e-6, rtol=1e-4)


def test_kl_gradient_finite_differences():
    """Directional central differences (float32, eps = 1e-2 on unit-scale inputs) match <grad, u>."""
    rng = np.random.default_rng(21)
    x = make_inputs(rng, b=1, t=16, s=48)
    ids = _ids(x)
    f = _kl_fn(x, ids)
    qi, ki = jnp.asarray(x["qi"]), jnp.asarray(x["ki"])
    g_qi, g_ki = jax.grad(lambda a, b: f(a, b)[0], argnums=(0, 1))(qi, ki)
    eps = 1e-2
    for trial in range(3):
        u_qi = jnp.asarray(rng.standard_normal(qi.shape), jnp.float32)
        u_ki = jnp.asarray(rng.standard_normal(ki.shape), jnp.float32)
        plus = float(f(qi + eps * u_qi, ki + eps * u_ki)[0])
        minus = float(f(qi - eps * u_qi, ki - eps * u_ki)[0])
        fd = (plus - minus) / (2 * eps)
        an = float(jnp.vdot(g_qi, u_qi) + jnp.vdot(g_ki, u_ki))
        assert abs(fd - an) <= 2e-3 * max(1.0, abs(an)), (trial, fd, an)


def test_kl_gradient_reaches_only_index_branch():
    """d KL / d(q, k) is exactly zero (teacher under stop_gradient); d KL / d(qi, ki) is not."""
    rng = np.random.default_rng(4)
    x = make_inputs(rng, b=1, t=12, s=40)
    ids = _ids(x)

    def loss(q, k, qi, ki):
        return msa.indexer_kl(q, k, qi, ki, ids, block_size=BLOCK, **masks(x))[0]

    args = [jnp.asarray(x[key]) for key in ("q", "k", "qi", "ki")]
    gq, gk, gqi, gki = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    assert np.all(np.asarray(gq) == 0) and np.all(np.asarray(gk) == 0)
    assert np.abs(np.asarray(gqi)).max() > 1e-4 and np.abs(np.asarray(gki)).max() > 1e-4


def test_kl_zero_when_student_equals_teacher():
    """G = 1, one head, qi = q and ki = k: student == teacher, so KL and its gradient vanish."""
    rng = np.random.default_rng(8)
    x = make_inputs(rng, b=1, t=10, s=30, g=1, rep=1, d=8, di=8)
    q, k = jnp.asarray(x["q"]), jnp.asarray(x["k"])
    ids = msa.msa_select_blocks(q, k[:, :, 0], block_size=BLOCK, topk=TOPK, **masks(x))
    for block_ids in (ids, None):
        def loss(qi, ki):
            return msa.indexer_kl(q, k, qi, ki, block_ids, block_size=BLOCK, **masks(x))[0]

        val, (gqi, gki) = jax.value_and_grad(loss, argnums=(0, 1))(q, k[:, :, 0])
        assert abs(float(val)) < 1e-5
        assert np.abs(np.asarray(gqi)).max() < 1e-5 and np.abs(np.asarray(gki)).max() < 1e-5


def test_kl_chunking_invariant_and_sparse_differs_from_dense():
    rng = np.random.default_rng(12)
    x = make_inputs(rng, b=2, t=30, s=70)
    ids = _ids(x)
    a = _kl_fn(x, ids, chunk_size=7)(jnp.asarray(x["qi"]), jnp.asarray(x["ki"]))
    b = _kl_fn(x, ids, chunk_size=256)(jnp.asarray(x["qi"]), jnp.asarray(x["ki"]))
    np.testing.assert_allclose(float(a[0]), float(b[0]), rtol=1e-5)
    assert int(a[1]) == int(b[1]) == 2 * 2 * 30
    dense = _kl_fn(x, None, chunk_size=7)(jnp.asarray(x["qi"]), jnp.asarray(x["ki"]))
    assert int(dense[1]) == int(a[1]) and abs(float(dense[0]) - float(a[0])) > 1e-3


def test_kl_bad_inputs():
    x = make_inputs(np.random.default_rng(0), b=1, t=4, s=20)
    q, k, qi, ki = (jnp.asarray(x[key]) for key in ("q", "k", "qi", "ki"))
    ids = _ids(x)
    with pytest.raises(ValueError, match="block_size is required"):
        msa.indexer_kl(q, k, qi, ki, ids, **masks(x))
    with pytest.raises(ValueError, match="must equal kv heads"):
        msa.indexer_kl(q, k, qi[:, :, :1], ki, None, **masks(x))
    with pytest.raises(ValueError, match="block_ids must have shape"):
        msa.indexer_kl(q, k, qi, ki, ids[:, :, :2], block_size=BLOCK, **masks(x))
    with pytest.raises(ValueError, match="must match q/k"):
        msa.indexer_kl(q, k, qi[:, :2], ki, None, **masks(x))


@pytest.mark.slow
def test_kl_and_attention_backward_memory_is_o_chunk_times_s():
    """Reverse mode keeps O(chunk * S) temporaries (chunk bodies are rematerialised): 4x more queries
    at fixed chunk size add far less than one logits row per query would. ~30 s of compiles on 2 cores."""
    from minimax_jax.ops.msa import kl, reference as ref

    sd = jax.ShapeDtypeStruct
    s, chunk = 2048, 128
    temps = []
    for t in (512, 2048):
        q, k = sd((1, t, 4, 16), jnp.float32), sd((1, s, 2, 16), jnp.float32)
        qi, ki = sd((1, t, 2, 16), jnp.float32), sd((1, s, 16), jnp.float32)
        ids, qp, kp = sd((1, 2, t, 16), jnp.int32), sd((1, t), jnp.int32), sd((1, s), jnp.int32)

        def f_kl(q_, k_, a, b, i_, p1, p2):
            return kl.indexer_kl(q_, k_, a, b, i_, p1, p2, p1, p2, block_size=128, chunk_size=chunk)[0]

        def f_att(q_, k_, v_, i_, p1, p2):
            return jnp.sum(ref.attention(q_, k_, v_, i_, p1, p2, p1, p2, block_size=128, chunk_size=chunk)[0])

        m_kl = jax.jit(jax.grad(f_kl, argnums=(2, 3))).lower(q, k, qi, ki, ids, qp, kp).compile()
        m_att = jax.jit(jax.grad(f_att, argnums=(0, 1, 2))).lower(q, k, k, ids, qp, kp).compile()
        temps.append([m.memory_analysis().temp_size_in_bytes for m in (m_kl, m_att)])
    per_query_row = 4 * s * 4  # bytes of one float32 row of logits for the 4 heads: O(T * S) growth
    for n in range(2):
        assert temps[1][n] - temps[0][n] < 0.05 * (2048 - 512) * per_query_row, temps
