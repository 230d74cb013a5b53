"""The KV-outer kernels' mask-free tiles (gpu_sparse_fwd.py ``needs_mask`` / ``mask_ends`` /
``tile_loops``, shared by the forward, the backward and the indexer KL).

1. The per-selection flag and the masked-tile count of every run piece against a semantic oracle
   (a selection needs a mask iff some key of its window is not visible to it, from the dense
   visibility rule; the masked tiles reach the last such entry of the piece): causal, packed
   unaligned documents, clamped windows with queries as a suffix, queries in reverse order
   (masked entries last in their runs); blocks 64 and 128; H/G = 1, 3, 6, 16.
2. End to end in interpret mode on the same layouts (both loops exercised): forward, backward and
   KL against their fp32 references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import msa as msa_ops
from pallas_kernels.msa import gpu_kl as gk
from pallas_kernels.msa import gpu_sparse_bwd as gb
from pallas_kernels.msa import gpu_sparse_fwd as gs
from pallas_kernels.msa import layout
from tests.kernels.msa.test_msa_kernels_oracle import (attention, attention_jnp, make_case, positions,
                                                       random_ids, selected_mask, visible)
from tests.kernels.msa.test_msa_kl_kv_outer import _check as _check_kl
from tests.kernels.msa.test_msa_kl_kv_outer import _inputs

POS = ("q_pos", "kv_pos", "q_seg", "kv_seg")


def _layout(name, blk, rng, h=4, g=2, d=4):
    """A make_case dict of one of the named layouts at block size ``blk``."""
    if name == "causal":
        c = make_case(rng, bsz=1, t=3 * blk + 17, s=3 * blk + 17, h=h, g=g, d=d)
    elif name == "packed_unaligned":
        c = make_case(rng, bsz=2, t=4 * blk + 10, s=4 * blk + 10, h=h, g=g, d=d,
                      segments=[[blk + 7, 2 * blk + 3, blk // 2], [4 * blk + 10]])
    elif name == "clamped_suffix":     # row 1 stored from position 5: block 0's window clamps to 0
        c = make_case(rng, bsz=2, t=2 * blk, s=4 * blk + 9, h=h, g=g, d=d,
                      segments=[[blk // 4, 4 * blk + 9 - blk // 4], [4 * blk + 9]])
        c["kv_pos"][1] += 5
        c["q_pos"] = np.ascontiguousarray(c["kv_pos"][:, -2 * blk:])
    elif name == "reversed":           # queries in reverse order: the diagonal entries come last
        c = make_case(rng, bsz=1, t=3 * blk, s=3 * blk, h=h, g=g, d=d)
        for n in ("q", "q_pos", "q_seg", "do"):
            c[n] = np.ascontiguousarray(c[n][:, ::-1])
    else:
        raise ValueError(name)
    return c


LAYOUTS = ("causal", "packed_unaligned", "clamped_suffix", "reversed")


def _oracle_needs(ids, starts, c, kvpos, kvseg, blk):
    """bool [B,G,T,K]: some key of the selection's window is not visible to it (unused: True)."""
    idx = starts[..., None] + np.arange(blk)                                    # [B,G,T,K,blk]
    bidx = np.arange(ids.shape[0])[:, None, None, None, None]
    kp, ks = kvpos[bidx, idx], kvseg[bidx, idx]
    qp = c["q_pos"][:, None, :, None, None]
    qs = c["q_seg"][:, None, :, None, None]
    vis = (ks == qs) & (ks >= 0) & (kp <= qp) & (kp // blk == ids[..., None])
    return ~vis.all(-1) | (ids < 0)


def _pieces(key, run_end, n_valid, chunk):
    """(b, g, a, end) of every run piece the kernels walk (program slices of ``chunk`` entries)."""
    out = []
    for b, g in np.ndindex(key.shape[:2]):
        for lo in range(0, key.shape[-1], chunk):
            a, hi = lo, min(lo + chunk, int(n_valid[b, g]))
            while a < hi:
                end = min(int(run_end[b, g, a]), hi)
                out.append((b, g, a, end))
                a = end
    return out


def _prepared(c, ids, blk):
    """(kv_pos, kv_seg, q_seg padded as the kernels see them, deduplicated ids, window starts)."""
    def f(ids, *pos):
        prep = layout.prepare(jnp.zeros(c["k"].shape[:2] + (1, 1)), None, *pos, blk)
        ids = layout.dedupe_ids(ids)
        return prep.kv_pos, prep.kv_seg, prep.q_seg, ids, layout.window_starts(ids, prep.base, blk,
                                                                               prep.s_pad)
    return jax.jit(f)(jnp.asarray(ids), *(jnp.asarray(c[n]) for n in POS))


def _tile_counts(c, ids, blk, h, rows, chunk):
    """Per run piece the kernels walk: (kernel, oracle) masked-tile counts, the tile count and
    the oracle flag of its first entry."""
    kvpos, kvseg, qseg, ids_d, starts = _prepared(c, ids, blk)
    want = _oracle_needs(np.asarray(ids_d), np.asarray(starts), c, np.asarray(kvpos),
                         np.asarray(kvseg), blk)
    sched = jax.jit(lambda *a: gs.schedule(*a, h=h, rows=rows, chunk=chunk, blk=blk)[1:])
    per, _, lists = sched(ids_d, starts, jnp.asarray(c["q_pos"]), qseg, kvpos, kvseg)
    per = int(per)
    flat, key, run_end, n_valid, mend = (np.asarray(x) for x in lists)
    srt = np.take_along_axis(want.reshape(flat.shape), flat, axis=2)          # oracle, sorted order
    pieces = _pieces(key, run_end, n_valid, chunk)
    b, g, a, end = (np.asarray(x) for x in zip(*pieces))
    got, n_tiles = gs.masked_tiles(mend[b, g, end - 1], a, end, per)      # numpy in, numpy out
    exp = []
    for pb, pg, pa, pe in pieces:
        m = np.nonzero(srt[pb, pg, pa:pe])[0]
        exp.append(0 if len(m) == 0 else m[-1] // per + 1)             # tiles up to the last mask
    return np.asarray(got), np.asarray(exp), np.asarray(n_tiles), srt[b, g, a]


@pytest.mark.parametrize("blk", [64, 128])
@pytest.mark.parametrize("name", LAYOUTS)
def test_flag_and_masked_tiles_match_semantic_oracle(name, blk):
    rng = np.random.default_rng(0)
    c = _layout(name, blk, rng)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 4, blk)
    kvpos, kvseg, qseg, ids_d, starts = _prepared(c, ids, blk)
    needs = jax.jit(gs.needs_mask, static_argnums=6)(ids_d, starts, jnp.asarray(c["q_pos"]), qseg,
                                                      kvpos, kvseg, blk)
    want = _oracle_needs(np.asarray(ids_d), np.asarray(starts), c, np.asarray(kvpos),
                         np.asarray(kvseg), blk)
    np.testing.assert_array_equal(np.asarray(needs), want)
    assert want[np.asarray(ids_d) >= 0].any() and not want.all()      # both kinds present
    for hg in (1, 3, 6, 16):
        got, exp, n_tiles, first_masked = _tile_counts(c, ids, blk, 2 * hg, rows=64, chunk=16)
        np.testing.assert_array_equal(got, exp, err_msg=f"H/G={hg}")
        assert (exp < n_tiles).any() and (exp > 0).any()             # both loops exercised
        if name == "reversed":                 # a leading mask-free entry before a masked one
            assert ((exp > 0) & ~first_masked).any()


def _fwd_bwd(c, ids, blk, **kw):
    pos = tuple(jnp.asarray(c[n]) for n in POS)

    @jax.jit
    def f(q, k, v, ids, do):
        o, lse = gs.sparse_fwd_kv_outer(q, k, v, ids, *pos, block_size=blk, interpret=True, **kw)
        return (o, lse) + gb.sparse_bwd_kv_outer(q, k, v, ids, *pos, o, lse, do, block_size=blk,
                                                 interpret=True, **kw)
    return [np.asarray(x, np.float64) for x in f(*(jnp.asarray(c[n]) for n in ("q", "k", "v")),
                                                 jnp.asarray(ids), jnp.asarray(c["do"]))]


def _kl(c, ids, qi, ki, blk, **kw):
    pos = tuple(jnp.asarray(c[n]) for n in POS)
    f = jax.jit(lambda q, k, qi, ki, ids: gk._run(q, k, qi, ki, ids, *pos, blk, True, True, **kw))
    kl, cnt, dqi, dki = f(*(jnp.asarray(x) for x in (c["q"], c["k"], qi, ki, ids)))
    return float(kl), int(cnt), np.asarray(dqi), np.asarray(dki)


def _check_attention(c, ids, blk, got, atol=3e-5):
    ro, rlse = attention(c["q"], c["k"], c["v"], ids, *(c[n] for n in POS), blk)
    np.testing.assert_allclose(got[0], ro, atol=atol, rtol=atol)
    fin = np.isfinite(rlse)
    np.testing.assert_array_equal(np.isfinite(got[1]), fin)
    np.testing.assert_allclose(got[1][fin], rlse[fin], atol=atol)
    vis = jnp.asarray(visible(*(c[n] for n in POS))[:, None] & selected_mask(ids, c["kv_pos"], blk))
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention_jnp(q, k, v, vis) * c["do"]),
                               argnums=(0, 1, 2)))(*(jnp.asarray(c[n]) for n in ("q", "k", "v")))
    for a, b in zip(got[2:], ref):
        np.testing.assert_allclose(a, np.asarray(b, np.float64), atol=atol, rtol=atol)


