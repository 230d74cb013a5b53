"""MSA block-sparse attention on TPU: Pallas Mosaic kernels (fwd, dq, dk/dv) driven by scalar prefetch.

Math: MSA_SPEC.md section 3 (see gpu_attention.py; outputs o [B,T,H,Dv] and lse [B,T,H] f32,
lse = -inf and o = 0 for a query that sees no key).

TPU layout: keys/values are transposed to [B,G,S,D] so a key tile is a (B_blk, D) VMEM block.
The selected block ids, turned into storage tiles, live in SMEM through
``pltpu.PrefetchScalarGridSpec`` and drive the BlockSpec index maps: grid (g, t, j) walks the 2K
tile slots of token t of one query chunk (a selected block covers one aligned tile, or two when a
packed segment does not start on a tile boundary); an inactive slot repeats the previous tile index
so the pipeline skips its copy, and its compute is skipped with ``pl.when``. The group's H/G heads
(padded to a multiple of 8 sublanes) form the rows of every matmul. Block shapes keep their last two
dims either full or multiples of (8, 128) (checked by tests/kernels/msa/test_msa_tpu_lowering.py).
Backward (custom_vjp): dq with the same grid; dk/dv KV-outer over the selections sorted by tile
(stable sort: deterministic), one grid step per entry, accumulating in VMEM while consecutive
entries hit the same tile; every tile has one extra inactive entry so each output tile is written.

One pallas_call per op inside one ``lax.fori_loop`` at any T (tpu_common.py): fwd / dq calls take
``tpu_common.query_chunk`` tokens of one batch row, dk/dv calls a fixed window of sorted entries (a
tile's run split by a window edge continues from an f32 carry tile, so the summation order is that
of one unsplit pass); scalar-prefetch tables <= tpu_common.TABLE_WORDS int32 (240 KiB) per call.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.msa import layout, tpu_common as tc_
from pallas_kernels.msa.tpu_common import dot, dot_t

__all__ = ["msa_attention_tpu"]

_F32 = jnp.float32


def _vis_row(kvp, kvs, n, q_pos, q_seg, blk):
    """[1, B] visibility of the tile's keys for a query and block id n."""
    return ((n >= 0) & (kvs == q_seg) & (kvs >= 0) & (kvp <= q_pos)
            & (kvp >= n * blk) & (kvp < n * blk + blk))


# ----------------------------------------------------------------------------- forward

def _fwd_kernel(scal_ref, tiles_ref, act_ref, ids_ref, qpos_ref, qseg_ref,
                q_ref, k_ref, v_ref, kvp_ref, kvs_ref, o_alias, lse_alias, o_ref, lse_ref,
                m_sc, l_sc, acc_sc, *, blk, tc, nslots, scale):
    del scal_ref, tiles_ref, o_alias, lse_alias
    g, t, j = (pl.program_id(i) for i in range(3))
    slot, sid = tc_.slot_index(tc, nslots)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, _F32)
        l_sc[...] = jnp.zeros(l_sc.shape, _F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    @pl.when(act_ref[slot(g, t, j)] != 0)
    def _step():
        n = ids_ref[sid(g, t, j)]
        s = dot_t(q_ref[...], k_ref[...]) * scale                        # [M, B]
        vis = _vis_row(kvp_ref[...], kvs_ref[...], n, qpos_ref[t], qseg_ref[t], blk)
        s = jnp.where(vis, s, -jnp.inf)
        m_prev = m_sc[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        corr = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe)
        l_sc[...] = corr * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        acc_sc[...] = corr * acc_sc[...] + dot(p.astype(v.dtype), v)
        m_sc[...] = m_next

    @pl.when(j == nslots - 1)
    def _fin():
        l = l_sc[...]
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        o_ref[...] = (acc_sc[...] / l_safe).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, -jnp.inf, m_sc[...] + jnp.log(l_safe))


