"""The Hopper (Mosaic GPU) paged decode kernel (pallas_kernels/decode/gpu_attention_wgmma.py), reached
through ``paged_attention_gpu`` with ``LaunchTable(tile_kernel="wgmma")``: dense and shared sparse tiles.

In the Mosaic GPU interpreter (jax >= 0.11; skipped with the reason on older jax): o and lse against the
fp32 XLA reference op (``implementation="xla"`` on the same bf16 inputs), every element, for 64- and
128-row tiles (Q = 4 and 8 rows of 16 heads per group), ragged contexts, a padding row, a request of
padding rows only, shuffled page tables, several splits; the rows of a shorter step equal (bitwise) the same
rows inside a longer one (pages past a row's position are exact no-ops); shared sparse (MSA) tiles
with random block ids; unsupported tiles take the Triton kernel. On a Hopper GPU (``-k hopper``): the
same checks at M3 shapes (64 q / 4 kv heads of 128, 128-token pages).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import paged as ops
from minimax_jax.ops import registry
from pallas_kernels.common import gpu_compute_capability, mosaic_interpreter_available
from pallas_kernels.decode import gpu_attention
from pallas_kernels.decode.gpu_attention import paged_attention_gpu, tile_kernel_choice
from pallas_kernels.decode.common import union_pages
from pallas_kernels.decode.gpu_attention_wgmma import paged_decode_wgmma, schedule_items, wgmma_decode_reason
from pallas_kernels.decode.gpu_config import DEFAULT_TABLE, LaunchTable

WGMMA = dataclasses.replace(DEFAULT_TABLE, tile_kernel="wgmma")
needs_interpreter = pytest.mark.skipif(
    not mosaic_interpreter_available(),
    reason=f"the Mosaic GPU interpreter of jax >= 0.11 is needed (jax {jax.__version__})")
hopper = pytest.mark.skipif((gpu_compute_capability() or "").split(".")[0] != "9", reason="needs a Hopper GPU")


def _case(rng, nq, contexts, h=32, g=2, d=128, page=64, npg=6):
    """Row i of request b at position ``contexts[b] - nq + i``; ``None`` = padding rows only."""
    b = len(contexts)
    p = b * npg + 1
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    pos = [[-1] * nq if c is None else [c - nq + i for i in range(nq)] for c in contexts]
    return dict(q=f(b, nq, h, d), k=f(g, p, page, d), v=f(g, p, page, d),
                table=jnp.asarray(rng.permutation(np.arange(1, p)).reshape(b, npg), jnp.int32),
                pos=jnp.asarray(pos, jnp.int32))


def _selection(rng, pos, g, topk, page):
    """Random MSA block ids [B, G, Q, topk]: each row's local page and topk - 1 earlier ones (all when
    fewer), -1 padded; padding rows select nothing."""
    b, nq = pos.shape
    ids = np.full((b, g, nq, topk), -1, np.int32)
    for bb in range(b):
        for gg in range(g):
            for i in range(nq):
                p = int(pos[bb, i])
                if p < 0:
                    continue
                local = p // page
                pick = rng.permutation(local)[: topk - 1] if local else np.zeros(0, int)
                ids[bb, gg, i, : len(pick) + 1] = np.concatenate([pick, [local]])
    return jnp.asarray(ids)


def _run(c, interpret, pages_per_split, table=WGMMA):
    return jax.jit(lambda q, k, v, t, p, ids: paged_attention_gpu(
        q, k, v, t, p, block_ids=ids, interpret=interpret, pages_per_split=pages_per_split, table=table))(
        c["q"], c["k"], c["v"], c["table"], c["pos"], c.get("ids"))


def _check(c, o, lse):
    f32 = lambda x: x.astype(jnp.float32)
    ro, rl = ops.paged_attention(f32(c["q"]), f32(c["k"]), f32(c["v"]), c["table"], c["pos"], implementation="xla",
                                 block_ids=c.get("ids"))
    o, lse, ro, rl = (np.asarray(x, np.float64) for x in (o, lse, ro, rl))
    assert np.all(np.isfinite(o))
    # bf16 P and bf16 split partials: a few bf16 ulps of |o| <= max |v|
    np.testing.assert_allclose(o, ro, atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(rl))
    fin = np.isfinite(rl)
    np.testing.assert_allclose(lse[fin], rl[fin], atol=1e-4, rtol=1e-5)
    assert np.all(o[np.broadcast_to(~fin[..., None], o.shape)] == 0.0)


def _row_independence(c, interpret, pps):
    """The first 4 rows of every request, decoded as a 4-row step (64-row tiles), equal the same rows of
    the 8-row step (128-row tiles, more pages walked) bitwise."""
    o8, l8 = _run(c, interpret, pps)
    short = dict(c, q=c["q"][:, :4], pos=c["pos"][:, :4])
    o4, l4 = _run(short, interpret, pps)
    np.testing.assert_array_equal(np.asarray(o4), np.asarray(o8)[:, :4])
    np.testing.assert_array_equal(np.asarray(l4), np.asarray(l8)[:, :4])


@needs_interpreter
@pytest.mark.parametrize("nq", [4, 8])
def test_matches_reference_in_the_interpreter(nq, monkeypatch):
    """16 heads per group: Q = 4 fills a 64-row tile, Q = 8 a 128-row tile (two compute warpgroups);
    contexts 300 (5 pages), 384 (exactly 6), 70 with its last row a padding row, and padding only. The
    wgmma kernel is what ran (a spy on it)."""
    ran = []
    monkeypatch.setattr(gpu_attention, "paged_decode_wgmma",
                        lambda *a, **kw: ran.append(a[0].shape) or paged_decode_wgmma(*a, **kw))
    gpu_attention._paged_attention.clear_cache()
    rng = np.random.default_rng(0)
    c = _case(rng, nq, [300, 384, 70, None])
    c["pos"] = c["pos"].at[2, -1].set(-1)
    o, lse = _run(c, True, 2)
    _check(c, o, lse)
    assert ran and ran[0][3] == 16 * nq                      # [B, G, R, M, D]: M = Q x 16 heads


@needs_interpreter
def test_rows_independent_of_the_step_in_the_interpreter():
    _row_independence(_case(np.random.default_rng(1), 8, [300, 200, 129]), True, 2)


@needs_interpreter
def test_pingpong_changes_no_bit_in_the_interpreter():
    """128-row tiles with and without the warpgroups' turns on the tensor cores: the same bits (the turns
    only reorder the two warpgroups' work); requests whose later splits are empty between non-empty ones."""
    c = _case(np.random.default_rng(2), 8, [300, 200, 129, None, 64])
    o1, l1 = _run(c, True, 2)
    o0, l0 = _run(c, True, 2, table=dataclasses.replace(WGMMA, wgmma_pingpong=False))
    _check(c, o1, l1)
    np.testing.assert_array_equal(np.asarray(o0), np.asarray(o1))
    np.testing.assert_array_equal(np.asarray(l0), np.asarray(l1))


