"""GPU (Triton-lowered) decode kernels in Pallas interpret mode, against the NumPy oracle.

Selection sets and order, dense and sparse attention (o and lse, every element),
Q in {1, 2, 8, 16}, float32 / bf16 / fp8 e4m3 caches, the all-equal-scores tie case; the split
(two-stage) top-k selection equals the single-stage one exactly; sparse attention with several
selected pages per program equals one page per program; the persistent page scorer equals the chunked
one bit for bit (and the XLA reference / oracle); the scoring launch is chosen per size class of the
work from the launch table's ``score`` (``gpu_config.LaunchTable``: read-only, passed explicitly).
"""

from __future__ import annotations

import pytest

from tests.ops.paged.test_decode_oracle import check_against_oracle, check_all_equal_scores


def _jit(fn, *args, **kw):
    """``fn(*args, **kw)`` under jit, keywords static (launch options, sizes): one compile of the whole
    call instead of one per eager primitive of its wrapper."""
    import jax
    return jax.jit(lambda *a: fn(*a, **kw))(*args)


def _short_rows_ascending(ids, local, topk):
    """Reference ids ``[..., K]`` with the rows whose ``local`` page (broadcast to ``ids.shape[:-1]``) is
    ``< topk`` sorted ascending (``-1`` last): the GPU selection keeps every page of such rows, in order."""
    import numpy as np
    ids = np.asarray(ids)
    asc = np.sort(np.where(ids < 0, 1 << 30, ids), -1)
    asc = np.where(asc == 1 << 30, -1, asc)
    return np.where((np.asarray(local) < topk)[..., None], asc, ids)


def _index_keys(rng, b, nq, hi, di, page, npg, kv_dtype):
    """Random index queries ``[b, nq, hi, di]`` f32, an index-key page pool of ``b * npg + 3`` pages in
    ``kv_dtype`` (fp8 with per-page scales ``ks``, else ``ks`` None) and a shuffled page table
    ``[b, npg]`` (numpy). Returns (qi, ki, ks, table, n_phys)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax.decode.cache import quantize
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
    return qi, ki, ks, table, n_phys


@pytest.mark.parametrize("nq,kv_dtype", [(1, "float32"), (2, "float8_e4m3fn"), (8, "bfloat16"), (16, "float32")])
def test_kernels_match_oracle(nq, kv_dtype):
    check_against_oracle("pallas_gpu_interpret", nq, kv_dtype, ordered=True)


@pytest.mark.parametrize("nq", [1, 8])
def test_fp8_caches_as_byte_pairs_match_oracle(nq, monkeypatch):
    """1-byte caches of 2**31 - 2**32 elements reach the Triton kernels as uint16 byte pairs
    (``common.needs_byte_pairs``: int32 element offsets would overflow); forced here on small fp8 index-key,
    K and V caches, selection and dense / sparse attention still match the oracle."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.decode import gpu_attention, gpu_select
    paired = []                 # the 1-byte arrays the kernels were told to read as pairs

    def one_byte(x):
        paired.append(jnp.dtype(x.dtype).itemsize == 1)
        return paired[-1]
    monkeypatch.setattr(gpu_attention, "needs_byte_pairs", one_byte)
    monkeypatch.setattr(gpu_select, "needs_byte_pairs", one_byte)
    jax.clear_caches()          # jitted wrappers traced before the patch must not be reused
    try:
        check_against_oracle("pallas_gpu_interpret", nq, "float8_e4m3fn", ordered=True)
    finally:
        jax.clear_caches()
    assert sum(paired) >= 3     # the scorer's index keys and both attention calls' K / V took the pairs path


def test_all_equal_scores():
    check_all_equal_scores("pallas_gpu_interpret")


@pytest.mark.parametrize("unroll,ppp,kv_dtype,f16", [(2, 4, "bfloat16", False), (4, 8, "float8_e4m3fn", False),
                                                     (2, 4, "float8_e4m3fn", True), (4, 4, "float32", False)])