def _query_outer_specs(m, d, dv, blk, tc, nslots):
    """Index map of the query-side blocks (batch row and chunk origin from the ``scal`` table) and
    the BlockSpecs of (q, k, v, kv positions, kv segments), grid (group, token, slot)."""
    slot, _ = tc_.slot_index(tc, nslots)
    q_map = lambda g, t, j, sc, *_: (sc[0], sc[1] + t, g, 0, 0)  # noqa: E731
    kv_map = lambda g, t, j, sc, tl, *_: (sc[0], g, tl[slot(g, t, j)], 0)  # noqa: E731
    pos_map = lambda g, t, j, sc, tl, *_: (sc[0], tl[slot(g, t, j)], 0, 0)  # noqa: E731
    return q_map, [pl.BlockSpec((None, None, None, m, d), q_map),
                   pl.BlockSpec((None, None, blk, d), kv_map),
                   pl.BlockSpec((None, None, blk, dv), kv_map),
                   pl.BlockSpec((None, None, 1, blk), pos_map),
                   pl.BlockSpec((None, None, 1, blk), pos_map)]


_QUERY_OUTER = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _query_outer(kernel, c, blk, tc):
    """(kernel with its constants, dims (g, m, d, dv, nslots), q index map, shared in_specs)."""
    m, d = c["q5"].shape[-2:]
    g, dv = c["vt"].shape[1], c["vt"].shape[-1]
    nslots = 2 * c["ids"].shape[-1]
    kernel = functools.partial(kernel, blk=blk, tc=tc, nslots=nslots, scale=1.0 / math.sqrt(d))
    return (kernel, (g, m, d, dv, nslots)) + _query_outer_specs(m, d, dv, blk, tc, nslots)


def _fwd_call(tabs, c, o5, lse5, *, tc, blk, interpret):
    kernel, (g, m, _, dv, nslots), q_map, in_specs = _query_outer(_fwd_kernel, c, blk, tc)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(tabs),
        grid=(g, tc, nslots),
        in_specs=in_specs + [tc_.aliased(), tc_.aliased()],
        out_specs=[pl.BlockSpec((None, None, None, m, dv), q_map),
                   pl.BlockSpec((None, None, None, m, 1), q_map)],
        scratch_shapes=[pltpu.VMEM((m, 1), _F32), pltpu.VMEM((m, 1), _F32),
                        pltpu.VMEM((m, dv), _F32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(o5.shape, o5.dtype),
                   jax.ShapeDtypeStruct(lse5.shape, lse5.dtype)],
        input_output_aliases={len(tabs) + 5: 0, len(tabs) + 6: 1},
        compiler_params=_QUERY_OUTER,
        interpret=interpret,
        name="msa_fwd_tpu",
    )(*tabs, c["q5"], c["kt"], c["vt"], c["kvp4"], c["kvs4"], o5, lse5)


# ----------------------------------------------------------------------------- backward: dq