def _kl_reference(c, ids, qi, ki, blk):
    f = lambda qi, ki: msa_ops.indexer_kl(jnp.asarray(c["q"]), jnp.asarray(c["k"]), qi, ki,
                                          jnp.asarray(ids), block_size=blk, implementation="xla",
                                          **positions(c))
    def g(qi, ki):
        out, vjp = jax.vjp(f, qi, ki)
        return out, vjp((jnp.float32(1.0), np.zeros((), jax.dtypes.float0)))
    (kl, cnt), (dqi, dki) = jax.jit(g)(jnp.asarray(qi), jnp.asarray(ki))
    return float(kl), int(cnt), np.asarray(dqi), np.asarray(dki)


@pytest.mark.parametrize("name,blk,h,g,kw", [
    ("causal", 64, 4, 4, dict(chunk=32)),                              # H/G = 1
    ("packed_unaligned", 16, 6, 2, dict(chunk=16)),                    # H/G = 3
    ("clamped_suffix", 16, 32, 2, dict(chunk=8, rows=32)),             # H/G = 16
    ("reversed", 16, 12, 2, dict(chunk=16, rows=32)),                  # H/G = 6, masks last
])
def test_end_to_end_against_references(name, blk, h, g, kw):
    rng = np.random.default_rng(1)
    c = _layout(name, blk, rng, h=h, g=g, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], g, 3, blk)
    for rows in (kw.get("rows", 32), 64):                  # the backward's and the forward's tiles
        got, exp, n_tiles, _ = _tile_counts(c, ids, blk, h, rows, kw["chunk"])
        np.testing.assert_array_equal(got, exp)
        assert (exp < n_tiles).any() and (exp > 0).any()             # both loops exercised
    _check_attention(c, ids, blk, _fwd_bwd(c, ids, blk, **kw))
    qi, ki = _inputs(rng, c, g)
    _check_kl(_kl(c, ids, qi, ki, blk, **kw), _kl_reference(c, ids, qi, ki, blk))