def test_unrolled_scoring_matches_reference(unroll, ppp, kv_dtype, f16):
    """Several pages per loop iteration (the tail slots clamp to the last needed page): the scores of
    every needed page and the selected sets equal the XLA reference, on a shuffled page table whose
    entries past each request's pages are out-of-range ids (never read)."""
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax.ops import paged as ops
    from pallas_kernels.decode.gpu_select import page_scores_gpu, select_pages_gpu

    rng = np.random.default_rng(0)
    b, nq, hi, di, page, npg, topk = 2, 2, 2, 32, 16, 13, 4
    qi, ki, ks, table, n_phys = _index_keys(rng, b, nq, hi, di, page, npg, kv_dtype)
    # request 1 uses 7 pages (positions up to 6 pages + 3): entries past them hold a huge id
    pos = np.array([[npg * page - 2, npg * page - 1], [6 * page + 2, 6 * page + 3]])
    table[1, 7:] = 10 ** 6
    table, pos = jnp.asarray(table, jnp.int32), jnp.asarray(pos, jnp.int32)
    got = _jit(page_scores_gpu, qi, ki, table, pos, ks, interpret=True, ppp=ppp, unroll=unroll, f16=f16)
    base = _jit(page_scores_gpu, qi, ki, table, pos, ks, interpret=True, ppp=ppp, unroll=1, f16=f16)
    ref = _jit(ops.xla.page_scores, qi, ki, ks, jnp.minimum(table, n_phys - 1))
    for r in range(b):
        n = int(pos[r].max()) // page                      # pages before the local one are scored
        np.testing.assert_allclose(np.asarray(got[r, ..., :n]), np.asarray(base[r, ..., :n]), rtol=0, atol=0)
        np.testing.assert_allclose(np.asarray(got[r, ..., :n]), np.asarray(ref[r, ..., :n]), rtol=2e-2, atol=2e-2)
    ids = _jit(select_pages_gpu, qi, ki, table, pos, ks, topk=topk, interpret=True, ppp=ppp, unroll=unroll, f16=f16)
    ids_base = _jit(select_pages_gpu, qi, ki, table, pos, ks, topk=topk, interpret=True, ppp=ppp, unroll=1, f16=f16)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_base))
    if kv_dtype == "float32":   # bf16 / fp8: the kernel's bf16 queries may reorder near-ties vs the f32 reference
        ids_ref = _jit(ops.msa_decode_select, qi, ki, jnp.minimum(table, n_phys - 1), pos, ki_scale=ks, topk=topk,
                       implementation="xla")
        np.testing.assert_array_equal(np.sort(np.asarray(ids), -1), np.sort(np.asarray(ids_ref), -1))


