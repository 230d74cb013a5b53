"""GPU (Triton-lowered) decode kernels in Pallas interpret mode, against the NumPy oracle.

Selection sets and order, dense and sparse attention (o and lse, every element),
Q in {1, 2, 8, 16}, float32 / bf16 / fp8 e4m3 caches, the all-equal-scores tie case.
"""

from __future__ import annotations

import pytest

from tests.test_decode_oracle import check_against_oracle, check_all_equal_scores


@pytest.mark.parametrize("nq,kv_dtype", [(1, "float32"), (2, "float8_e4m3fn"), (8, "bfloat16"), (16, "float32")])
def test_kernels_match_oracle(nq, kv_dtype):
    check_against_oracle("gpu_interpret", nq, kv_dtype, ordered=True)


def test_all_equal_scores():
    check_all_equal_scores("gpu_interpret")


@pytest.mark.parametrize("unroll,ppp,kv_dtype,f16", [(2, 4, "bfloat16", False), (4, 8, "float8_e4m3fn", False),
                                                     (2, 4, "float8_e4m3fn", True), (4, 4, "float32", False)])
def test_unrolled_scoring_matches_reference(unroll, ppp, kv_dtype, f16):
    """Several pages per loop iteration (the tail slots clamp to the last needed page): the scores of
    every needed page and the selected sets equal the XLA reference, on a shuffled page table whose
    entries past each request's pages are out-of-range ids (never read)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax.decode import ops
    from minimax_jax.decode.cache import quantize
    from pallas_kernels.decode.gpu import page_scores_gpu, select_pages_gpu

    rng = np.random.default_rng()
    b, nq, hi, di, page, npg, topk = 2, 2, 2, 32, 16, 13, 4
    n_phys = b * npg + 3
    keys = jax.random.split(jax.random.PRNGKey(int(rng.integers(1 << 30))), 2)
    qi = jax.random.normal(keys[0], (b, nq, hi, di), jnp.float32)
    ki = jax.random.normal(keys[1], (n_phys, page, di), jnp.float32)
    ks = None
    if kv_dtype == "float8_e4m3fn":
        ki, ks = quantize(ki, kv_dtype)
    else:
        ki = ki.astype(kv_dtype)
    table = rng.permutation(np.arange(n_phys))[: b * npg].reshape(b, npg)
    # request 1 uses 7 pages (positions up to 6 pages + 3): entries past them hold a huge id
    pos = np.array([[npg * page - 2, npg * page - 1], [6 * page + 2, 6 * page + 3]])
    table[1, 7:] = 10 ** 6
    table, pos = jnp.asarray(table, jnp.int32), jnp.asarray(pos, jnp.int32)
    got = page_scores_gpu(qi, ki, table, pos, ks, interpret=True, ppp=ppp, unroll=unroll, f16=f16)
    base = page_scores_gpu(qi, ki, table, pos, ks, interpret=True, ppp=ppp, unroll=1, f16=f16)
    ref = ops._xla_page_scores(qi, ki, ks, jnp.minimum(table, n_phys - 1))
    for r in range(b):
        n = int(pos[r].max()) // page                      # pages before the local one are scored
        np.testing.assert_allclose(np.asarray(got[r, ..., :n]), np.asarray(base[r, ..., :n]), rtol=0, atol=0)
        np.testing.assert_allclose(np.asarray(got[r, ..., :n]), np.asarray(ref[r, ..., :n]), rtol=2e-2, atol=2e-2)
    ids = select_pages_gpu(qi, ki, table, pos, ks, topk=topk, interpret=True, ppp=ppp, unroll=unroll, f16=f16)
    ids_base = select_pages_gpu(qi, ki, table, pos, ks, topk=topk, interpret=True, ppp=ppp, unroll=1, f16=f16)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_base))
    if kv_dtype == "float32":   # bf16 / fp8: the kernel's bf16 queries may reorder near-ties vs the f32 reference
        ids_ref = ops.msa_decode_select(qi, ki, jnp.minimum(table, n_phys - 1), pos, ki_scale=ks, topk=topk,
                                        implementation="xla")
        np.testing.assert_array_equal(np.sort(np.asarray(ids), -1), np.sort(np.asarray(ids_ref), -1))


def test_unroll_must_divide_pages_per_program():
    import jax.numpy as jnp

    from pallas_kernels.decode.gpu import page_scores_gpu
    qi, ki = jnp.zeros((1, 1, 1, 16)), jnp.zeros((4, 16, 16))
    table, pos = jnp.zeros((1, 4), jnp.int32), jnp.full((1, 1), 40, jnp.int32)
    with pytest.raises(ValueError, match="power of two"):
        page_scores_gpu(qi, ki, table, pos, interpret=True, unroll=3)
    with pytest.raises(ValueError, match="multiple of unroll"):
        page_scores_gpu(qi, ki, table, pos, interpret=True, ppp=6, unroll=4)
