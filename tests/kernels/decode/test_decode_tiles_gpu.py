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
from pallas_kernels.decode.gpu_config import DEFAULT_TABLE, LEGACY_TILES, LaunchTable, score_launch
from pallas_kernels.decode.gpu_select import _page_scores_raw
from tests.ops.paged.test_decode_oracle import check_against_oracle

NARROW = dataclasses.replace(DEFAULT_TABLE, tile_rows=16)      # 4 query rows of 4 heads per row block
TABLES = {"shared": DEFAULT_TABLE, "legacy": LEGACY_TILES, "narrow": NARROW}


@pytest.mark.parametrize("nq,kv_dtype,tiles", [(1, "float32", "shared"), (2, "bfloat16", "narrow"),
                                               (8, "float32", "shared"), (8, "float8_e4m3fn", "narrow"),
                                               (16, "float32", "narrow"), (16, "bfloat16", "shared"),
                                               (8, "float32", "legacy")])
def test_tilings_match_oracle(nq, kv_dtype, tiles):
    check_against_oracle("pallas_gpu_interpret", nq, kv_dtype, launch_table=TABLES[tiles])


def _python_union(ids, qpb):
    b, g, nq, k = ids.shape
    out = []
    for bb in range(b):
        for gg in range(g):
            for r in range(-(-nq // qpb)):
                rows = range(r * qpb, min(nq, (r + 1) * qpb))
                seen = []
                for q in rows:
                    for p in ids[bb, gg, q]:
                        if p >= 0 and int(p) not in seen:
                            seen.append(int(p))
                bits = [sum(1 << (q - r * qpb) for q in rows if p in ids[bb, gg, q]) for p in seen]
                out.append((seen, bits))
    return out


@pytest.mark.parametrize("nq,qpb", [(1, 1), (5, 2), (8, 8), (16, 4)])
def test_union_pages(nq, qpb):
    rng = np.random.default_rng()
    b, g, k = 2, 3, 6
    ids = rng.integers(-1, 9, (b, g, nq, k)).astype(np.int32)          # repeats and -1 slots
    got_ids, got_bits, got_n = (np.asarray(x) for x in jax.jit(union_pages, static_argnums=1)(jnp.asarray(ids), qpb))
    nblk = -(-nq // qpb)
    assert got_ids.shape == got_bits.shape == (b, g, nblk, qpb * k)
    flat_ids, flat_bits = got_ids.reshape(-1, qpb * k), got_bits.reshape(-1, qpb * k)
    for (seen, bits), gi, gb, gn in zip(_python_union(ids, qpb), flat_ids, flat_bits, got_n.reshape(-1)):
        n = len(seen)
        assert gn == n
        assert gi[:n].tolist() == seen and (gi[n:] == -1).all()
        assert gb[:n].tolist() == bits and (gb[n:] == 0).all()


def test_requests_that_keep_every_page_are_not_scored():
    """With ``topk``, a request whose rows all have local page < topk writes no score (interpret mode
    fills unwritten outputs with NaN); the other request's needed pages are scored either way."""
    b, nq, hi, di, page, npg, topk = 2, 2, 2, 16, 16, 12, 4
    rng = np.random.default_rng()
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