def test_unroll_must_divide_pages_per_program():
    import jax.numpy as jnp

    from pallas_kernels.decode.gpu_select import page_scores_gpu
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

    from minimax_jax.ops import paged as ops
    from pallas_kernels.decode.gpu_select import _select_rows

    rng = np.random.default_rng(1)
    b, rows, n_rows, width, page, topk = 2, 8, 7, 64, 16, 8     # rows >= n_rows are padding (not selected)
    raw, pos = _raw_rows_case(rng, b, rows, width, page, topk)
    pos[1, n_rows:] = -1
    kw = dict(n_rows=n_rows, page=page, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
              interpret=True)
    raw_j, pos_j = jnp.asarray(raw), jnp.asarray(pos)
    base = np.asarray(_jit(_select_rows, raw_j, pos_j, splits=1, **kw))
    ref = _jit(ops.select_from_page_scores, raw_j[:, None, :n_rows], pos_j[:, :n_rows], page_size=page, topk=topk,
               init_blocks=init_blocks, local_blocks=local_blocks)
    np.testing.assert_array_equal(base, _short_rows_ascending(np.asarray(ref)[:, 0], pos[:, :n_rows] // page, topk))
    slot = np.arange(topk)
    for r in (1, 2, 3):                                       # short rows: every page 0..local, ascending
        np.testing.assert_array_equal(base[0, r], np.where(slot <= pos[0, r] // page, slot, -1))
    for s in (2, 4, 8, 16, 64, "auto"):
        got = _jit(_select_rows, raw_j, pos_j, splits=s, **kw)
        np.testing.assert_array_equal(np.asarray(got), base, err_msg=str(s))


def test_split_select_auto_wide_rows():
    """"auto" on a row wide enough to split (W = 2048 -> S = 4 slices of 512 pages): same ids as S = 1."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.decode.gpu_select import _auto_select_splits, _select_rows

    assert _auto_select_splits(1, 2, 2048) == 4
    assert _auto_select_splits(32, 4, 16384) == 32 and _auto_select_splits(1, 4, 16384) == 32
    assert _auto_select_splits(64, 16, 16384) == 4 and _auto_select_splits(8, 4, 512) == 1
    rng = np.random.default_rng(2)
    b, rows, width, page, topk = 1, 2, 2048, 16, 16
    raw, pos = _raw_rows_case(rng, b, rows, width, page, topk, n_levels=50)
    pos[0, 1] = width * page - 5
    kw = dict(n_rows=rows, page=page, topk=topk, init_blocks=1, local_blocks=2, interpret=True)
    raw_j, pos_j = jnp.asarray(raw), jnp.asarray(pos)
    base = np.asarray(_jit(_select_rows, raw_j, pos_j, splits=1, **kw))
    np.testing.assert_array_equal(np.asarray(_jit(_select_rows, raw_j, pos_j, splits="auto", **kw)), base)


@pytest.mark.parametrize("kv_dtype,init_blocks,local_blocks", [("bfloat16", 1, 2), ("float8_e4m3fn", 0, 1),
                                                               ("float8_e4m3fn", 1, 2)])
def test_split_select_matches_single_stage(kv_dtype, init_blocks, local_blocks):
    """select_pages_gpu with select_splits S in {2, 4, 8, "auto"} equals S = 1 exactly (many pages with
    identical keys, hence tied scores; short rows; a padding row), equals the XLA selection applied to
    the kernel's own page scores (order included) and the XLA reference's sets."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax.ops import paged as ops
    from minimax_jax.decode.cache import quantize
    from pallas_kernels.decode.gpu_select import page_scores_gpu, select_pages_gpu

    rng = np.random.default_rng(3)
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
    base = np.asarray(_jit(select_pages_gpu, qi, ki, table, pos, ks, select_splits=1, **kw))
    sc = _jit(page_scores_gpu, qi, ki, table, pos, ks, interpret=True)
    want = _jit(ops.select_from_page_scores, sc, pos, page_size=page, topk=topk, init_blocks=init_blocks,
                local_blocks=local_blocks)
    local = np.where(np.asarray(pos) >= 0, np.asarray(pos) // page, -1)[:, None, :]    # [B, 1, Q]
    np.testing.assert_array_equal(base, _short_rows_ascending(want, local, topk))
    ref = _jit(ops.msa_decode_select, qi, ki, table, pos, ki_scale=ks, topk=topk, init_blocks=init_blocks,
               local_blocks=local_blocks, implementation="xla")
    np.testing.assert_array_equal(np.sort(base, -1), np.sort(np.asarray(ref), -1))
    assert (base[1, :, 1] == -1).all() and (base[0, :, 1, 4:] == -1).all()   # padding row, short row
    for s in (2, 4, 8, "auto"):
        got = _jit(select_pages_gpu, qi, ki, table, pos, ks, select_splits=s, **kw)
        np.testing.assert_array_equal(np.asarray(got), base, err_msg=str(s))


def test_split_select_config_default():
    """select_splits=None takes the table's select_splits (DEFAULT_TABLE: 4, from the sweep; an explicit
    table's own value otherwise)."""
    import dataclasses

    import numpy as np

    from pallas_kernels.decode import gpu_config, gpu_select
    from tests.ops.paged.test_decode_oracle import K, make_case

    assert gpu_config.DEFAULT_TABLE.select_splits == 4 and gpu_config.DEFAULT_TABLE.sparse_pps == 4
    c = make_case(np.random.default_rng(4), 1, kv_dtype="bfloat16", index_dtype="bfloat16")
    args = (c["qi"], c["ki"], c["table"], c["pos"], c["ki_scale"])
    base = np.asarray(gpu_select.select_pages_gpu(*args, topk=K, interpret=True, select_splits=1))
    one = dataclasses.replace(gpu_config.DEFAULT_TABLE, select_splits=1)
    np.testing.assert_array_equal(np.asarray(gpu_select.select_pages_gpu(*args, topk=K, interpret=True, table=one)),
                                  base)
    assert gpu_config.DEFAULT_TABLE.select_splits == 4


def test_config_splits_fit_narrow_score_rows():
    """The default table's select_splits (4 slices) is lowered to the padded score width when fewer pages exist (one
    page per program, two pages: W = 2); an explicit S above W still raises."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.decode import gpu_config, gpu_select
    qi = jnp.asarray(np.random.default_rng(5).normal(size=(1, 1, 2, 16)), jnp.float32)
    ki = jnp.asarray(np.random.default_rng(6).normal(size=(3, 8, 16)), jnp.float32)
    table, pos = jnp.asarray([[2, 1]], jnp.int32), jnp.full((1, 1), 15, jnp.int32)
    assert gpu_config.DEFAULT_TABLE.select_splits > 2
    got = gpu_select.select_pages_gpu(qi, ki, table, pos, topk=2, interpret=True, ppp=1)
    want = gpu_select.select_pages_gpu(qi, ki, table, pos, topk=2, interpret=True, ppp=1, select_splits=1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="exceeds the padded score width"):
        gpu_select.select_pages_gpu(qi, ki, table, pos, topk=2, interpret=True, ppp=1, select_splits=4)


def test_bad_launch_options_raise():
    import jax.numpy as jnp

    from pallas_kernels.decode.gpu_attention import paged_attention_gpu
    from pallas_kernels.decode.gpu_select import select_pages_gpu
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

    from minimax_jax.ops import paged as ops
    from pallas_kernels.decode.gpu_attention import paged_attention_gpu
    from tests.ops.paged.test_decode_oracle import make_case, oracle_select

    topk = 6
    rng = np.random.default_rng(7)
    c = make_case(rng, 2, kv_dtype=kv_dtype, index_dtype="float32")
    n = c["np"]
    ids = oracle_select(n["qi"], n["ki"], n["table"], n["pos"], topk)
    ids[0, 0, 0, 1] = -1                                       # a hole before valid slots
    ids = jnp.asarray(ids, jnp.int32)
    args = (c["q"], c["k"], c["v"], c["table"], c["pos"], c["k_scale"], c["v_scale"], ids)
    o1, l1 = _jit(paged_attention_gpu, *args, interpret=True, loop=loop, sparse_pages_per_split=1)
    o_r, l_r = _jit(ops.paged_attention, *args[:5], k_scale=c["k_scale"], v_scale=c["v_scale"], block_ids=ids,
                    implementation="xla")
    tol = 2e-5 if kv_dtype == "float32" else 2e-2
    for pps in (2, 4):
        o, lse = _jit(paged_attention_gpu, *args, interpret=True, loop=loop, sparse_pages_per_split=pps)
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o1, np.float32), atol=tol, rtol=tol)
        np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(np.asarray(l1)))
        fin = np.isfinite(np.asarray(l1))
        np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(l1)[fin], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_r, np.float32), atol=tol, rtol=tol)
        np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(l_r)[fin], atol=max(tol, 1e-5), rtol=1e-5)


# ----------------------------------------------------------------------------- persistent scoring, size classes

def _uneven_case(rng, nq, kv_dtype, b=5, hi=2, di=32, page=16, npg=13):
    """Requests of different lengths on a shuffled page table: full, 6 pages, 0 pages (position in the
    first page), 1 page, 0 pages (all rows padding); padding rows; table entries past each request's
    scored pages hold a huge id (never read). Returns (qi, ki, ks, table, pos, ref_table): ref_table
    clips those ids for the XLA reference, which gathers every page."""
    import jax.numpy as jnp
    import numpy as np

    qi, ki, ks, table, n_phys = _index_keys(rng, b, nq, hi, di, page, npg, kv_dtype)
    last = np.asarray([npg * page - 1, 6 * page + 3, 5, page + 2, -1])[:b]   # each request's last position
    pos = np.maximum(last[:, None] - np.arange(nq)[None, ::-1], 0)
    pos[last < 0] = -1
    if nq > 1:
        pos[0, 0] = -1                                                      # a padding row
    for r, n_score in enumerate(np.maximum(last, 0) // page):
        table[r, n_score:] = 10 ** 6                                        # not scored: never read
    ref_table = np.minimum(table, n_phys - 1)
    return qi, ki, ks, jnp.asarray(table, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.asarray(ref_table, jnp.int32)


@pytest.mark.parametrize("nq,kv_dtype,f16", [(1, "bfloat16", False), (2, "float8_e4m3fn", True), (8, "float32", False),
                                             (16, "float8_e4m3fn", False)])
def test_persistent_scoring_matches_chunked(nq, kv_dtype, f16):
    """The persistent scorer (1 program for everything; 5 programs over the 19 items, ranges crossing
    requests and skipping an empty one; more programs than items; each key-load eviction policy)
    writes the chunked kernel's scores bit for bit on every scored page and selects the same ids;
    scores equal the XLA reference, and with float32 keys the selected sets equal the XLA selection's.
    Requests of 0 and 1 scored pages, padding rows, unread huge page ids past each request's pages
    (``_uneven_case``)."""
    import numpy as np

    from minimax_jax.ops import paged as ops
    from pallas_kernels.decode.gpu_select import page_scores_gpu, select_pages_gpu

    rng = np.random.default_rng(8)
    qi, ki, ks, table, pos, ref_table = _uneven_case(rng, nq, kv_dtype)
    page, topk = ki.shape[1], 4
    n_score = np.clip(np.asarray(pos).max(1) // page, 0, None)
    assert sorted(set(n_score.tolist())) == [0, 1, 6, 12]
    kw = dict(interpret=True, f16=f16)
    base = np.asarray(_jit(page_scores_gpu, qi, ki, table, pos, ks, programs=0, ppp=4, **kw))
    ref = np.asarray(_jit(ops.xla.page_scores, qi, ki, ks, ref_table))
    ids_base = np.asarray(_jit(select_pages_gpu, qi, ki, table, pos, ks, topk=topk, programs=0, ppp=4, **kw))
    for programs, evict in ((1, "evict_normal"), (5, "evict_first"), (64, "evict_last")):   # 5: chunks of 4
        got = np.asarray(_jit(page_scores_gpu, qi, ki, table, pos, ks, programs=programs, evict=evict, **kw))
        for r, n in enumerate(n_score):
            np.testing.assert_array_equal(got[r, ..., :n], base[r, ..., :n], err_msg=f"{programs} {r}")
            np.testing.assert_allclose(got[r, ..., :n], ref[r, ..., :n], rtol=2e-2, atol=2e-2)
        ids = np.asarray(_jit(select_pages_gpu, qi, ki, table, pos, ks, topk=topk, programs=programs, evict=evict,
                              **kw))
        np.testing.assert_array_equal(ids, ids_base, err_msg=str(programs))
    if kv_dtype == "float32":
        ids_ref = _jit(ops.msa_decode_select, qi, ki, ref_table, pos, ki_scale=ks, topk=topk, implementation="xla")
        np.testing.assert_array_equal(np.sort(ids_base, -1), np.sort(np.asarray(ids_ref), -1))


@pytest.mark.parametrize("nq,kv_dtype", [(1, "bfloat16"), (2, "float8_e4m3fn"), (8, "float32"), (16, "bfloat16")])
def test_persistent_table_matches_oracle(nq, kv_dtype, monkeypatch):
    """A persistent launch in every size class of a launch table's ``score``: the op path
    (``implementation="pallas_gpu_interpret"``, ``launch_table=`` the table) gives the NumPy oracle's selection
    (sets and order) and attention."""
    import dataclasses

    from pallas_kernels.decode import gpu_config, gpu_select

    score = {label: {cls: dict(e, programs=3) for cls, e in by_cls.items()}
             for label, by_cls in gpu_config.DEFAULT_TABLE.score.items()}
    table = dataclasses.replace(gpu_config.DEFAULT_TABLE, score=score)
    seen = []
    real = gpu_select._select
    monkeypatch.setattr(gpu_select, "_select", lambda *a, **k: seen.append(k) or real(*a, **k))
    check_against_oracle("pallas_gpu_interpret", nq, kv_dtype, ordered=True, launch_table=table)
    assert seen and all(k["programs"] == 3 for k in seen)                    # the table reached the launch


def test_size_class_picks_the_launch(monkeypatch):
    """A launch table's ``score`` entries are chosen by the size class of B * NP (``SCORE_CLASSES``) when
    the call is traced; explicit kwargs override them key by key; ``size_class`` forces a class; a class
    missing from the table runs ``SCORE_LAUNCH_BASE``. Every class's launch gives the same scores
    (bit for bit on the scored pages) and ids."""
    import dataclasses
    import functools

    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.decode import gpu_config, gpu_select

    monkeypatch.setattr(gpu_config, "SCORE_CLASSES", (("small", 16), ("mid", 40), ("large", None)))
    launch_table = dataclasses.replace(gpu_config.DEFAULT_TABLE, score={
        "bf16": {"small": dict(programs=3, num_warps=1), "mid": dict(ppp=2, num_warps=2),
                 "large": dict(ppp=4, unroll=2, evict="evict_first")},
        "fp8": {"small": dict(ppp=4, f16=True), "large": dict(programs=5, f16=True)}})
    assert [gpu_config.score_size_class(n) for n in (None, 1, 16, 17, 40, 41, 10 ** 9)] == \
        ["small", "small", "small", "mid", "mid", "large", "large"]
    launch = functools.partial(gpu_config.score_launch, table=launch_table)
    assert launch(jnp.bfloat16, total_pages=10)["programs"] == 3
    mid = launch(jnp.bfloat16, total_pages=30)
    assert (mid["ppp"], mid["num_warps"], mid["programs"]) == (2, 2, 0)
    assert launch(jnp.bfloat16, 8, total_pages=30, programs=7)["programs"] == 7      # explicit kwargs win
    assert launch(jnp.bfloat16, 8, total_pages=30, programs=7)["ppp"] == 8
    assert launch(jnp.float8_e4m3fn, total_pages=30) == dict(gpu_config.SCORE_LAUNCH_BASE,
                                                              loop=launch_table.loop)
    assert launch(jnp.float32, size_class="large", total_pages=1)["evict"] == "evict_first"
    with pytest.raises(ValueError, match="unknown size class"):
        launch(jnp.bfloat16, size_class="huge")

    seen = []
    real = gpu_select._page_scores
    monkeypatch.setattr(gpu_select, "_page_scores", lambda *a, **k: seen.append(k) or real(*a, **k))
    rng = np.random.default_rng(9)
    qi, ki, ks, table, pos, _ = _uneven_case(rng, 2, "bfloat16")         # B * NP = 5 * 13 = 65: large
    n_score = np.clip(np.asarray(pos).max(1) // ki.shape[1], 0, None)
    got = {}
    for b, cls in ((5, None), (1, None), (2, None), (5, "small"), (5, "mid")):
        got[(b, cls)] = np.asarray(_jit(gpu_select.page_scores_gpu, qi[:b], ki, table[:b], pos[:b], ks, interpret=True,
                                        size_class=cls, table=launch_table))
    assert [k["programs"] for k in seen] == [0, 3, 0, 3, 0]                   # large, small, mid, small, mid
    assert seen[0]["unroll"] == 2 and seen[2]["ppp"] == 2 and seen[4]["ppp"] == 2
    for (b, cls), sc in got.items():
        for r in range(b):
            np.testing.assert_array_equal(sc[r, ..., :n_score[r]], got[(5, None)][r, ..., : n_score[r]])
    ids = {cls: np.asarray(_jit(gpu_select.select_pages_gpu, qi, ki, table, pos, ks, topk=4, interpret=True,
                                size_class=cls, table=launch_table))
           for cls in ("small", "mid", "large")}
    np.testing.assert_array_equal(ids["small"], ids["large"])
    np.testing.assert_array_equal(ids["mid"], ids["large"])


def test_bad_scoring_launch_raises():
    """Bad persistent / eviction options raise; the default select_splits fits a persistent launch's
    score width (next power of two of NP: 2 pages here)."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.decode.gpu_select import page_scores_gpu, select_pages_gpu
    qi, ki = jnp.zeros((1, 1, 1, 16)), jnp.zeros((4, 16, 16))
    table, pos = jnp.zeros((1, 4), jnp.int32), jnp.full((1, 1), 40, jnp.int32)
    for programs in (-1, True, 2.0):
        with pytest.raises(ValueError, match="programs must be an int"):
            page_scores_gpu(qi, ki, table, pos, interpret=True, programs=programs)
    with pytest.raises(ValueError, match="takes unroll 1"):
        select_pages_gpu(qi, ki, table, pos, topk=2, interpret=True, programs=3, unroll=2)
    with pytest.raises(ValueError, match="evict must be one of"):
        page_scores_gpu(qi, ki, table, pos, interpret=True, evict="evict_always")
    qi = jnp.asarray(np.random.default_rng(10).normal(size=(1, 1, 2, 16)), jnp.float32)
    ki = jnp.asarray(np.random.default_rng(11).normal(size=(3, 8, 16)), jnp.float32)
    table, pos = jnp.asarray([[2, 1]], jnp.int32), jnp.full((1, 1), 15, jnp.int32)
    got = select_pages_gpu(qi, ki, table, pos, topk=2, interpret=True, programs=3)
    want = select_pages_gpu(qi, ki, table, pos, topk=2, interpret=True, ppp=1, select_splits=1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_default_table_is_read_only_and_explicit_tables_reach_the_launch(monkeypatch):
    """``DEFAULT_TABLE`` (and ``SCORE_LAUNCH_BASE``) cannot be mutated at any level; a replaced table keeps
    the default intact and its values reach the launch: ``score_launch`` returns them, and the attention
    entry point passes the table's attn_warps / attn_stages / loop / sparse_pps to the kernel (the
    default table's values when ``table`` is None)."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.decode import gpu_attention, gpu_config

    d = gpu_config.DEFAULT_TABLE
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.loop = "static"
    with pytest.raises(TypeError):
        d.score["bf16"]["small"]["ppp"] = 1
    with pytest.raises(TypeError):
        d.score["bf16"]["tiny"] = {}
    with pytest.raises(TypeError):
        gpu_config.SCORE_LAUNCH_BASE["num_warps"] = 8
    score = d.to_dict()["score"]
    score["bf16"]["small"] = dict(num_warps=8, num_stages=1, ppp=2, evict="evict_first")
    t = dataclasses.replace(d, loop="static", score=score, attn_warps=8, attn_stages=3, sparse_pps=2)
    score["bf16"]["small"]["ppp"] = 64                         # the table holds its own copy
    got = gpu_config.score_launch(jnp.bfloat16, total_pages=2048, table=t)
    assert got == dict(gpu_config.SCORE_LAUNCH_BASE, num_warps=8, num_stages=1, ppp=2, evict="evict_first",
                       loop="static")
    assert gpu_config.score_launch(jnp.bfloat16, total_pages=2048) == dict(gpu_config.SCORE_LAUNCH_BASE,
                                                                           **d.score["bf16"]["small"], loop="dynamic")
    tiny = gpu_config.score_launch(jnp.bfloat16, total_pages=1024)      # "tiny": ppp None, sized to fill the GPU
    assert tiny == dict(gpu_config.SCORE_LAUNCH_BASE, **d.score["bf16"]["tiny"], loop="dynamic") and tiny["ppp"] is None
    assert d.score["bf16"]["small"]["ppp"] == 8 and d.loop == "dynamic" and t != d and hash(t) != hash(d)
    assert dataclasses.replace(d) == d and hash(dataclasses.replace(d)) == hash(d)

    seen = []
    real = gpu_attention._paged_attention
    q, kp = jnp.zeros((1, 1, 2, 16)), jnp.zeros((1, 3, 8, 16))
    pt, pos, ids = jnp.asarray([[1, 2]], jnp.int32), jnp.full((1, 1), 9, jnp.int32), jnp.asarray([[[[0, 1]]]])
    monkeypatch.setattr(gpu_attention, "_paged_attention", lambda *a, **k: seen.append(k) or real(*a, **k))
    for table in (None, t):
        o, _ = gpu_attention.paged_attention_gpu(q, kp, kp, pt, pos, block_ids=ids, interpret=True, table=table)
        assert np.all(np.isfinite(np.asarray(o)))
    pick = lambda k: (k["num_warps"], k["num_stages"], k["loop"], k["sparse_pages_per_split"])
    assert [pick(k) for k in seen] == [(4, 2, "dynamic", 4), (8, 3, "static", 2)]
