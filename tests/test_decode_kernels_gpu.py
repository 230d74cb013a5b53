"""GPU (Triton-lowered) decode kernels in Pallas interpret mode, against the NumPy oracle.

Selection sets and order, dense and sparse attention (o and lse, every element),
Q in {1, 2, 8, 16}, float32 / bf16 / fp8 e4m3 caches, the all-equal-scores tie case; the split
(two-stage) top-k selection equals the single-stage one exactly; sparse attention with several
selected pages per program equals one page per program.
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


# ----------------------------------------------------------------------------- split top-k selection

def _raw_rows_case(rng, b, rows, width, page, topk, n_levels=4):
    """Raw scores ``[B, R, W]`` with many exact ties (integer levels), junk (huge values) at and after
    each row's local page, and positions: a padding row, a row with no complete page, short rows
    (fewer than K - 1 pages before the local one), a row at the last page, random rows."""
    import numpy as np
    raw = rng.integers(0, n_levels, (b, rows, width)).astype(np.float32)
    pos = rng.integers(0, width * page, (b, rows))
    fixed = [-1, 3, page + 1, (topk - 2) * page + page - 1, width * page - 1]
    pos[0, : len(fixed)] = fixed[:rows]
    local = np.where(pos >= 0, pos // page, -1)
    after = np.arange(width)[None, None] >= local[..., None]
    raw = np.where(after, rng.choice([1e30, -1e30, 7.0], raw.shape), raw).astype(np.float32)
    return raw, pos.astype(np.int32)


@pytest.mark.parametrize("init_blocks,local_blocks", [(0, 1), (1, 2), (2, 3)])
def test_split_select_rows_exact(init_blocks, local_blocks):
    """The two-stage (split) top-k gives exactly the single-stage ids, ties included, for every slice
    count up to one page per slice, and the XLA selection's ids (reference order)."""
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax.decode import ops
    from pallas_kernels.decode.gpu import _select_rows

    rng = np.random.default_rng()
    b, rows, n_rows, width, page, topk = 2, 8, 7, 64, 16, 8     # rows >= n_rows are padding (not selected)
    raw, pos = _raw_rows_case(rng, b, rows, width, page, topk)
    pos[1, n_rows:] = -1
    kw = dict(n_rows=n_rows, page=page, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
              interpret=True)
    raw_j, pos_j = jnp.asarray(raw), jnp.asarray(pos)
    base = np.asarray(_select_rows(raw_j, pos_j, splits=1, **kw))
    ref = ops.select_from_page_scores(raw_j[:, None, :n_rows], pos_j[:, :n_rows], page, topk=topk,
                                      init_blocks=init_blocks, local_blocks=local_blocks)
    np.testing.assert_array_equal(base, np.asarray(ref)[:, 0])
    for s in (2, 4, 8, 16, 64, "auto"):
        np.testing.assert_array_equal(np.asarray(_select_rows(raw_j, pos_j, splits=s, **kw)), base, err_msg=str(s))


