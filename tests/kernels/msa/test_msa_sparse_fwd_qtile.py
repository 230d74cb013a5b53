"""The Hopper query-tiled MSA forward and the Hopper forward's choice between it and the KV-outer one
(pallas_kernels/msa/gpu_sparse_fwd_qtile.py), in the Mosaic GPU interpreter against the fp32 XLA reference.
Device timing: BENCHMARKS.md (MSA prefill, query-tiled forward)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import mosaic_interpreter_available as interpreter_available
from pallas_kernels.msa import layout
from pallas_kernels.msa.gpu_sparse_fwd_qtile import (cta_tokens, sparse_fwd_hopper, sparse_fwd_qtile, tile_tables,
                                                     use_query_tiles)
from tests.kernels.msa.test_msa_kernels_oracle import make_case, positions, random_ids
from tests.kernels.msa.test_msa_sparse_fwd_wgmma import run_and_check

needs_interpreter = pytest.mark.skipif(
    not interpreter_available(),
    reason=f"the Mosaic GPU interpreter of jax >= 0.11 is needed (jax {jax.__version__})")


def _check(c, ids, blk, fn=sparse_fwd_qtile):
    return run_and_check(c, ids, blk, fn)[0]


def test_tile_tables_union_count_and_bits():
    """Distinct starts ascending, their count, and which token of the tile selected each."""
    starts = jnp.asarray([[[[8, 0, 16], [0, 0, 24], [40, 8, 8], [0, 0, 0]]]], jnp.int32)    # [1,1,4,3]
    valid = jnp.asarray([[[[1, 1, 1], [1, 0, 1], [1, 1, 0], [0, 0, 0]]]], bool)
    u, cnt, bits = tile_tables(starts, valid, 2)
    assert cnt.tolist() == [[[4, 2]]]
    assert u[0, 0, 0, :4].tolist() == [0, 8, 16, 24] and bits[0, 0, 0, :4].tolist() == [1 | 2, 1, 1, 2]
    assert u[0, 0, 1, :2].tolist() == [8, 40] and bits[0, 0, 1, :2].tolist() == [1, 1]


@needs_interpreter
@pytest.mark.parametrize("h,g,t", [(32, 2, 192), (12, 2, 200), (16, 2, 160), (64, 1, 130)])
def test_groups_empty_and_duplicate_ids(h, g, t):
    """16 heads per group (4 tokens per warpgroup), 6 (M2-like head slots of 8: 8 tokens), 8 and 64 (one
    token per warpgroup); T not a multiple of the tile (padded tokens); tokens selecting nothing; repeated ids."""
    rng = np.random.default_rng(h + t)
    c = make_case(rng, bsz=1, t=t, s=t, h=h, g=g, d=128)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], g, 4, 64)
    ids[0, :, 100:103] = -1
    ids[0, 0, 120, 1:] = ids[0, 0, 120, 0]
    fin = _check(c, ids, 64)
    assert not fin[0, 101].any() and fin[0, 120].all()
    assert cta_tokens(h // g) == {16: 8, 6: 16, 8: 16, 64: 2}[h // g]


@needs_interpreter
def test_packed_aligned_documents_and_suffix_queries():
    """Two batch rows: packed documents of 64, 96 and 32 keys plus 8 empty slots (windows start on 8-row
    boundaries), and queries that are the last 96 of 200 keys (a cached prefix), block 64."""
    rng = np.random.default_rng(3)
    c = make_case(rng, bsz=1, t=200, s=200, h=32, g=2, d=128, segments=[[64, 96, 32]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, 64)
    fin = _check(c, ids, 64)
    assert not fin[0, 192:].any()
    c = make_case(rng, bsz=1, t=96, s=200, h=32, g=2, d=128)
    _check(c, random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, 64), 64)


@needs_interpreter
def test_block_128_and_correlated_selections():
    """Block 128 over 512 keys; neighbouring tokens share most of their blocks (small tile unions: the case
    the dispatch sends here), and the dispatcher returns the same values."""
    rng = np.random.default_rng(5)
    c = make_case(rng, bsz=1, t=512, s=512, h=32, g=2, d=128)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, 128)
    ids[:, :, 1::2] = ids[:, :, ::2]                 # odd tokens copy their even neighbour's choice
    _check(c, ids, 128)
    _check(c, ids, 128, fn=sparse_fwd_hopper)


def _choice(c, ids, blk, h, g):
    pos = positions(c)
    k = jnp.zeros((1, c["kv_pos"].shape[1], g, 8))
    prep = layout.prepare(k, k, pos["q_positions"], pos["kv_positions"], pos["q_segment_ids"],
                          pos["kv_segment_ids"], blk)
    dd = layout.dedupe_ids(jnp.asarray(ids))
    starts = layout.window_starts(dd, prep.base, blk, prep.s_pad)
    nt = cta_tokens(h // g)
    t = ids.shape[2]
    tp = -(-t // nt) * nt
    pad = lambda x, v: jnp.pad(x, ((0, 0), (0, 0), (0, tp - t), (0, 0)), constant_values=v)
    _, cnt, _ = tile_tables(pad(starts, 0), pad(dd >= 0, False), nt)
    return bool(use_query_tiles(cnt, starts, dd >= 0, dd, prep.base, blk, nt))


def test_dispatch_rule():
    """Query tiles for overlapping selections, not for independent ones (large unions) nor for windows off
    an 8-row boundary (packed documents of unaligned lengths)."""
    rng = np.random.default_rng(7)
    c = make_case(rng, bsz=1, t=4096, s=4096, h=32, g=2, d=8)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 8, 64)
    assert not _choice(c, ids, 64, 32, 2)            # independent random rows: ~5x the blocks per tile
    same = np.repeat(ids[:, :, ::8], 8, axis=2)      # every 8 tokens choose alike (causally valid: earlier rows)
    assert _choice(c, same, 64, 32, 2)
    c = make_case(rng, bsz=1, t=160, s=160, h=32, g=2, d=8, segments=[[37, 70, 43]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, 64)
    ids = np.repeat(ids[:, :, ::8], 8, axis=2)[:, :, :160]
    assert not _choice(c, ids, 64, 32, 2)            # the second document's windows start at storage 37