def _dq_kernel(scal_ref, tiles_ref, act_ref, ids_ref, qpos_ref, qseg_ref,
               q_ref, k_ref, v_ref, kvp_ref, kvs_ref, do_ref, lse_ref, delta_ref, dq_alias,
               dq_ref, acc_sc, *, blk, tc, nslots, scale):
    del scal_ref, tiles_ref, dq_alias
    g, t, j = (pl.program_id(i) for i in range(3))
    slot, sid = tc_.slot_index(tc, nslots)

    @pl.when(j == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    @pl.when(act_ref[slot(g, t, j)] != 0)
    def _step():
        n = ids_ref[sid(g, t, j)]
        k = k_ref[...]
        s = dot_t(q_ref[...], k) * scale
        vis = _vis_row(kvp_ref[...], kvs_ref[...], n, qpos_ref[t], qseg_ref[t], blk)
        p = jnp.where(vis, jnp.exp(s - lse_ref[...]), 0.0)
        dp = dot_t(do_ref[...], v_ref[...])
        ds = p * (dp - delta_ref[...])
        acc_sc[...] += dot(ds.astype(k.dtype), k)

    @pl.when(j == nslots - 1)
    def _fin():
        dq_ref[...] = (acc_sc[...] * scale).astype(dq_ref.dtype)


def _dq_call(tabs, c, do5, lse5c, delta5c, dq5, *, tc, blk, interpret):
    kernel, (g, m, d, dv, nslots), q_map, in_specs = _query_outer(_dq_kernel, c, blk, tc)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(tabs),
        grid=(g, tc, nslots),
        in_specs=in_specs + [pl.BlockSpec((None, None, None, m, dv), q_map),
                             pl.BlockSpec((None, None, None, m, 1), q_map),
                             pl.BlockSpec((None, None, None, m, 1), q_map),
                             tc_.aliased()],
        out_specs=pl.BlockSpec((None, None, None, m, d), q_map),
        scratch_shapes=[pltpu.VMEM((m, d), _F32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(dq5.shape, dq5.dtype),
        input_output_aliases={len(tabs) + 8: 0},
        compiler_params=_QUERY_OUTER,
        interpret=interpret,
        name="msa_dq_tpu",
    )(*tabs, c["q5"], c["kt"], c["vt"], c["kvp4"], c["kvs4"], do5, lse5c, delta5c, dq5)


# ----------------------------------------------------------------------------- backward: dk, dv

def _dkdv_kernel(tile_ref, qrow_ref, lo_ref, hi_ref, qseg_ref, flag_ref,
                 q_ref, k_ref, v_ref, kvp_ref, kvs_ref, do_ref, lse_ref, delta_ref, ck_ref, cv_ref,
                 dk_alias, dv_alias, dk_ref, dv_ref, ck_out, cv_out, dk_sc, dv_sc, *, scale, width):
    del tile_ref, qrow_ref, dk_alias, dv_alias
    e = pl.program_id(0)
    flag = flag_ref[e]            # bit0 first of its tile, bit1 last, bit2 active
    first = (flag & 1) != 0

    @pl.when(first)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, _F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, _F32)

    @pl.when((e == 0) & jnp.logical_not(first))
    def _resume():                # the tile's run began in the previous window
        dk_sc[...] = ck_ref[...]
        dv_sc[...] = cv_ref[...]

    @pl.when((flag & 4) != 0)
    def _step():
        q = q_ref[...]                                   # [M, D]
        do = do_ref[...]                                 # [M, Dv]
        st = dot_t(k_ref[...], q) * scale                # [B, M]
        kvp = kvp_ref[...]                               # [B, 1]
        kvs = kvs_ref[...]
        vis = ((kvs == qseg_ref[e]) & (kvs >= 0) & (kvp >= lo_ref[e]) & (kvp <= hi_ref[e]))
        pt = jnp.where(vis, jnp.exp(st - lse_ref[...]), 0.0)        # lse row [1, M]
        dv_sc[...] += dot(pt.astype(do.dtype), do)
        dpt = dot_t(v_ref[...], do)                      # [B, M]
        dst = pt * (dpt - delta_ref[...])
        dk_sc[...] += dot(dst.astype(q.dtype), q)

    @pl.when(((flag & 2) != 0) | (e == width - 1))
    def _fin():                   # a run cut by the window edge is written again by a later call
        dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)

    @pl.when(e == width - 1)
    def _carry():
        ck_out[...] = dk_sc[...]
        cv_out[...] = dv_sc[...]


