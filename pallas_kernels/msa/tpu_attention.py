"""MSA block-sparse attention on TPU: Pallas Mosaic kernels (fwd, dq, dk/dv) driven by scalar prefetch.

Math: MSA_SPEC.md section 3 (see gpu_attention.py; outputs o [B,T,H,Dv] and lse [B,T,H] f32,
lse = -inf and o = 0 for a query that sees no key).

TPU layout: keys/values are transposed to [B,G,S,D] so a key tile is a (B_blk, D) VMEM block.
The selected block ids, turned into storage tiles, live in SMEM through
``pltpu.PrefetchScalarGridSpec`` and drive the BlockSpec index maps: grid (b, g, t, j) walks the
2K tile slots of token t (a selected block covers one aligned tile, or two when a packed segment does
not start on a tile boundary); an inactive slot repeats the previous tile index so the pipeline skips
its copy, and its compute is skipped with ``pl.when``. The group's H/G heads (padded to a multiple of
8 sublanes) form the rows of every matmul. Block shapes keep their last two dims either full or
multiples of (8, 128) (checked by tests/kernels/msa/test_msa_tpu_lowering.py on CPU via jax.export).
Backward (custom_vjp): dq with the same grid; dk/dv over the selections sorted by tile (stable sort:
deterministic), one grid step per selection, accumulating in VMEM while consecutive steps hit the
same tile; every tile gets one extra inactive entry so each output tile is written.
SMEM limit: the prefetched tables hold O(T_chunk * G * K) int32 per call; calls are chunked along
queries (``t_chunk``) to keep them small.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.msa import layout

__all__ = ["msa_attention_tpu"]


def _dot_t(a, b):
    """a [M, K] @ b[N, K]^T -> [M, N] f32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _vis_row(kvp, kvs, n, q_pos, q_seg, blk):
    """[1, B] visibility of the tile's keys for a query and block id n."""
    return ((n >= 0) & (kvs == q_seg) & (kvs >= 0) & (kvp <= q_pos)
            & (kvp >= n * blk) & (kvp < n * blk + blk))


# ----------------------------------------------------------------------------- forward

def _fwd_kernel(tiles_ref, act_ref, ids_ref, qpos_ref, qseg_ref,
                q_ref, k_ref, v_ref, kvp_ref, kvs_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *,
                blk, nslots, scale):
    b, g, t, j = (pl.program_id(i) for i in range(4))

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(act_ref[b, g, t, j] != 0)
    def _step():
        n = ids_ref[b, g, t, jax.lax.div(j, 2)]
        s = _dot_t(q_ref[...], k_ref[...]) * scale                       # [M, B]
        vis = _vis_row(kvp_ref[...], kvs_ref[...], n, qpos_ref[b, t], qseg_ref[b, t], blk)
        s = jnp.where(vis, s, -jnp.inf)
        m_prev = m_sc[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        corr = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe)
        l_sc[...] = corr * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        acc_sc[...] = corr * acc_sc[...] + _dot(p.astype(v.dtype), v)
        m_sc[...] = m_next

    @pl.when(j == nslots - 1)
    def _fin():
        l = l_sc[...]
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        o_ref[...] = (acc_sc[...] / l_safe).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, -jnp.inf, m_sc[...] + jnp.log(l_safe))


def _slot_tables(ids, starts, blk):
    """Per (b,g,t) 2K tile slots: tile index and active flag (int32 [B,G,T,2K])."""
    tile_a = starts // blk
    mis = (starts % blk) != 0
    valid = ids >= 0
    tiles = jnp.stack([tile_a, jnp.where(mis, tile_a + 1, tile_a)], axis=-1)
    act = jnp.stack([valid, valid & mis], axis=-1).astype(jnp.int32)
    shp = ids.shape[:3] + (2 * ids.shape[3],)
    return tiles.reshape(shp).astype(jnp.int32), act.reshape(shp)