@needs_interpreter
@pytest.mark.parametrize("shared", [False, True], ids=["dense", "shared"])
def test_one_item_per_cta_changes_no_bit_in_the_interpreter(shared, monkeypatch):
    """With at least as many CTAs as work items each CTA runs its own item (no balanced ranges are built or
    read): the same bits as the balanced launch of 4 CTAs."""
    from pallas_kernels.decode import gpu_attention_wgmma
    rng = np.random.default_rng(8)
    c = _case(rng, 8, [300, 200, 129, None, 64])
    if shared:
        c["ids"] = _selection(rng, np.asarray(c["pos"]), 2, 3, 64)
    o4, l4 = _run(c, True, 2)
    monkeypatch.setattr(gpu_attention_wgmma, "default_ctas", lambda interpret=False: 10 ** 4)
    gpu_attention._paged_attention.clear_cache()
    o, lse = _run(c, True, 2)
    gpu_attention._paged_attention.clear_cache()
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o4))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(l4))


@needs_interpreter
@pytest.mark.parametrize("nq,contexts", [(4, [300, 384, 70, None]), (8, [300, 384, 70, None]), (8, [300])],
                         ids=["q4", "q8", "q8_one_request"])
def test_shared_sparse_tiles_match_reference_in_the_interpreter(nq, contexts):
    """MSA block ids (top-3 of up to 6 pages per row, the local page always): the tile walks the union of
    its rows' pages, each row only its own; a padding row and a request of padding rows; splits sized to the
    CTAs of the launch (4 when interpreted): one split per row block with four requests, two with one (the
    page interleaving over splits and the split index of the work items)."""
    from pallas_kernels.decode.gpu_attention import _shared_splits
    rng = np.random.default_rng(3)
    c = _case(rng, nq, contexts)
    c["pos"] = c["pos"].at[len(contexts) // 2, -1].set(-1)
    c["ids"] = _selection(rng, np.asarray(c["pos"]), 2, 3, 64)
    assert _shared_splits(3, 4, len(contexts) * 2, 4) == (2 if len(contexts) == 1 else 1)
    _check(c, *_run(c, True, None, table=WGMMA))


def test_shared_splits_fill_or_fit_the_ctas():
    """Shared tiles' splits: the Triton tiles double ceil(K / pps) up to K while under 528 programs; the wgmma
    kernel only while each split keeps a CTA of its own (M3 decode: K = 16, pps 4, 4 kv groups, one row block
    per request)."""
    from pallas_kernels.decode.gpu_attention import _shared_splits
    assert [_shared_splits(16, 4, 4 * b) for b in (1, 8, 32, 128)] == [16, 16, 8, 4]
    assert [_shared_splits(16, 4, 4 * b, 132) for b in (1, 8, 32, 128)] == [16, 4, 4, 4]
    assert _shared_splits(16, 4, 4 * 2, 132) == 16 and _shared_splits(16, 4, 4 * 4, 132) == 8
    assert _shared_splits(3, 4, 8, 4) == 1 and _shared_splits(3, 4, 8) == 2


def test_reason_and_table():
    assert wgmma_decode_reason(128, 128, jnp.bfloat16, jnp.bfloat16, 128, False) is None
    assert wgmma_decode_reason(64, 64, jnp.float16, jnp.float16, 64, False) is None
    assert "rows per tile" in wgmma_decode_reason(16, 128, jnp.bfloat16, jnp.bfloat16, 128, False)
    assert "fp8" in wgmma_decode_reason(128, 128, jnp.float8_e4m3fn, jnp.bfloat16, 128, True)
    assert "equal bf16" in wgmma_decode_reason(128, 128, jnp.float32, jnp.float32, 128, False)
    assert "shared memory" in wgmma_decode_reason(128, 128, jnp.bfloat16, jnp.bfloat16, 128, False, stages=3)
    with pytest.raises(ValueError, match="tile_kernel"):
        LaunchTable(tile_kernel="cuda")
    with pytest.raises(ValueError, match="wgmma_stages"):
        LaunchTable(wgmma_stages=0)
    with pytest.raises(ValueError, match="wgmma_pingpong"):
        LaunchTable(wgmma_pingpong=1)


@pytest.mark.parametrize("ctas", [1, 3, 7, 200])
def test_schedule_items_dense(ctas):
    """Every item once, in order, CTA ranges balanced within one item (no ranges with a CTA per item); n and
    n_free by brute force."""
    rng = np.random.default_rng(4)
    b, g, nr, nsplit, pps, page = 5, 3, 2, 4, 3, 16
    lim = rng.integers(0, nsplit * pps + 1, b)
    minpos = rng.integers(-1, lim[:, None] * page + 1, (b, nr))
    meta, bounds = schedule_items(jnp.asarray(lim, jnp.int32), jnp.asarray(minpos, jnp.int32), g=g, pps=pps,
                                  nsplit=nsplit, ctas=ctas, page=page)
    assert (bounds is None) == (ctas >= b * g * nr * nsplit)
    meta = np.asarray(meta).reshape(b, g, nr, nsplit, 3)
    for bb, gg, r, s in np.ndindex(b, g, nr, nsplit):
        j0, n, n_free = meta[bb, gg, r, s]
        pages = [p for p in range(s * pps, (s + 1) * pps) if p < lim[bb]]
        assert (j0, n) == (s * pps, len(pages))
        assert n_free == sum((p + 1) * page - 1 <= minpos[bb, r] for p in pages)
    if bounds is not None:
        _check_bounds(np.asarray(bounds), meta.reshape(-1, 3), ctas)


def test_schedule_items_balance_past_int32_products():
    """ctas x total weight past 2^31 (16M pages over 132 CTAs): the bounds still split the weight evenly."""
    nsplit = pps = 4096
    meta, bounds = schedule_items(jnp.asarray([nsplit * pps], jnp.int32), jnp.asarray([[0]], jnp.int32), g=1,
                                  pps=pps, nsplit=nsplit, ctas=132, page=64)
    _check_bounds(np.asarray(bounds), np.asarray(meta), 132)


def _check_bounds(bounds, meta, ctas):
    assert bounds[0] == 0 and bounds[-1] == len(meta) and len(bounds) == ctas + 1
    assert np.all(np.diff(bounds) >= 0)
    w = meta[:, 1] + 1
    share = [w[lo:hi].sum() for lo, hi in zip(bounds[:-1], bounds[1:])]
    assert max(share) <= w.sum() / ctas + w.max()
    assert min(share) >= w.sum() / ctas - w.max()


def test_schedule_items_shared():
    """Shared tiles: n per split from the union's starts; n_free = the split's slots whose page every row
    of the block sees whole."""
    rng = np.random.default_rng(5)
    b, g, nq, k, page, nsplit, qpb = 3, 2, 8, 4, 16, 4, 8
    ids = np.sort(rng.choice(12, (b, g, nq, k)), axis=-1).astype(np.int32)
    uid, bits, starts = union_pages(jnp.asarray(ids), qpb, nsplit)
    minpos = rng.integers(-1, 12 * page, (b, 1))
    meta, bounds = schedule_items(starts, jnp.asarray(minpos, jnp.int32), g=g, pps=0, nsplit=nsplit, ctas=5,
                                  page=page, ids=uid)
    meta, uid, starts = np.asarray(meta).reshape(b, g, 1, nsplit, 3), np.asarray(uid), np.asarray(starts)
    for bb, gg, s in np.ndindex(b, g, nsplit):
        lo, hi = starts[bb, gg, 0, s], starts[bb, gg, 0, s + 1]
        pages = uid[bb, gg, 0, lo:hi]
        assert tuple(meta[bb, gg, 0, s]) == (lo, hi - lo, sum((p + 1) * page - 1 <= minpos[bb, 0] for p in pages))
    _check_bounds(np.asarray(bounds), meta.reshape(-1, 3), 5)


@pytest.mark.parametrize("shared", [False, True], ids=["dense", "shared"])
def test_schedule_items_lowers_without_a_while_loop(shared):
    """The work list is plain XLA without a ``while`` op: a GPU runs an XLA while loop with a host round trip
    per iteration, which stalled every Q > 1 decode step behind it (the CTA bounds' binary search was
    ``jnp.searchsorted``'s scan; now ``pallas_kernels.common.searchsorted``, unrolled)."""
    b, g, nq, k, page, nsplit = 8, 4, 8, 16, 128, 16
    minpos = jax.ShapeDtypeStruct((b, 1), jnp.int32)
    if shared:
        ids = jax.ShapeDtypeStruct((b, g, 1, nq * k), jnp.int32)
        starts = jax.ShapeDtypeStruct((b, g, 1, nsplit + 1), jnp.int32)
        f = lambda st, mp, u: schedule_items(st, mp, g=g, pps=0, nsplit=nsplit, ctas=132, page=page, ids=u)
        text = jax.jit(f).lower(starts, minpos, ids).as_text()
    else:
        f = lambda lim, mp: schedule_items(lim, mp, g=g, pps=4, nsplit=nsplit, ctas=132, page=page)
        text = jax.jit(f).lower(jax.ShapeDtypeStruct((b,), jnp.int32), minpos).as_text()
    assert "stablehlo.while" not in text and "stablehlo.case" not in text
    assert "stablehlo.custom_call" not in text


def test_tile_kernel_choice():
    """M3 shapes (64 q / 4 kv heads of 128, 128-token pages): which kernel a table sends the tiles to."""
    bf = jnp.bfloat16
    choice = lambda nq, table, sparse=False, dtype=bf, scale=False: tile_kernel_choice(
        nq, 64, 4, 128, dtype, bf, 128, has_scale=scale, sparse=sparse, table=table)
    assert choice(8, dataclasses.replace(DEFAULT_TABLE, tile_kernel="triton")) == "triton"
    assert choice(8, WGMMA) == "wgmma" and choice(4, WGMMA) == "wgmma" and choice(8, WGMMA, sparse=True) == "wgmma"
    assert choice(1, WGMMA) == "triton (wgmma refused: 16 rows per tile: need 64 or 128)"
    assert "fp8" in choice(8, WGMMA, dtype=jnp.float8_e4m3fn, scale=True)
    per_row = dataclasses.replace(WGMMA, sparse_tile="per_row")
    assert choice(8, per_row, sparse=True) == "triton (wgmma refused: per-row sparse tiles)"
    assert choice(8, per_row) == "wgmma"                     # dense tiles are shared whatever sparse_tile says


def test_auto_tile_kernel_is_wgmma_on_hopper_only(monkeypatch):
    """The default table's tile_kernel "auto": wgmma tiles on a Hopper GPU (compiled), Triton elsewhere."""
    from pallas_kernels.decode import gpu_attention as ga
    bf = jnp.bfloat16
    assert DEFAULT_TABLE.tile_kernel == "auto"
    choice = lambda nq, interpret=False: tile_kernel_choice(nq, 64, 4, 128, bf, bf, 128, has_scale=False,
                                                            sparse=True, interpret=interpret)
    for cc, want in ((None, "triton"), ("8.0", "triton"), ("10.0", "triton"), ("9.0", "wgmma")):
        monkeypatch.setattr(ga, "gpu_compute_capability", lambda cc=cc: cc)
        assert choice(8) == want, cc
        assert ga.resolve_tile_kernel("auto", False) == want
        assert choice(8, interpret=True) == "triton"
        assert ga.resolve_tile_kernel("triton", False) == "triton"
    assert choice(1) == "triton (wgmma refused: 16 rows per tile: need 64 or 128)"     # on "9.0"


def test_unsupported_tiles_take_the_triton_kernel():
    """Q = 1 (16-row tiles) with tile_kernel="wgmma": the Triton kernel runs (interpret mode here), the
    same result as the default table, and the ops registry records it and why."""
    c = _case(np.random.default_rng(6), 1, [300, 70], h=32, g=2, d=64, page=16, npg=20)
    o, lse = _run(c, True, 4)
    o_ref, l_ref = _run(c, True, 4, table=DEFAULT_TABLE)
    registry.clear_implementation_report()
    jax.jit(lambda q: ops.paged_attention(q, c["k"], c["v"], c["table"], c["pos"], launch_table=WGMMA,
                                          implementation="pallas_gpu_interpret"))(c["q"])
    report = registry.implementation_report()
    assert report["paged_attention"] == "pallas_gpu_interpret"
    assert report["paged_attention.tile_kernel"] == "triton (wgmma refused: 16 rows per tile: need 64 or 128)"
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
    np.testing.assert_array_equal(np.asarray(l_ref), np.asarray(lse))


@hopper
@pytest.mark.parametrize("nq", [4, 8])
def test_hopper_m3_shapes(nq):
    """On the GPU: M3 shapes (64 q / 4 kv heads of 128, 128-token pages), 8 requests of 1-4K tokens."""
    rng = np.random.default_rng(7)
    c = _case(rng, nq, [4096, 3000, 129, 1000, 2048, 4000, 700, None], h=64, g=4, d=128, page=128, npg=32)
    _check(c, *_run(c, False, 8))
    _row_independence(c, False, 8)
    c["ids"] = _selection(rng, np.asarray(c["pos"]), 4, 16, 128)
    _check(c, *_run(c, False, None))