def test_split_select_auto_wide_rows():
    """"auto" on a row wide enough to split (W = 2048 -> S = 4 slices of 512 pages): same ids as S = 1."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.decode.gpu import _auto_select_splits, _select_rows

    assert _auto_select_splits(1, 2, 2048) == 4
    assert _auto_select_splits(32, 4, 16384) == 32 and _auto_select_splits(1, 4, 16384) == 32
    assert _auto_select_splits(64, 16, 16384) == 4 and _auto_select_splits(8, 4, 512) == 1
    rng = np.random.default_rng()
    b, rows, width, page, topk = 1, 2, 2048, 16, 16
    raw, pos = _raw_rows_case(rng, b, rows, width, page, topk, n_levels=50)
    pos[0, 1] = width * page - 5
    kw = dict(n_rows=rows, page=page, topk=topk, init_blocks=1, local_blocks=2, interpret=True)
    raw_j, pos_j = jnp.asarray(raw), jnp.asarray(pos)
    base = np.asarray(_select_rows(raw_j, pos_j, splits=1, **kw))
    np.testing.assert_array_equal(np.asarray(_select_rows(raw_j, pos_j, splits="auto", **kw)), base)


@pytest.mark.parametrize("kv_dtype,init_blocks,local_blocks", [("bfloat16", 1, 2), ("float8_e4m3fn", 0, 1),
                                                               ("float8_e4m3fn", 1, 2)])
def test_split_select_matches_single_stage(kv_dtype, init_blocks, local_blocks):
    """select_pages_gpu with select_splits S in {2, 4, 8, "auto"} equals S = 1 exactly (many pages with
    identical keys, hence tied scores; short rows; a padding row), equals the XLA selection applied to
    the kernel's own page scores (order included) and the XLA reference's sets."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax.decode import ops
    from minimax_jax.decode.cache import quantize
    from pallas_kernels.decode.gpu import page_scores_gpu, select_pages_gpu

    rng = np.random.default_rng()
    b, nq, hi, di, page, npg, topk = 2, 2, 2, 32, 16, 40, 8
    n_phys = b * npg + 1
    keys = jax.random.split(jax.random.PRNGKey(int(rng.integers(1 << 30))), 2)
    qi = jax.random.normal(keys[0], (b, nq, hi, di), jnp.float32).astype(jnp.bfloat16)
    ki = np.array(jax.random.normal(keys[1], (n_phys, page, di), jnp.float32))
    table = rng.permutation(np.arange(1, n_phys)).reshape(b, npg)
    for bb in range(b):                                       # ties: copies of a few pages, zero pages
        src = table[bb, rng.integers(0, npg, 3)]
        for n in rng.choice(npg, 24, replace=False):
            ki[table[bb, n]] = ki[src[n % 3]] if n % 4 else 0.0
    ki = jnp.asarray(ki)
    ks = None
    if kv_dtype == "float8_e4m3fn":
        ki, ks = quantize(ki, kv_dtype)
    else:
        ki = ki.astype(kv_dtype)
    # request 0: a long row and a short one (3 pages before the local page < K - 1); request 1: a
    # mid-length row and a padding row
    pos = jnp.asarray([[npg * page - 2, 3 * page + 5], [21 * page + 7, -1]], jnp.int32)
    table = jnp.asarray(table, jnp.int32)
    kw = dict(topk=topk, init_blocks=init_blocks, local_blocks=local_blocks, interpret=True)
    base = np.asarray(select_pages_gpu(qi, ki, table, pos, ks, select_splits=1, **kw))
    sc = page_scores_gpu(qi, ki, table, pos, ks, interpret=True)
    want = ops.select_from_page_scores(sc, pos, page, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks)
    np.testing.assert_array_equal(base, np.asarray(want))
    ref = ops.msa_decode_select(qi, ki, table, pos, ki_scale=ks, topk=topk, init_blocks=init_blocks,
                                local_blocks=local_blocks, implementation="xla")
    np.testing.assert_array_equal(np.sort(base, -1), np.sort(np.asarray(ref), -1))
    assert (base[1, :, 1] == -1).all() and (base[0, :, 1, 4:] == -1).all()   # padding row, short row
    for s in (2, 4, 8, "auto"):
        got = select_pages_gpu(qi, ki, table, pos, ks, select_splits=s, **kw)
        np.testing.assert_array_equal(np.asarray(got), base, err_msg=str(s))


def test_split_select_config_default():
    """select_splits=None takes CONFIG["select_splits"] (4 by default, from the H200 sweep)."""
    import numpy as np

    from pallas_kernels.decode import gpu
    from tests.test_decode_oracle import K, make_case

    assert gpu.CONFIG["select_splits"] == 4 and gpu.CONFIG["sparse_pps"] == 4
    c = make_case(np.random.default_rng(), 1, kv_dtype="bfloat16", index_dtype="bfloat16")
    args = (c["qi"], c["ki"], c["table"], c["pos"], c["ki_scale"])
    base = np.asarray(gpu.select_pages_gpu(*args, topk=K, interpret=True, select_splits=1))
    old = gpu.CONFIG["select_splits"]
    try:
        gpu.CONFIG["select_splits"] = 1
        np.testing.assert_array_equal(np.asarray(gpu.select_pages_gpu(*args, topk=K, interpret=True)), base)
    finally:
        gpu.CONFIG["select_splits"] = old