def _dkdv_call(tabs, r, bufs, *, g, nt, blk, interpret):
    m, d = r["q"].shape[-2:]
    dv = r["v"].shape[-1]
    width = tabs[0].shape[0]
    kernel = functools.partial(_dkdv_kernel, scale=1.0 / math.sqrt(d), width=width)
    q_map = lambda e, tl, qr, *_: (qr[e], 0, 0)  # noqa: E731
    kv_map = lambda e, tl, *_: (tl[e], 0, 0)  # noqa: E731
    pos_map = lambda e, tl, *_: (jax.lax.div(tl[e], g * nt) * nt + jax.lax.rem(tl[e], nt), 0, 0)  # noqa: E731
    fixed = lambda e, *_: (0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(tabs),
        grid=(width,),
        in_specs=[pl.BlockSpec((None, m, d), q_map),
                  pl.BlockSpec((None, blk, d), kv_map),
                  pl.BlockSpec((None, blk, dv), kv_map),
                  pl.BlockSpec((None, blk, 1), pos_map),
                  pl.BlockSpec((None, blk, 1), pos_map),
                  pl.BlockSpec((None, m, dv), q_map),
                  pl.BlockSpec((None, 1, m), q_map),
                  pl.BlockSpec((None, 1, m), q_map),
                  pl.BlockSpec((blk, d), fixed),
                  pl.BlockSpec((blk, dv), fixed),
                  tc_.aliased(), tc_.aliased()],
        out_specs=[pl.BlockSpec((None, blk, d), kv_map),
                   pl.BlockSpec((None, blk, dv), kv_map),
                   pl.BlockSpec((blk, d), fixed),
                   pl.BlockSpec((blk, dv), fixed)],
        scratch_shapes=[pltpu.VMEM((blk, d), _F32), pltpu.VMEM((blk, dv), _F32)],
    )
    ck, cv, dk, dv_ = bufs
    n_in = len(tabs) + 10
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(dk.shape, dk.dtype),
                   jax.ShapeDtypeStruct(dv_.shape, dv_.dtype),
                   jax.ShapeDtypeStruct(ck.shape, _F32), jax.ShapeDtypeStruct(cv.shape, _F32)],
        input_output_aliases={n_in: 0, n_in + 1: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="msa_dkdv_tpu",
    )(*tabs, r["q"], r["k"], r["v"], r["kvp"], r["kvs"], r["do"], r["lse"], r["delta"], ck, cv,
      dk, dv_)


# ----------------------------------------------------------------------------- wrappers

def _prep(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk):
    bsz, t, h, d = q.shape
    g = k.shape[2]
    m = -(-(h // g) // 8) * 8
    prep = layout.prepare(k, v, q_positions, kv_positions, q_seg, kv_seg, blk)
    nt = prep.s_pad // blk
    return dict(m=m, prep=prep, ids=layout.dedupe_ids(block_ids), nt=nt,
                kt=jnp.transpose(prep.k, (0, 2, 1, 3)), vt=jnp.transpose(prep.v, (0, 2, 1, 3)),
                kvp4=prep.kv_pos.reshape(bsz, nt, 1, blk), kvs4=prep.kv_seg.reshape(bsz, nt, 1, blk),
                qpos=q_positions.astype(jnp.int32), q5=tc_.group_heads(q, g, m))


def _fwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret):
    bsz, t, h, _ = q.shape
    g, dv = k.shape[2], v.shape[3]
    hg = h // g
    c = _prep(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk)
    m = c["m"]
    bufs = (jnp.zeros((bsz, t, g, m, dv), q.dtype), jnp.zeros((bsz, t, g, m, 1), _F32))
    call = lambda tabs, bufs, tc: tuple(_fwd_call(tabs, c, *bufs, tc=tc, blk=blk,  # noqa: E731
                                                  interpret=interpret))
    o5, lse5 = tc_.query_loop(c["ids"], c["prep"], c["qpos"], blk, call, bufs)
    o = o5[:, :, :, :hg].reshape(bsz, t, g * hg, -1)
    lse = lse5[:, :, :, :hg, 0].reshape(bsz, t, g * hg)
    return o, lse


def _bwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, o, lse, do, blk, interpret):
    bsz, t, h, d = q.shape
    s, g, dvh = k.shape[1], k.shape[2], v.shape[3]
    hg = h // g
    c = _prep(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk)
    m, nt, prep = c["m"], c["nt"], c["prep"]
    delta = jnp.sum(o.astype(_F32) * do.astype(_F32), axis=-1)
    do5 = tc_.group_heads(do.astype(q.dtype), g, m)
    lse_g = tc_.group_heads(lse, g, m)
    lse_g = jnp.where(jnp.arange(m) < hg, lse_g, jnp.inf)     # padded rows: p = 0
    delta_g = tc_.group_heads(delta, g, m)
    call = lambda tabs, dq5, tc: _dq_call(tabs, c, do5, lse_g[..., None], delta_g[..., None],  # noqa: E731
                                          dq5, tc=tc, blk=blk, interpret=interpret)
    dq5 = tc_.query_loop(c["ids"], prep, c["qpos"], blk, call,
                            jnp.zeros(c["q5"].shape, q.dtype))

    starts = layout.window_starts(c["ids"], prep.base, blk, prep.s_pad)
    tables, n_windows = tc_.sorted_entries(c["ids"], starts, c["qpos"], prep.q_seg, blk, nt,
                                           per_group=True)
    rows = bsz * t * g
    r = dict(q=c["q5"].reshape(rows, m, d), k=c["kt"].reshape(bsz * g * nt, blk, d),
             v=c["vt"].reshape(bsz * g * nt, blk, dvh),
             kvp=prep.kv_pos.reshape(bsz * nt, blk, 1), kvs=prep.kv_seg.reshape(bsz * nt, blk, 1),
             do=do5.reshape(rows, m, dvh), lse=lse_g.reshape(rows, 1, m),
             delta=delta_g.reshape(rows, 1, m))
    bufs = (jnp.zeros((blk, d), _F32), jnp.zeros((blk, dvh), _F32),
            jnp.zeros(r["k"].shape, k.dtype), jnp.zeros(r["v"].shape, v.dtype))

    def body(i, bufs):
        dk, dv_, ck, cv = _dkdv_call(tc_.window(tables, i), r, bufs, g=g, nt=nt, blk=blk,
                                     interpret=interpret)
        return ck, cv, dk, dv_
    _, _, dkt, dvt = jax.lax.fori_loop(0, n_windows, body, bufs)
    dq = dq5[:, :, :, :hg].reshape(bsz, t, h, d)
    dk = jnp.transpose(dkt.reshape(bsz, g, prep.s_pad, d), (0, 2, 1, 3))[:, :s]
    dv = jnp.transpose(dvt.reshape(bsz, g, prep.s_pad, dvh), (0, 2, 1, 3))[:, :s]
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _attn(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret):
    return _fwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret)