def _query_outer_specs(m: int, d: int, dv: int, blk: int):
    """Index map of the query-side blocks and the BlockSpecs of (q, k, v, kv positions, kv segments)
    shared by the forward and dq kernels: grid (batch, group, token, slot); the scalar-prefetched
    tile table ``tl`` picks the key tile of each slot."""
    q_map = lambda b, g_, t, j, *_: (b, t, g_, 0, 0)  # noqa: E731
    kv_map = lambda b, g_, t, j, tl, *_: (b, g_, tl[b, g_, t, j], 0)  # noqa: E731
    pos_map = lambda b, g_, t, j, tl, *_: (b, tl[b, g_, t, j], 0, 0)  # noqa: E731
    return q_map, [pl.BlockSpec((None, None, None, m, d), q_map),
                   pl.BlockSpec((None, None, blk, d), kv_map),
                   pl.BlockSpec((None, None, blk, dv), kv_map),
                   pl.BlockSpec((None, None, 1, blk), pos_map),
                   pl.BlockSpec((None, None, 1, blk), pos_map)]


def _fwd_chunk(q5, kt, vt, kvp4, kvs4, ids, tiles, act, qpos, qseg, *, blk, interpret):
    bsz, tc, g, m, d = q5.shape
    dv = vt.shape[-1]
    nslots = tiles.shape[-1]
    kernel = functools.partial(_fwd_kernel, blk=blk, nslots=nslots, scale=1.0 / math.sqrt(d))
    q_map, in_specs = _query_outer_specs(m, d, dv, blk)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(bsz, g, tc, nslots),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, m, dv), q_map),
                   pl.BlockSpec((None, None, None, m, 1), q_map)],
        scratch_shapes=[pltpu.VMEM((m, 1), jnp.float32), pltpu.VMEM((m, 1), jnp.float32),
                        pltpu.VMEM((m, dv), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((bsz, tc, g, m, dv), q5.dtype),
                   jax.ShapeDtypeStruct((bsz, tc, g, m, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_interp(interpret),
        name="msa_fwd_tpu",
    )(tiles, act, ids, qpos, qseg, q5, kt, vt, kvp4, kvs4)


def _interp(interpret):
    """False (compile for TPU), True (plain Pallas interpreter) or a pltpu.InterpretParams."""
    return interpret


# ----------------------------------------------------------------------------- backward: dq

def _dq_kernel(tiles_ref, act_ref, ids_ref, qpos_ref, qseg_ref,
               q_ref, k_ref, v_ref, kvp_ref, kvs_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_sc,
               *, blk, nslots, scale):
    b, g, t, j = (pl.program_id(i) for i in range(4))

    @pl.when(j == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(act_ref[b, g, t, j] != 0)
    def _step():
        n = ids_ref[b, g, t, jax.lax.div(j, 2)]
        k = k_ref[...]
        s = _dot_t(q_ref[...], k) * scale
        vis = _vis_row(kvp_ref[...], kvs_ref[...], n, qpos_ref[b, t], qseg_ref[b, t], blk)
        p = jnp.where(vis, jnp.exp(s - lse_ref[...]), 0.0)
        dp = _dot_t(do_ref[...], v_ref[...])
        ds = p * (dp - delta_ref[...])
        acc_sc[...] += _dot(ds.astype(k.dtype), k)

    @pl.when(j == nslots - 1)
    def _fin():
        dq_ref[...] = (acc_sc[...] * scale).astype(dq_ref.dtype)


def _dq_chunk(q5, kt, vt, kvp4, kvs4, do5, lse5c, delta5c, ids, tiles, act, qpos, qseg, *, blk,
              interpret):
    bsz, tc, g, m, d = q5.shape
    dv = vt.shape[-1]
    nslots = tiles.shape[-1]
    kernel = functools.partial(_dq_kernel, blk=blk, nslots=nslots, scale=1.0 / math.sqrt(d))
    q_map, in_specs = _query_outer_specs(m, d, dv, blk)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(bsz, g, tc, nslots),
        in_specs=in_specs + [
                  pl.BlockSpec((None, None, None, m, dv), q_map),
                  pl.BlockSpec((None, None, None, m, 1), q_map),
                  pl.BlockSpec((None, None, None, m, 1), q_map)],
        out_specs=pl.BlockSpec((None, None, None, m, d), q_map),
        scratch_shapes=[pltpu.VMEM((m, d), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q5.shape, q5.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_interp(interpret),
        name="msa_dq_tpu",
    )(tiles, act, ids, qpos, qseg, q5, kt, vt, kvp4, kvs4, do5, lse5c, delta5c)


# ----------------------------------------------------------------------------- backward: dk, dv

def _dkdv_kernel(etile_ref, et_ref, en_ref, eflag_ref, qpos_ref, qseg_ref,
                 q_ref, k_ref, v_ref, kvp_ref, kvs_ref, do_ref, lse_ref, delta_ref,
                 dk_ref, dv_ref, dk_sc, dv_sc, *, blk, scale):
    b, g, e = (pl.program_id(i) for i in range(3))
    flag = eflag_ref[b, g, e]            # bit0 first, bit1 last, bit2 active

    @pl.when((flag & 1) != 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when((flag & 4) != 0)
    def _step():
        t = et_ref[b, g, e]
        n = en_ref[b, g, e]
        q = q_ref[...]                                   # [M, D]
        do = do_ref[...]                                 # [M, Dv]
        st = _dot_t(k_ref[...], q) * scale               # [B, M]
        kvp = kvp_ref[...]                               # [B, 1]
        kvs = kvs_ref[...]
        vis = ((kvs == qseg_ref[b, t]) & (kvs >= 0) & (kvp <= qpos_ref[b, t])
               & (kvp >= n * blk) & (kvp < n * blk + blk))           # [B, 1]
        pt = jnp.where(vis, jnp.exp(st - lse_ref[...]), 0.0)        # lse row [1, M]
        dv_sc[...] += _dot(pt.astype(do.dtype), do)
        dpt = _dot_t(v_ref[...], do)                     # [B, M]
        dst = pt * (dpt - delta_ref[...])
        dk_sc[...] += _dot(dst.astype(q.dtype), q)

    @pl.when((flag & 2) != 0)
    def _fin():
        dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _entries(ids, starts, blk, n_tiles):
    """Selections sorted by tile plus one inactive entry per tile: (tile, t, n, flags) [B,G,E]."""
    bsz, g, t, k = ids.shape
    valid = ids >= 0
    tile_a = starts // blk
    mis = (starts % blk) != 0
    t0 = jnp.where(valid, tile_a, n_tiles).reshape(bsz, g, t * k)
    t1 = jnp.where(valid & mis, tile_a + 1, n_tiles).reshape(bsz, g, t * k)
    dummy = jnp.broadcast_to(jnp.arange(n_tiles, dtype=jnp.int32), (bsz, g, n_tiles))
    tiles = jnp.concatenate([dummy, t0, t1], axis=-1)
    flat = jnp.arange(t * k, dtype=jnp.int32)
    flat = jnp.concatenate([jnp.full((n_tiles,), -1, jnp.int32), flat, flat])
    flat = jnp.broadcast_to(flat, tiles.shape)
    tiles, flat = jax.lax.sort((tiles, flat), dimension=2, num_keys=1, is_stable=True)
    active = (tiles < n_tiles) & (flat >= 0)
    etile = jnp.minimum(tiles, n_tiles - 1)
    tok = jnp.where(flat >= 0, flat // k, 0)
    n = jnp.take_along_axis(ids.reshape(bsz, g, t * k), jnp.maximum(flat, 0), axis=-1)
    n = jnp.where(active, n, -1)
    prev = jnp.concatenate([jnp.full((bsz, g, 1), -1, jnp.int32), etile[..., :-1]], axis=-1)
    nxt = jnp.concatenate([etile[..., 1:], jnp.full((bsz, g, 1), -1, jnp.int32)], axis=-1)
    flags = ((etile != prev).astype(jnp.int32) + 2 * (etile != nxt).astype(jnp.int32)
             + 4 * active.astype(jnp.int32))
    return etile.astype(jnp.int32), tok.astype(jnp.int32), n.astype(jnp.int32), flags


def _dkdv_call(q5, kt, vt, kvpc, kvsc, do5, lse_row, delta_row, etile, et, en, ef, qpos, qseg, *,
               blk, interpret):
    bsz, t, g, m, d = q5.shape
    dv = vt.shape[-1]
    e_total = etile.shape[-1]
    kernel = functools.partial(_dkdv_kernel, blk=blk, scale=1.0 / math.sqrt(d))
    q_map = lambda b, g_, e, etl, ett, *_: (b, ett[b, g_, e], g_, 0, 0)
    kv_map = lambda b, g_, e, etl, *_: (b, g_, etl[b, g_, e], 0)
    pos_map = lambda b, g_, e, etl, *_: (b, etl[b, g_, e], 0, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(bsz, g, e_total),
        in_specs=[pl.BlockSpec((None, None, None, m, d), q_map),
                  pl.BlockSpec((None, None, blk, d), kv_map),
                  pl.BlockSpec((None, None, blk, dv), kv_map),
                  pl.BlockSpec((None, None, blk, 1), pos_map),
                  pl.BlockSpec((None, None, blk, 1), pos_map),
                  pl.BlockSpec((None, None, None, m, dv), q_map),
                  pl.BlockSpec((None, None, None, 1, m), q_map),
                  pl.BlockSpec((None, None, None, 1, m), q_map)],
        out_specs=[pl.BlockSpec((None, None, blk, d), kv_map),
                   pl.BlockSpec((None, None, blk, dv), kv_map)],
        scratch_shapes=[pltpu.VMEM((blk, d), jnp.float32), pltpu.VMEM((blk, dv), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(kt.shape, kt.dtype),
                   jax.ShapeDtypeStruct(vt.shape, vt.dtype)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_interp(interpret),
        name="msa_dkdv_tpu",
    )(etile, et, en, ef, qpos, qseg, q5, kt, vt, kvpc, kvsc, do5, lse_row, delta_row)


# ----------------------------------------------------------------------------- wrappers

def _group(x, g, m):
    bsz, t, h = x.shape[:3]
    hg = h // g
    x = x.reshape(bsz, t, g, hg, *x.shape[3:])
    if m != hg:
        widths = [(0, 0)] * x.ndim
        widths[3] = (0, m - hg)
        x = jnp.pad(x, widths)
    return x


def _prep(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk):
    bsz, t, h, d = q.shape
    g = k.shape[2]
    m = -(-(h // g) // 8) * 8
    prep = layout.prepare(k, v, q_positions, kv_positions, q_seg, kv_seg, blk)
    ids = layout.dedupe_ids(block_ids)
    starts = layout.window_starts(ids, prep.base, blk, prep.s_pad)
    nt = prep.s_pad // blk
    kt = jnp.transpose(prep.k, (0, 2, 1, 3))
    vt = jnp.transpose(prep.v, (0, 2, 1, 3))
    return dict(m=m, prep=prep, ids=ids, starts=starts, nt=nt, kt=kt, vt=vt,
                kvp4=prep.kv_pos.reshape(bsz, nt, 1, blk), kvs4=prep.kv_seg.reshape(bsz, nt, 1, blk),
                qpos=q_positions.astype(jnp.int32))


def _chunks(t, t_chunk):
    return [(c, min(t, c + t_chunk)) for c in range(0, t, t_chunk)]


def _fwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret, t_chunk):
    g = k.shape[2]
    hg = q.shape[2] // g
    c = _prep(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk)
    q5 = _group(q, g, c["m"])
    tiles, act = _slot_tables(c["ids"], c["starts"], blk)
    outs = []
    for a, e in _chunks(q.shape[1], t_chunk):
        outs.append(_fwd_chunk(q5[:, a:e], c["kt"], c["vt"], c["kvp4"], c["kvs4"],
                               c["ids"][:, :, a:e], tiles[:, :, a:e], act[:, :, a:e],
                               c["qpos"][:, a:e], c["prep"].q_seg[:, a:e], blk=blk,
                               interpret=interpret))
    o5 = jnp.concatenate([x[0] for x in outs], axis=1)
    lse5 = jnp.concatenate([x[1] for x in outs], axis=1)
    bsz, t = q.shape[:2]
    o = o5[:, :, :, :hg].reshape(bsz, t, g * hg, -1)
    lse = lse5[:, :, :, :hg, 0].reshape(bsz, t, g * hg)
    return o, lse


def _bwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, o, lse, do, blk, interpret,
         t_chunk):
    bsz, t, h, d = q.shape
    s = k.shape[1]
    g = k.shape[2]
    hg = h // g
    c = _prep(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk)
    m = c["m"]
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    q5 = _group(q, g, m)
    do5 = _group(do.astype(q.dtype), g, m)
    lse_g = _group(lse, g, m)
    lse_g = jnp.where(jnp.arange(m) < hg, lse_g, jnp.inf)     # padded rows: p = 0
    delta_g = _group(delta, g, m)
    tiles, act = _slot_tables(c["ids"], c["starts"], blk)
    dqs = []
    for a, e in _chunks(t, t_chunk):
        dqs.append(_dq_chunk(q5[:, a:e], c["kt"], c["vt"], c["kvp4"], c["kvs4"], do5[:, a:e],
                             lse_g[:, a:e, ..., None], delta_g[:, a:e, ..., None],
                             c["ids"][:, :, a:e], tiles[:, :, a:e], act[:, :, a:e],
                             c["qpos"][:, a:e], c["prep"].q_seg[:, a:e], blk=blk,
                             interpret=interpret))
    dq5 = jnp.concatenate(dqs, axis=1)
    etile, et, en, ef = _entries(c["ids"], c["starts"], blk, c["nt"])
    nt = c["nt"]
    dkt, dvt = _dkdv_call(q5, c["kt"], c["vt"], c["prep"].kv_pos.reshape(bsz, nt, blk, 1),
                          c["prep"].kv_seg.reshape(bsz, nt, blk, 1), do5, lse_g[..., None, :],
                          delta_g[..., None, :], etile, et, en, ef, c["qpos"], c["prep"].q_seg,
                          blk=blk, interpret=interpret)
    dq = dq5[:, :, :, :hg].reshape(bsz, t, h, d)
    dk = jnp.transpose(dkt, (0, 2, 1, 3))[:, :s]
    dv = jnp.transpose(dvt, (0, 2, 1, 3))[:, :s]
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _attn(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret, t_chunk):
    return _fwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret,
                t_chunk)


def _attn_fwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret,
              t_chunk):
    o, lse = _fwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret,
                  t_chunk)
    return (o, lse), (q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, o, lse)


def _float0(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


def _attn_bwd(blk, interpret, t_chunk, res, cot):
    q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, o, lse = res
    do, _ = cot
    dq, dk, dv = _bwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, o, lse, do,
                      blk, interpret, t_chunk)
    return (dq, dk, dv, _float0(block_ids), _float0(q_positions), _float0(kv_positions),
            _float0(q_seg), _float0(kv_seg))


_attn.defvjp(_attn_fwd, _attn_bwd)


def msa_attention_tpu(q, k, v, block_ids, *, q_positions, kv_positions, q_segment_ids=None,
                      kv_segment_ids=None, block_size, interpret=False, t_chunk=512):
    """Block-sparse MSA attention with Pallas Mosaic TPU kernels; differentiable in q, k, v.

    Args:
      q [B,T,H,D], k [B,S,G,D], v [B,S,G,Dv] (bf16/f32); block_ids int [B,G,T,K] (-1 = empty);
      q_positions [B,T], kv_positions [B,S]; segment ids or None; block_size (multiple of 128 on
      real TPUs, any multiple of 8 in interpret mode); interpret: False (Mosaic TPU), True (the
      plain Pallas interpreter, CPU) or a ``pltpu.InterpretParams`` (TPU-semantics interpreter,
      e.g. with detect_races=True); t_chunk: queries per kernel call (SMEM tables).
    Returns: (o [B,T,H,Dv] q.dtype, lse [B,T,H] f32, natural log; -inf when nothing is visible).
    Preconditions (shapes, block size) are asserted; the ops layer checks them for its callers.
    Math: MSA_SPEC.md section 3. lse has no gradient.
    """
    layout.check_shapes(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                        kv_segment_ids)
    assert block_size > 0 and block_size % 8 == 0, f"block_size must be a multiple of 8, got {block_size}"
    return _attn(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                 block_size, interpret, t_chunk)