def test_config_splits_fit_narrow_score_rows():
    """The CONFIG default (4 slices) is lowered to the padded score width when fewer pages exist (one
    page per program, two pages: W = 2); an explicit S above W still raises."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.decode import gpu
    qi = jnp.asarray(np.random.default_rng().normal(size=(1, 1, 2, 16)), jnp.float32)
    ki = jnp.asarray(np.random.default_rng().normal(size=(3, 8, 16)), jnp.float32)
    table, pos = jnp.asarray([[2, 1]], jnp.int32), jnp.full((1, 1), 15, jnp.int32)
    assert gpu.CONFIG["select_splits"] > 2
    got = gpu.select_pages_gpu(qi, ki, table, pos, topk=2, interpret=True, ppp=1)
    want = gpu.select_pages_gpu(qi, ki, table, pos, topk=2, interpret=True, ppp=1, select_splits=1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="exceeds the padded score width"):
        gpu.select_pages_gpu(qi, ki, table, pos, topk=2, interpret=True, ppp=1, select_splits=4)


def test_bad_launch_options_raise():
    import jax.numpy as jnp

    from pallas_kernels.decode.gpu import paged_attention_gpu, select_pages_gpu
    qi, ki = jnp.zeros((1, 1, 1, 16)), jnp.zeros((4, 16, 16))
    table, pos = jnp.zeros((1, 4), jnp.int32), jnp.full((1, 1), 40, jnp.int32)   # W = 4 with ppp = 4
    for s in (3, 0, -2, 6, "fast", 2.0):
        with pytest.raises(ValueError, match="select_splits must be a power of two"):
            select_pages_gpu(qi, ki, table, pos, topk=4, interpret=True, select_splits=s)
    with pytest.raises(ValueError, match="exceeds the padded score width"):
        select_pages_gpu(qi, ki, table, pos, topk=4, interpret=True, ppp=4, select_splits=8)
    q, kv = jnp.zeros((1, 1, 2, 16)), jnp.zeros((1, 4, 16, 16))
    ids = jnp.zeros((1, 1, 1, 4), jnp.int32)
    for pps in (3, 0, 6):
        with pytest.raises(ValueError, match="sparse_pages_per_split must be a power of two"):
            paged_attention_gpu(q, kv, kv, table, pos, block_ids=ids, interpret=True, sparse_pages_per_split=pps)


# ----------------------------------------------------------------------------- sparse pages per split

@pytest.mark.parametrize("kv_dtype,loop", [("float32", "dynamic"), ("bfloat16", "dynamic"), ("float32", "static")])
def test_sparse_pages_per_split(kv_dtype, loop):
    """Sparse attention with 2 and 4 selected pages per program (K = 6: the last split is padded with
    -1 slots; a row with a -1 hole before valid slots; a padding row) equals one page per program
    (o and lse) and the XLA reference."""
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax.decode import ops
    from pallas_kernels.decode.gpu import paged_attention_gpu
    from tests.test_decode_oracle import make_case, oracle_select

    topk = 6
    rng = np.random.default_rng()
    c = make_case(rng, 2, kv_dtype=kv_dtype, index_dtype="float32")
    n = c["np"]
    ids = oracle_select(n["qi"], n["ki"], n["table"], n["pos"], topk)
    ids[0, 0, 0, 1] = -1                                       # a hole before valid slots
    ids = jnp.asarray(ids, jnp.int32)
    args = (c["q"], c["k"], c["v"], c["table"], c["pos"], c["k_scale"], c["v_scale"], ids)
    o1, l1 = paged_attention_gpu(*args, interpret=True, loop=loop, sparse_pages_per_split=1)
    o_r, l_r = ops.paged_attention(*args[:5], k_scale=c["k_scale"], v_scale=c["v_scale"], block_ids=ids,
                                   implementation="xla")
    tol = 2e-5 if kv_dtype == "float32" else 2e-2
    for pps in (2, 4):
        o, lse = paged_attention_gpu(*args, interpret=True, loop=loop, sparse_pages_per_split=pps)
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o1, np.float32), atol=tol, rtol=tol)
        np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(np.asarray(l1)))
        fin = np.isfinite(np.asarray(l1))
        np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(l1)[fin], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_r, np.float32), atol=tol, rtol=tol)
        np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(l_r)[fin], atol=max(tol, 1e-5), rtol=1e-5)