def _attn_fwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret):
    o, lse = _fwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret)
    return (o, lse), (q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, o, lse)


def _float0(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


def _attn_bwd(blk, interpret, res, cot):
    q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, o, lse = res
    do, _ = cot
    dq, dk, dv = _bwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, o, lse, do,
                      blk, interpret)
    return (dq, dk, dv, _float0(block_ids), _float0(q_positions), _float0(kv_positions),
            _float0(q_seg), _float0(kv_seg))


_attn.defvjp(_attn_fwd, _attn_bwd)


def msa_attention_tpu(q, k, v, block_ids, *, q_positions, kv_positions, q_segment_ids=None,
                      kv_segment_ids=None, block_size, interpret=False):
    """Block-sparse MSA attention with Pallas Mosaic TPU kernels; differentiable in q, k, v.

    Args:
      q [B,T,H,D], k [B,S,G,D], v [B,S,G,Dv] (bf16/f32); block_ids int [B,G,T,K] (-1 = empty);
      q_positions [B,T], kv_positions [B,S]; segment ids or None; block_size (multiple of 128 on
      real TPUs, any multiple of 8 in interpret mode); interpret: False (Mosaic TPU), True (the
      plain Pallas interpreter, CPU) or a ``pltpu.InterpretParams`` (TPU-semantics interpreter,
      e.g. with detect_races=True).
    Returns: (o [B,T,H,Dv] q.dtype, lse [B,T,H] f32, natural log; -inf when nothing is visible).
    Each of fwd / dq / dk-dv is one pallas_call inside one loop at any T; SMEM tables <= 240 KiB
    of int32 per call (tpu_common.py). Preconditions (shapes, block size) are asserted; the ops
    layer checks them for its callers. Math: MSA_SPEC.md section 3. lse has no gradient.
    """
    layout.check_shapes(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                        kv_segment_ids)
    assert block_size > 0 and block_size % 8 == 0, f"block_size must be a multiple of 8, got {block_size}"
    return _attn(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                 block_size, interpret)
