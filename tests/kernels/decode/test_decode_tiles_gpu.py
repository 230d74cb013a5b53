"""GPU decode attention tilings and per-row short-circuits (Pallas interpret mode), against the oracles.

Shared tiles (all Q rows of a kv group in one tile; sparse mode walks the union of the rows' pages),
several row blocks per request (``tile_rows`` below Q x H/G), and the per-row legacy tiling: dense and
sparse o / lse vs the NumPy oracle for Q in {1, 2, 8, 16}; ``union_pages`` vs a Python union; a request
whose rows all select every page is not scored.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode.common import union_pages
from pallas_kernels.decode.gpu_attention import paged_attention_gpu
from pallas_kernels.decode.gpu_config import DEFAULT_TABLE, LEGACY_TILES, LaunchTable, score_launch
from pallas_kernels.decode.gpu_select import _page_scores_raw
from tests.ops.paged.test_decode_oracle import check_against_oracle

NARROW = dataclasses.replace(DEFAULT_TABLE, tile_rows=16)      # 4 query rows of 4 heads per row block
TABLES = {"shared": DEFAULT_TABLE, "legacy": LEGACY_TILES, "narrow": NARROW}


@pytest.mark.parametrize("nq,kv_dtype,tiles", [(1, "float32", "shared"), (2, "bfloat16", "narrow"),
                                               (8, "float32", "shared"), (8, "float8_e4m3fn", "narrow"),
                                               (16, "float32", "narrow"), (16, "bfloat16", "shared"),
                                               (8, "float32", "legacy"),
                                               # Q not a power of two: positions padded in-kernel, a partial row block
                                               (5, "bfloat16", "narrow"), (3, "float32", "shared")])
def test_tilings_match_oracle(nq, kv_dtype, tiles):
    check_against_oracle("pallas_gpu_interpret", nq, kv_dtype, launch_table=TABLES[tiles])


def _python_union(ids, qpb, nsplit):
    """Per row block: (pages ordered by (page % nsplit, page), who selected each, split starts)."""
    b, g, nq, k = ids.shape
    out = []
    for bb in range(b):
        for gg in range(g):
            for r in range(-(-nq // qpb)):
                rows = range(r * qpb, min(nq, (r + 1) * qpb))
                seen = sorted({int(p) for q in rows for p in ids[bb, gg, q] if p >= 0}, key=lambda p: (p % nsplit, p))
                bits = [sum(1 << (q - r * qpb) for q in rows if p in ids[bb, gg, q]) for p in seen]
                starts = np.concatenate([[0], np.cumsum([sum(p % nsplit == s for p in seen) for s in range(nsplit)])])
                out.append((seen, bits, starts.tolist()))
    return out


@pytest.mark.parametrize("n_pages", [None, 19])
@pytest.mark.parametrize("nq,qpb,nsplit", [(1, 1, 1), (5, 2, 3), (8, 8, 4), (16, 4, 1), (8, 8, 16)])
def test_union_pages(nq, qpb, nsplit, n_pages):
    """Both constructions (pairwise, and the per-page bitmap that ``n_pages`` = 19 selects for U = qpb K >= 19)
    against a Python union."""
    rng = np.random.default_rng(0)
    b, g, k = 2, 3, 6
    ids = rng.integers(-1, 19, (b, g, nq, k)).astype(np.int32)         # repeats and -1 slots
    got = jax.jit(union_pages, static_argnums=(1, 2, 3))(jnp.asarray(ids), qpb, nsplit, n_pages)
    got_ids, got_bits, got_starts = (np.asarray(x) for x in got)
    nblk = -(-nq // qpb)
    assert got_ids.shape == got_bits.shape == (b, g, nblk, qpb * k) and got_starts.shape == (b, g, nblk, nsplit + 1)
    flat = zip(got_ids.reshape(-1, qpb * k), got_bits.reshape(-1, qpb * k), got_starts.reshape(-1, nsplit + 1))
    for (seen, bits, starts), (gi, gb, gs) in zip(_python_union(ids, qpb, nsplit), flat):
        n = len(seen)
        assert gs.tolist() == starts
        assert gi[:n].tolist() == seen and (gi[n:] == -1).all()
        assert gb[:n].tolist() == bits and (gb[n:] == 0).all()


def test_union_pages_picks_the_bitmap_where_cheaper():
    """The bitmap construction runs (no [U, U] comparison in the program) for 8 rows x top-16 over 80 pages,
    the pairwise one for one row over 8,192 pages and for 8 rows over 200 pages (> U = 128)."""
    def hlo(qpb, k, n_pages):
        ids = jnp.zeros((1, 1, qpb, k), jnp.int32)
        return jax.jit(union_pages, static_argnums=(1, 2, 3)).lower(ids, qpb, 4, n_pages).as_text()
    bitmap, pairwise = hlo(8, 16, 80), hlo(8, 16, None)
    assert "x80xi32>" in bitmap and "128x128x" not in bitmap           # [.., 80] words, no [.., U, U]
    assert "128x128x" in pairwise
    assert "x8192x" not in hlo(1, 16, 8192) and "128x128x" in hlo(8, 16, 200)


def test_requests_that_keep_every_page_are_not_scored():
    """With ``topk``, a request whose rows all have local page < topk writes no score (interpret mode
    fills unwritten outputs with NaN); the other request's needed pages are scored either way."""
    b, nq, hi, di, page, npg, topk = 2, 2, 2, 16, 16, 12, 4
    rng = np.random.default_rng(1)
    qi = jnp.asarray(rng.standard_normal((b, nq, hi, di)), jnp.float32)
    ki = jnp.asarray(rng.standard_normal((b * npg, page, di)), jnp.float32)
    pt = jnp.asarray(rng.permutation(b * npg).reshape(b, npg), jnp.int32)
    pos = jnp.asarray([[3 * page, 3 * page + 1], [10 * page, 10 * page + 1]], jnp.int32)
    launch = score_launch(ki.dtype, total_pages=b * npg)
    run = lambda t: np.asarray(jax.jit(lambda *a: _page_scores_raw(*a, None, interpret=True, topk=t, **launch))(
        qi, ki, pt, pos))
    every, skip = run(None), run(topk)
    assert np.isfinite(every[0, : nq * hi, :3]).all()                   # scored without topk
    assert np.isnan(skip[0]).all()                                      # never written with topk
    np.testing.assert_array_equal(skip[1, : nq * hi, :10], every[1, : nq * hi, :10])


