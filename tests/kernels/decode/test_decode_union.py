"""The page-union kernel of shared sparse decode tiles (``pallas_kernels.decode.gpu_union``), in Pallas
interpret mode: both algorithms equal to ``common.union_pages`` (itself checked against a Python union in
``test_decode_tiles_gpu.py``) with repeats, empty slots, K not a power of two, partial row blocks, more
splits than pages and a full union; its padding; its work items equal to ``schedule_items``'; the
attention's output with either union; the op's report."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import paged
from minimax_jax.ops.registry import clear_implementation_report, implementation_report
from pallas_kernels.decode.common import union_pages
from pallas_kernels.decode.gpu_attention import paged_attention_gpu, union_choice
from pallas_kernels.decode.gpu_config import DEFAULT_TABLE, LaunchTable
from pallas_kernels.decode.gpu_attention_wgmma import schedule_items
from pallas_kernels.decode.gpu_union import (BITMAP_MAX, MAX_SLOTS, default_warps, supports_union_kernel,
                                             union_algorithm, union_pages_gpu)


@pytest.mark.parametrize("nq,qpb,nsplit,k", [(1, 1, 1, 6), (5, 2, 3, 6), (6, 2, 4, 5), (1, 1, 16, 16),
                                             (3, 1, 2, 16), (7, 4, 3, 4), (4, 1, 8, 12)])
def test_union_kernel_equals_union_pages(nq, qpb, nsplit, k):
    rng = np.random.default_rng(nq * 1000 + qpb * 100 + nsplit * 10 + k)
    b, g = 2, 3
    ids = rng.integers(-1, 3 * k, (b, g, nq, k)).astype(np.int32)      # repeats across and inside rows, -1 slots
    want = [np.asarray(x) for x in union_pages(jnp.asarray(ids), qpb, nsplit)]
    got = [np.asarray(x) for x in union_pages_gpu(jnp.asarray(ids), qpb, nsplit, interpret=True)]
    u = qpb * k
    nblk = -(-nq // qpb)
    assert got[0].shape[:3] == got[2].shape[:3] == (b, g, nblk)
    np.testing.assert_array_equal(got[0][..., :u], want[0])
    np.testing.assert_array_equal(got[1][..., :u], want[1])
    np.testing.assert_array_equal(got[2][..., : nsplit + 1], want[2])
    assert (got[0][..., u:] == -1).all() and (got[1][..., u:] == 0).all()      # padding slots
    assert (got[2][..., nsplit + 1:] == want[2][..., -1:]).all()                # padding starts: the count


@pytest.mark.parametrize("nq,qpb,nsplit,k,n_pages", [(8, 8, 4, 16, 40), (8, 8, 16, 16, 128), (8, 8, 1, 16, 80),
                                                     (5, 2, 3, 6, 20), (7, 4, 7, 5, 3), (3, 3, 5, 4, 9),
                                                     (16, 8, 8, 16, 100), (2, 2, 4, 16, 1)])
def test_bitmap_union_equals_union_pages(nq, qpb, nsplit, k, n_pages):
    """The "bitmap" algorithm (MTP verification rows over small page tables) gives ``union_pages``' ids,
    bits and starts, whatever the split count (more splits than pages too)."""
    rng = np.random.default_rng(nq * 1000 + nsplit * 10 + n_pages)
    b, g = 2, 2
    ids = rng.integers(-1, n_pages, (b, g, nq, k)).astype(np.int32)
    want = [np.asarray(x) for x in union_pages(jnp.asarray(ids), qpb, nsplit)]
    got = [np.asarray(x) for x in union_pages_gpu(jnp.asarray(ids), qpb, nsplit, n_pages, interpret=True,
                                                  algorithm="bitmap")]
    u = qpb * k
    np.testing.assert_array_equal(got[0][..., :u], want[0])
    np.testing.assert_array_equal(got[1][..., :u], want[1])
    np.testing.assert_array_equal(got[2][..., : nsplit + 1], want[2])
    assert (got[0][..., u:] == -1).all() and (got[1][..., u:] == 0).all()
    assert (got[2][..., nsplit + 1:] == want[2][..., -1:]).all()


def test_bitmap_union_of_every_slot():
    """Every slot of the row block taken (8 rows x 16 distinct pages of a 128-page table): no slot is left
    for the padding writes, and the union is still exact."""
    ids = np.random.default_rng(3).permutation(128).reshape(1, 1, 8, 16).astype(np.int32)
    want = [np.asarray(x) for x in union_pages(jnp.asarray(ids), 8, 4)]
    got = [np.asarray(x) for x in union_pages_gpu(jnp.asarray(ids), 8, 4, 128, interpret=True)]
    assert union_algorithm(8, 16, 128) == "bitmap"
    for w, x in zip(want, got):
        np.testing.assert_array_equal(x[..., : w.shape[-1]], w)
    assert sorted(got[0][0, 0, 0]) == list(range(128))


@pytest.mark.parametrize("algorithm,nq,qpb,nsplit,k,n_pages", [("bitmap", 8, 8, 4, 16, 32),
                                                              ("bitmap", 5, 2, 3, 6, 20),
                                                              ("pairwise", 1, 1, 4, 16, 40),
                                                              ("pairwise", 5, 2, 3, 6, 20)])
def test_union_work_items_equal_schedule_items(algorithm, nq, qpb, nsplit, k, n_pages):
    """With the tile rows' positions the kernel also writes the wgmma kernel's work items: the same
    (first slot, slots, slots seen whole) as ``schedule_items`` builds from the union in XLA."""
    rng = np.random.default_rng(nq + nsplit)
    b, g, page, m = 3, 2, 16, 32
    ids = rng.integers(-1, n_pages, (b, g, nq, k)).astype(np.int32)
    nblk = -(-nq // qpb)
    pos = rng.integers(-1, n_pages * page, (b, nblk, m)).astype(np.int32)
    pos[0, 0, :] = -1                                                  # a block of padding rows only
    uid, _, starts = union_pages(jnp.asarray(ids), qpb, nsplit)
    meta, _ = schedule_items(starts, jnp.asarray(pos.min(-1)), g=g, pps=0, nsplit=nsplit, ctas=3, page=page, ids=uid)
    got = union_pages_gpu(jnp.asarray(ids), qpb, nsplit, n_pages, jnp.asarray(pos), page, interpret=True,
                          algorithm=algorithm)
    assert len(got) == 4 and got[3].shape == (b, g, nblk, nsplit, 3)
    np.testing.assert_array_equal(np.asarray(got[3]).reshape(-1, 3), np.asarray(meta))
    with pytest.raises(ValueError, match="need page"):
        union_pages_gpu(jnp.asarray(ids), qpb, nsplit, n_pages, jnp.asarray(pos), interpret=True)


def test_union_kernel_bounds():
    assert union_algorithm(1, 16) == "pairwise" and union_algorithm(2, 6) == "pairwise"
    assert union_algorithm(4, 4) == "pairwise" and union_algorithm(8, 16) is None   # no page bound: no bitmap
    assert union_algorithm(8, 16, 128) == "bitmap" and union_algorithm(8, 16, 129) is None   # 128 x 256 > max
    assert union_algorithm(2, 16, 512) == "bitmap" and union_algorithm(1, 16, 10 ** 6) == "pairwise"
    assert union_algorithm(32, 4, 8) is None and union_algorithm(1, 0, 8) is None
    assert 128 * 128 == BITMAP_MAX and supports_union_kernel(8, 16, n_pages=40)
    assert next(q for q in range(1, 40) if not supports_union_kernel(q, 16)) * 16 > MAX_SLOTS
    assert default_warps("pairwise", 16, None) == 4 and default_warps("bitmap", 128, 40) == 8
    assert default_warps("bitmap", 16, 64) == 4 and default_warps("bitmap", 128, 128) == 16
    with pytest.raises(ValueError, match="qpb=8"):
        union_pages_gpu(jnp.zeros((1, 1, 8, 16), jnp.int32), 8, 4)          # no page bound
    with pytest.raises(ValueError, match="n_pages=200"):
        union_pages_gpu(jnp.zeros((1, 1, 8, 16), jnp.int32), 8, 4, 200)     # table too wide for the bitmap
    xla_union = dataclasses.replace(DEFAULT_TABLE, union="xla")
    assert union_choice(1, 64, 4, 16, 40) == "kernel (pairwise)"             # M3: 16 heads / group
    assert union_choice(8, 64, 4, 16, 40) == "kernel (bitmap)" and union_choice(8, 64, 4, 16, 200) == "xla"
    assert union_choice(1, 64, 4, 16, 40, table=xla_union) == "xla"
    assert union_choice(1, 64, 4, 16, 40, table=dataclasses.replace(DEFAULT_TABLE, sparse_tile="per_row")) is None
    with pytest.raises(ValueError, match="union must be one of"):
        LaunchTable(union="bitmap")


@pytest.mark.parametrize("nq,tile_rows", [(1, 16), (3, 16), (8, 16), (8, 32), (3, 64)])
def test_attention_is_equal_with_either_union(nq, tile_rows):
    """Shared sparse tiles give bit-equal o / lse whichever construction made their page union (pairwise
    kernel at 4 candidates a block, bitmap kernel at 32 / 12, XLA), and the op records which one ran."""
    rng = np.random.default_rng(nq)
    b, g, hg, d, page, npg, k = 2, 2, 4, 16, 16, 12, 4
    n_phys = b * npg + 1
    q = jnp.asarray(rng.standard_normal((b, nq, g * hg, d)), jnp.float32)
    kp = jnp.asarray(rng.standard_normal((g, n_phys, page, d)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((g, n_phys, page, d)), jnp.float32)
    pt = jnp.asarray(rng.permutation(np.arange(1, n_phys))[: b * npg].reshape(b, npg), jnp.int32)
    pos = jnp.asarray(np.array([[100 + i for i in range(nq)], [150 + i for i in range(nq)]]), jnp.int32)
    ids = np.stack([np.stack([np.stack([rng.choice(pos[bb, i] // page, k - 1, replace=False).tolist()
                                        + [int(pos[bb, i]) // page] for i in range(nq)]) for _ in range(g)])
                    for bb in range(b)]).astype(np.int32)
    outs = {}
    for union in ("kernel", "xla"):
        table = dataclasses.replace(DEFAULT_TABLE, union=union, tile_rows=tile_rows)
        clear_implementation_report()
        outs[union] = paged.paged_attention(q, kp, vp, pt, pos, block_ids=jnp.asarray(ids),
                                            implementation="pallas_gpu_interpret", launch_table=table)
        ran = implementation_report()["paged_attention.union"]
        assert ran == union_choice(nq, g * hg, g, k, npg, table=table) and ran.split(" ")[0] == union
        if union == "kernel":
            assert ran == ("kernel (pairwise)" if min(nq, tile_rows // hg) * k <= MAX_SLOTS else "kernel (bitmap)")
        direct = paged_attention_gpu(q, kp, vp, pt, pos, block_ids=jnp.asarray(ids), interpret=True, table=table)
        np.testing.assert_array_equal(np.asarray(direct[0]), np.asarray(outs[union][0]))
    for a, c in zip(outs["kernel"], outs["xla"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    ref = paged.paged_attention(q, kp, vp, pt, pos, block_ids=jnp.asarray(ids), implementation="xla")
    np.testing.assert_allclose(np.asarray(outs["kernel"][0]), np.asarray(ref[0]), atol=2e-5, rtol=2e-5)


def test_row_blocks_stop_at_31_rows():
    """One q head per kv group and 64-row tiles: 32 query rows would fill a block, but a page's row mask is
    an int32 word, so blocks take 31 rows (and the last one row); the result is the XLA reference's."""
    from pallas_kernels.decode.common import MAX_BLOCK_ROWS, row_block
    assert row_block(32, 1, True, 16, 64) == (MAX_BLOCK_ROWS, 32) and row_block(8, 16, True, 16, 128) == (8, 128)
    rng = np.random.default_rng(9)
    b, nq, g, d, page, npg = 1, 32, 2, 16, 16, 6
    n_phys = b * npg + 1
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    pos = jnp.arange(60, 60 + nq, dtype=jnp.int32)[None]
    ids = np.stack([np.zeros(nq, np.int32), np.asarray(pos[0]) // page], -1)[None, None].repeat(g, 1)
    q, kp, vp = f(b, nq, g, d), f(g, n_phys, page, d), f(g, n_phys, page, d)
    pt = jnp.arange(1, n_phys, dtype=jnp.int32)[None]
    table = dataclasses.replace(DEFAULT_TABLE, tile_rows=64)
    got = paged.paged_attention(q, kp, vp, pt, pos, block_ids=jnp.asarray(ids), implementation="pallas_gpu_interpret",
                                launch_table=table)
    ref = paged.paged_attention(q, kp, vp, pt, pos, block_ids=jnp.asarray(ids), implementation="xla")
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), atol=2e-5, rtol=2e-5)