def test_bad_tilings_raise():
    with pytest.raises(ValueError, match="sparse_tile"):
        LaunchTable(sparse_tile="rows")
    with pytest.raises(ValueError, match="tile_rows"):
        LaunchTable(tile_rows=48)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_shared_tile_row_rounds_alike_alone_and_among_other_rows(kv_dtype):
    """Issue 34: a row of a shared sparse tile must give bitwise the same o / lse whether it is decoded alone
    (row 0, the other rows padding, as in plain decoding with padded decode rows) or at row j among other
    rows with other selections (a speculative verify step): its pages meet the same splits in the same order."""
    b, nq, h, g, d, page, npg, k = 1, 8, 8, 2, 32, 8, 24, 5
    rng = np.random.default_rng(7)
    cdt = jnp.dtype(kv_dtype)
    q = jnp.asarray(rng.standard_normal((b, nq, h, d)), jnp.float32).astype(cdt)
    kp = jnp.asarray(rng.standard_normal((g, b * npg, page, d)), jnp.float32).astype(cdt)
    vp = jnp.asarray(rng.standard_normal((g, b * npg, page, d)), jnp.float32).astype(cdt)
    pt = jnp.asarray(rng.permutation(b * npg).reshape(b, npg), jnp.int32)
    pos = np.arange(150, 150 + nq, dtype=np.int32)[None]                     # rows cross a page boundary
    ids = np.full((b, g, nq, k), -1, np.int32)
    for gg in range(g):
        for j in range(nq):
            local = pos[0, j] // page
            ids[0, gg, j] = np.concatenate([rng.choice(local, k - 1, replace=False), [local]])
    run = jax.jit(lambda q, pos, ids: paged_attention_gpu(q, kp, vp, pt, pos, block_ids=ids, interpret=True))
    o_all, lse_all = (np.asarray(x) for x in run(q, jnp.asarray(pos), jnp.asarray(ids)))
    for j in range(nq):
        q1 = jnp.zeros_like(q).at[:, 0].set(q[:, j])
        pos1 = np.full_like(pos, -1)
        pos1[:, 0] = pos[:, j]
        ids1 = np.full_like(ids, -1)
        ids1[:, :, 0] = ids[:, :, j]
        o1, lse1 = (np.asarray(x) for x in run(q1, jnp.asarray(pos1), jnp.asarray(ids1)))
        np.testing.assert_array_equal(o1[:, 0], o_all[:, j], err_msg=f"row {j}: o")
        np.testing.assert_array_equal(lse1[:, 0], lse_all[:, j], err_msg=f"row {j}: lse")
