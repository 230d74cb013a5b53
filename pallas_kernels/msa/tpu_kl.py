"""MSA indexer KL loss on TPU (Pallas Mosaic), sparse support; forward and backward (custom_vjp).

Math (MSA_SPEC.md section 4; minimax_jax.ops.msa.kl is the reference, gpu_kl.py the GPU twin): for
query i and group r the support U is the visible keys of the selected blocks block_ids[b, r, i, :].
  teacher t_j = mean over the group's H/G heads of softmax_U(q_h . k_j / sqrt(D))   (no gradient)
  student p_j = softmax_U(qi_r . ki_j / sqrt(Di))
  KL(t || p) = sum_j t_j (log t_j - log p_j);  d KL / d x_j = p_j - t_j  (x = student logits),
  so d qi_r = sum_j (p_j - t_j) ki_j / sqrt(Di) and d ki_j = sum_(i,r) (p_j - t_j) qi_r / sqrt(Di).
Returns (sum of KL over (b, i, r) f32, number of rows with a non-empty support int32).

TPU layout (same scheme as tpu_attention.py): keys are transposed to [B,G,S,D] so a key tile is a
(block_size, D) VMEM block; the index key ki [B,S,Di] gives (block_size, Di) tiles. The selected
block ids, turned into storage tiles (a block covers one aligned tile, or two when a packed
segment does not start on a tile boundary: 2K "slots" per (token, group)), live in SMEM through
``pltpu.PrefetchScalarGridSpec`` and drive the BlockSpec index maps; an inactive slot repeats the
previous tile (no copy) and its compute is skipped with ``pl.when``. Every key's segment, position
and block membership is re-checked in-kernel, so a straddling / clamped tile never adds a wrong
key. The kernels work "keys on sublanes": the teacher logits of one tile are k_tile @ q_group^T
= [block_size, M] (M = H/G heads padded to a multiple of 8 on lanes; the padded heads are masked
out), the student logits are the VPU product sum(ki_tile * qi_row, lanes) = [block_size, 1], and
every per-key quantity (visibility, teacher mean, p - t) is a [block_size, 1] column, so no
transposes and no M = 1 matmuls are needed.

Kernels:
- forward, grid (b, g, t, 2 * 2K): slots [0, 2K) are pass 1 (online max / sum of every head and of
  the student: log-sum-exps), slots [2K, 4K) re-walk the same tiles for pass 2 (the KL, which needs
  the final teacher probabilities: the log of a mean over heads does not decompose online). One
  (token, group) per grid step sequence; outputs kl [B,T,G], lse_x [B,T,G], lse_m [B,T,G,M]
  (the last two are the backward's residuals). Calls are chunked along queries (t_chunk) so the
  SMEM tables stay O(t_chunk * G * K).
- d qi, grid (b, g, t, 2K): same walk, accumulates sum_j (p_j - t_j) ki_j in a [1, Di] scratch.
- d ki, KV-outer, grid (b, e): the selections of ALL groups sorted by storage tile (stable sort of
  the (group, token, slot) entries, plus one inactive entry per tile so every output tile is
  written), one grid step per entry, accumulating (p - t) x qi_r into a [block_size, Di] VMEM
  scratch while consecutive entries hit the same tile; the output tile is written once, at the
  last entry of its run.
Determinism: no atomics anywhere; d ki is KV-outer (chosen over per-selection contributions +
XLA segment-sum, which would write O(T * G * K * block_size * Di) floats to HBM), every sum is in
a fixed order (the sorted entry order is a pure function of block_ids), so the loss and both
gradients are bitwise repeatable. q and k get zero cotangents.
Dense warm-up (block_ids=None) has no kernel here (ValueError).
Limitations: one (token, group) per grid step (MXU rows = H/G heads; like tpu_attention.py); the
d ki entry tables are O(T * G * K) int32 in SMEM and are not chunked (too large for a real TPU's
SMEM at long T; needs manual DMA of the tables). Checked in interpret mode and by Mosaic lowering
(jax.export, platforms=["tpu"]) only.
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
from pallas_kernels.msa.tpu_attention import _chunks, _group, _slot_tables

__all__ = ["indexer_kl_tpu"]

_F32 = jnp.float32


def _dot_t(a, b):
    """a [M, K] @ b[N, K]^T -> [M, N] f32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _tile(q_ref, k_ref, qi_ref, ki_ref, kvp_ref, kvs_ref, n, q_pos, q_seg, *, blk, scale, iscale):
    """Teacher logits s [blk, M] (-inf off-support), student logits x [blk, 1], support [blk, 1]."""
    kvp = kvp_ref[...]                                               # [blk, 1]
    kvs = kvs_ref[...]
    vis = ((n >= 0) & (kvs == q_seg) & (kvs >= 0) & (kvp <= q_pos)
           & (kvp >= n * blk) & (kvp < n * blk + blk))
    s = jnp.where(vis, _dot_t(k_ref[...], q_ref[...]) * scale, -jnp.inf)
    x = jnp.sum(ki_ref[...].astype(_F32) * qi_ref[...].astype(_F32), axis=1, keepdims=True) * iscale
    return s, x, vis


def _teacher(s, lse_m, hg):
    """Mean over the group's heads of the renormalised main-branch probabilities: [blk, 1]."""
    return jnp.sum(jnp.exp(s - lse_m), axis=1, keepdims=True) * (1.0 / hg)


def _p_minus_t(s, x, vis, lse_m, lse_x, hg):
    p = jnp.where(vis, jnp.exp(x - lse_x), 0.0)
    return p - _teacher(s, lse_m, hg)                               # [blk, 1]


# ----------------------------------------------------------------------------- forward

def _fwd_kernel(tiles_ref, act_ref, ids_ref, qpos_ref, qseg_ref,
                q_ref, k_ref, qi_ref, ki_ref, kvp_ref, kvs_ref,
                kl_ref, lsex_ref, lsem_ref,
                m_sc, l_sc, mx_sc, lx_sc, lsem_sc, lsex_sc, acc_sc, *, nslots, hg, consts):
    b, g, t, j = (pl.program_id(i) for i in range(4))
    slot = jax.lax.rem(j, nslots)
    active = act_ref[b, g, t, slot] != 0

    def tile():
        n = ids_ref[b, g, t, jax.lax.div(slot, 2)]
        return _tile(q_ref, k_ref, qi_ref, ki_ref, kvp_ref, kvs_ref, n, qpos_ref[b, t],
                     qseg_ref[b, t], **consts)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, _F32)
        l_sc[...] = jnp.zeros(l_sc.shape, _F32)
        mx_sc[...] = jnp.full(mx_sc.shape, -jnp.inf, _F32)
        lx_sc[...] = jnp.zeros(lx_sc.shape, _F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    @pl.when((j < nslots) & active)
    def _pass1():
        s, x, vis = tile()
        m_prev = m_sc[...]                                           # [1, M]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=0, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        l_sc[...] = (jnp.exp(m_prev - m_safe) * l_sc[...]
                     + jnp.sum(jnp.exp(s - m_safe), axis=0, keepdims=True))
        m_sc[...] = m_next
        x = jnp.where(vis, x, -jnp.inf)
        mx_prev = mx_sc[...]                                         # [1, 1]
        mx_next = jnp.maximum(mx_prev, jnp.max(x, axis=0, keepdims=True))
        mx_safe = jnp.where(mx_next == -jnp.inf, 0.0, mx_next)
        lx_sc[...] = (jnp.exp(mx_prev - mx_safe) * lx_sc[...]
                      + jnp.sum(jnp.exp(x - mx_safe), axis=0, keepdims=True))
        mx_sc[...] = mx_next

    @pl.when(j == nslots - 1)
    def _lse():
        l = l_sc[...]
        row_ok = jax.lax.broadcasted_iota(jnp.int32, l.shape, 1) < hg
        ok = (l > 0) & row_ok
        lsem_sc[...] = jnp.where(ok, m_sc[...] + jnp.log(jnp.where(ok, l, 1.0)), jnp.inf)
        lx = lx_sc[...]
        lsex_sc[...] = jnp.where(lx > 0, mx_sc[...] + jnp.log(jnp.where(lx > 0, lx, 1.0)), -jnp.inf)

    @pl.when((j >= nslots) & active)
    def _pass2():
        s, x, vis = tile()
        tch = _teacher(s, lsem_sc[...], hg)                          # [blk, 1]
        keep = vis & (tch > 0)
        log_t = jnp.log(jnp.where(keep, tch, 1.0))
        term = jnp.where(keep, tch * (log_t - (x - lsex_sc[...])), 0.0)
        acc_sc[...] += jnp.sum(term, axis=0, keepdims=True)

    @pl.when(j == 2 * nslots - 1)
    def _fin():
        kl_ref[...] = jnp.where(lx_sc[...] > 0, acc_sc[...], 0.0)
        lsex_ref[...] = lsex_sc[...]
        lsem_ref[...] = lsem_sc[...]


def _query_outer_specs(m, d, di, blk, nslots):
    """BlockSpecs of (q, k, qi, ki, kv pos, kv seg) for grid (b, g, t, slot); the slot axis may run
    over several passes of the 2K slots (taken modulo nslots)."""
    q_map = lambda b, g_, t, j, *_: (b, t, g_, 0, 0)  # noqa: E731
    tl = lambda tl_, b, g_, t, j: tl_[b, g_, t, jax.lax.rem(j, nslots)]  # noqa: E731
    k_map = lambda b, g_, t, j, tl_, *_: (b, g_, tl(tl_, b, g_, t, j), 0)  # noqa: E731
    ki_map = lambda b, g_, t, j, tl_, *_: (b, tl(tl_, b, g_, t, j), 0)  # noqa: E731
    pos_map = lambda b, g_, t, j, tl_, *_: (b, tl(tl_, b, g_, t, j), 0, 0)  # noqa: E731
    return q_map, [pl.BlockSpec((None, None, None, m, d), q_map),
                   pl.BlockSpec((None, None, blk, d), k_map),
                   pl.BlockSpec((None, None, None, 1, di), q_map),
                   pl.BlockSpec((None, blk, di), ki_map),
                   pl.BlockSpec((None, None, blk, 1), pos_map),
                   pl.BlockSpec((None, None, blk, 1), pos_map)]


def _fwd_chunk(c, a, e, *, interpret):
    q5, kt, qi5 = c["q5"][:, a:e], c["kt"], c["qi5"][:, a:e]
    bsz, tc, g, m, d = q5.shape
    di = qi5.shape[-1]
    blk = c["blk"]
    nslots = c["tiles"].shape[-1]
    kernel = functools.partial(_fwd_kernel, nslots=nslots, hg=c["hg"], consts=c["consts"])
    q_map, in_specs = _query_outer_specs(m, d, di, blk, nslots)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(bsz, g, tc, 2 * nslots),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, 1, 1), q_map),
                   pl.BlockSpec((None, None, None, 1, 1), q_map),
                   pl.BlockSpec((None, None, None, 1, m), q_map)],
        scratch_shapes=[pltpu.VMEM((1, m), _F32), pltpu.VMEM((1, m), _F32),
                        pltpu.VMEM((1, 1), _F32), pltpu.VMEM((1, 1), _F32),
                        pltpu.VMEM((1, m), _F32), pltpu.VMEM((1, 1), _F32),
                        pltpu.VMEM((1, 1), _F32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((bsz, tc, g, 1, 1), _F32),
                   jax.ShapeDtypeStruct((bsz, tc, g, 1, 1), _F32),
                   jax.ShapeDtypeStruct((bsz, tc, g, 1, m), _F32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="msa_kl_fwd_tpu",
    )(c["tiles"][:, :, a:e], c["act"][:, :, a:e], c["ids"][:, :, a:e], c["qpos"][:, a:e],
      c["qseg"][:, a:e], q5, kt, qi5, c["kip"], c["kvp"], c["kvs"])


# ----------------------------------------------------------------------------- backward: d qi

def _dqi_kernel(tiles_ref, act_ref, ids_ref, qpos_ref, qseg_ref,
                q_ref, k_ref, qi_ref, ki_ref, kvp_ref, kvs_ref, lsem_ref, lsex_ref,
                dqi_ref, acc_sc, *, nslots, hg, consts):
    b, g, t, j = (pl.program_id(i) for i in range(4))

    @pl.when(j == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    @pl.when(act_ref[b, g, t, j] != 0)
    def _step():
        n = ids_ref[b, g, t, jax.lax.div(j, 2)]
        s, x, vis = _tile(q_ref, k_ref, qi_ref, ki_ref, kvp_ref, kvs_ref, n, qpos_ref[b, t],
                          qseg_ref[b, t], **consts)
        dx = _p_minus_t(s, x, vis, lsem_ref[...], lsex_ref[...], hg)           # [blk, 1]
        acc_sc[...] += jnp.sum(dx * ki_ref[...].astype(_F32), axis=0, keepdims=True)

    @pl.when(j == nslots - 1)
    def _fin():
        dqi_ref[...] = acc_sc[...]


def _dqi_chunk(c, lsem5, lsex5, a, e, *, interpret):
    q5, qi5 = c["q5"][:, a:e], c["qi5"][:, a:e]
    bsz, tc, g, m, d = q5.shape
    di = qi5.shape[-1]
    nslots = c["tiles"].shape[-1]
    kernel = functools.partial(_dqi_kernel, nslots=nslots, hg=c["hg"], consts=c["consts"])
    q_map, in_specs = _query_outer_specs(m, d, di, c["blk"], nslots)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(bsz, g, tc, nslots),
        in_specs=in_specs + [pl.BlockSpec((None, None, None, 1, m), q_map),
                             pl.BlockSpec((None, None, None, 1, 1), q_map)],
        out_specs=pl.BlockSpec((None, None, None, 1, di), q_map),
        scratch_shapes=[pltpu.VMEM((1, di), _F32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((bsz, tc, g, 1, di), _F32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="msa_kl_dqi_tpu",
    )(c["tiles"][:, :, a:e], c["act"][:, :, a:e], c["ids"][:, :, a:e], c["qpos"][:, a:e],
      c["qseg"][:, a:e], q5, c["kt"], qi5, c["kip"], c["kvp"], c["kvs"], lsem5[:, a:e],
      lsex5[:, a:e])


# ----------------------------------------------------------------------------- backward: d ki

def _ki_entries(ids, starts, blk, n_tiles):
    """Selections of all groups sorted by storage tile (stable), plus one inactive entry per tile.

    Returns int32 [B, E] tables (E = n_tiles + 2 * G * T * K): tile, group, token, block id (-1 when
    inactive) and flags (bit0 first entry of its tile, bit1 last, bit2 active).
    """
    bsz, g, t, k = ids.shape
    gtk = g * t * k
    valid = ids >= 0
    tile_a = starts // blk
    mis = (starts % blk) != 0
    t0 = jnp.where(valid, tile_a, n_tiles).reshape(bsz, gtk)
    t1 = jnp.where(valid & mis, tile_a + 1, n_tiles).reshape(bsz, gtk)
    dummy = jnp.broadcast_to(jnp.arange(n_tiles, dtype=jnp.int32), (bsz, n_tiles))
    tiles = jnp.concatenate([dummy, t0, t1], axis=-1).astype(jnp.int32)
    flat = jnp.arange(gtk, dtype=jnp.int32)
    flat = jnp.concatenate([jnp.full((n_tiles,), -1, jnp.int32), flat, flat])
    flat = jnp.broadcast_to(flat, tiles.shape)
    tiles, flat = jax.lax.sort((tiles, flat), dimension=1, num_keys=1, is_stable=True)
    active = (tiles < n_tiles) & (flat >= 0)
    etile = jnp.minimum(tiles, n_tiles - 1)
    f = jnp.maximum(flat, 0)
    eg = jnp.where(active, f // (t * k), 0)
    et = jnp.where(active, (f // k) % t, 0)
    en = jnp.where(active, jnp.take_along_axis(ids.reshape(bsz, gtk), f, axis=-1), -1)
    prev = jnp.concatenate([jnp.full((bsz, 1), -1, jnp.int32), etile[:, :-1]], axis=-1)
    nxt = jnp.concatenate([etile[:, 1:], jnp.full((bsz, 1), -1, jnp.int32)], axis=-1)
    flags = ((etile != prev).astype(jnp.int32) + 2 * (etile != nxt).astype(jnp.int32)
             + 4 * active.astype(jnp.int32))
    return tuple(x.astype(jnp.int32) for x in (etile, eg, et, en, flags))


def _dki_kernel(etile_ref, eg_ref, et_ref, en_ref, eflag_ref, qpos_ref, qseg_ref,
                q_ref, k_ref, qi_ref, ki_ref, kvp_ref, kvs_ref, lsem_ref, lsex_ref,
                dki_ref, acc_sc, *, hg, consts):
    b, e = pl.program_id(0), pl.program_id(1)
    flag = eflag_ref[b, e]

    @pl.when((flag & 1) != 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    @pl.when((flag & 4) != 0)
    def _step():
        t = et_ref[b, e]
        s, x, vis = _tile(q_ref, k_ref, qi_ref, ki_ref, kvp_ref, kvs_ref, en_ref[b, e],
                          qpos_ref[b, t], qseg_ref[b, t], **consts)
        dx = _p_minus_t(s, x, vis, lsem_ref[...], lsex_ref[...], hg)           # [blk, 1]
        acc_sc[...] += dx * qi_ref[...].astype(_F32)                         # [blk, Di]

    @pl.when((flag & 2) != 0)
    def _fin():
        dki_ref[...] = acc_sc[...]


def _dki_call(c, lsem5, lsex5, *, interpret):
    bsz, t, g, m, d = c["q5"].shape
    di = c["qi5"].shape[-1]
    blk = c["blk"]
    etile, eg, et, en, ef = _ki_entries(c["ids"], c["starts"], blk, c["nt"])
    kernel = functools.partial(_dki_kernel, hg=c["hg"], consts=c["consts"])
    q_map = lambda b, e, etl, egr, ett, *_: (b, ett[b, e], egr[b, e], 0, 0)  # noqa: E731
    k_map = lambda b, e, etl, egr, *_: (b, egr[b, e], etl[b, e], 0)  # noqa: E731
    ki_map = lambda b, e, etl, *_: (b, etl[b, e], 0)  # noqa: E731
    pos_map = lambda b, e, etl, *_: (b, etl[b, e], 0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(bsz, etile.shape[-1]),
        in_specs=[pl.BlockSpec((None, None, None, m, d), q_map),
                  pl.BlockSpec((None, None, blk, d), k_map),
                  pl.BlockSpec((None, None, None, 1, di), q_map),
                  pl.BlockSpec((None, blk, di), ki_map),
                  pl.BlockSpec((None, None, blk, 1), pos_map),
                  pl.BlockSpec((None, None, blk, 1), pos_map),
                  pl.BlockSpec((None, None, None, 1, m), q_map),
                  pl.BlockSpec((None, None, None, 1, 1), q_map)],
        out_specs=pl.BlockSpec((None, blk, di), ki_map),
        scratch_shapes=[pltpu.VMEM((blk, di), _F32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(c["kip"].shape, _F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="msa_kl_dki_tpu",
    )(etile, eg, et, en, ef, c["qpos"], c["qseg"], c["q5"], c["kt"], c["qi5"], c["kip"],
      c["kvp"], c["kvs"], lsem5, lsex5)


# ----------------------------------------------------------------------------- wrappers

def _setup(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk):
    bsz, t, h, d = q.shape
    g = k.shape[2]
    hg = h // g
    m = -(-hg // 8) * 8
    prep = layout.prepare(k, ki[:, :, None, :], q_positions, kv_positions, q_seg, kv_seg, blk)
    ids = layout.dedupe_ids(block_ids)
    starts = layout.window_starts(ids, prep.base, blk, prep.s_pad)
    nt = prep.s_pad // blk
    tiles, act = _slot_tables(ids, starts, blk)
    return dict(
        blk=blk, hg=hg, nt=nt, ids=ids, starts=starts, tiles=tiles, act=act,
        q5=_group(jax.lax.stop_gradient(q), g, m),
        kt=jnp.transpose(jax.lax.stop_gradient(prep.k), (0, 2, 1, 3)),
        qi5=qi[:, :, :, None, :], kip=prep.v[:, :, 0, :],
        kvp=prep.kv_pos.reshape(bsz, nt, blk, 1), kvs=prep.kv_seg.reshape(bsz, nt, blk, 1),
        qpos=q_positions.astype(jnp.int32), qseg=prep.q_seg,
        consts=dict(blk=blk, scale=1.0 / math.sqrt(d), iscale=1.0 / math.sqrt(qi.shape[-1])))


def _forward(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret,
             t_chunk):
    c = _setup(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk)
    outs = [_fwd_chunk(c, a, e, interpret=interpret) for a, e in _chunks(q.shape[1], t_chunk)]
    kl5, lsex5, lsem5 = (jnp.concatenate([o[i] for o in outs], axis=1) for i in range(3))
    count = jnp.sum(jnp.isfinite(lsex5).astype(jnp.int32))
    return jnp.sum(kl5), count, (lsex5, lsem5)


def _backward(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, lsex5, lsem5,
              ct, blk, interpret, t_chunk):
    c = _setup(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk)
    mult = ct.astype(_F32) * c["consts"]["iscale"]
    dqi5 = jnp.concatenate([_dqi_chunk(c, lsem5, lsex5, a, e, interpret=interpret)
                            for a, e in _chunks(q.shape[1], t_chunk)], axis=1)
    dki = _dki_call(c, lsem5, lsex5, interpret=interpret)
    dqi = (dqi5[:, :, :, 0, :] * mult).astype(qi.dtype)
    dki = (dki[:, :ki.shape[1]] * mult).astype(ki.dtype)
    return dqi, dki


def _f0(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def _kl(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret, t_chunk):
    kl, count, _ = _forward(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg,
                            blk, interpret, t_chunk)
    return kl, count


def _kl_fwd(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret,
            t_chunk):
    kl, count, (lsex5, lsem5) = _forward(q, k, qi, ki, block_ids, q_positions, kv_positions,
                                         q_seg, kv_seg, blk, interpret, t_chunk)
    return (kl, count), (q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg,
                         lsex5, lsem5)


def _kl_bwd(blk, interpret, t_chunk, res, cot):
    q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, lsex5, lsem5 = res
    ct, _ = cot
    dqi, dki = _backward(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg,
                         lsex5, lsem5, ct, blk, interpret, t_chunk)
    return (jnp.zeros_like(q), jnp.zeros_like(k), dqi, dki, _f0(block_ids), _f0(q_positions),
            _f0(kv_positions), _f0(q_seg), _f0(kv_seg))


_kl.defvjp(_kl_fwd, _kl_bwd)


def indexer_kl_tpu(q, k, qi, ki, block_ids, *, q_positions, kv_positions, q_segment_ids=None,
                   kv_segment_ids=None, block_size=None, interpret=False, t_chunk=512):
    """Indexer KL(teacher || student) on the selected support, Pallas Mosaic TPU kernels.

    Args:
      q [B,T,H,D], k [B,S,G,D]: main branch (bf16/f32; no gradient reaches them: zero cotangents).
      qi [B,T,G,Di], ki [B,S,Di]: index branch (gradients flow here, in their own dtypes).
      block_ids int [B,G,T,K] (-1 = empty slot, duplicates count once), as from msa_select_blocks.
      q_positions [B,T], kv_positions [B,S] int; q_segment_ids [B,T] / kv_segment_ids [B,S] int or
        both None (layout.py conventions: each segment's keys one contiguous run; T <= S, queries
        anywhere, e.g. a suffix of the keys).
      block_size: tokens per block; a multiple of 128 on a real TPU (lane-dense key tiles), any
        multiple of 8 in interpret mode.
      interpret: False (Mosaic TPU), True (plain Pallas interpreter, CPU) or a
        ``pltpu.InterpretParams`` (TPU-semantics interpreter, e.g. detect_races=True).
      t_chunk: queries per forward / d qi kernel call (bounds the SMEM tables).
    Returns: (kl_sum f32 [], count int32 []) as minimax_jax.ops.msa.indexer_kl: the sum of
      KL(teacher || student) over (b, i, r) and the number of (b, i, r) with a non-empty support.
    Raises: ValueError for block_ids=None (the dense warm-up has no kernel). Other preconditions
      (shapes, a block_size that is a positive multiple of 8) are asserted; the ops layer checks
      them for its callers.
    Math: MSA_SPEC.md section 4 (see the module docstring).
    """
    if block_ids is None:
        raise ValueError("indexer_kl_tpu covers the sparse support only; the dense warm-up "
                         "(block_ids=None) has no kernel")
    assert block_size is not None and block_size > 0 and block_size % 8 == 0, \
        f"block_size must be a positive multiple of 8, got {block_size}"
    layout.check_shapes(q, k, k, block_ids, q_positions, kv_positions, q_segment_ids,
                        kv_segment_ids)
    assert qi.ndim == 4 and qi.shape[:3] == (q.shape[0], q.shape[1], k.shape[2]), \
        f"qi shape {qi.shape} must be [B, T, G={k.shape[2]}, Di]"
    assert ki.ndim == 3 and ki.shape == (k.shape[0], k.shape[1], qi.shape[-1]), \
        f"ki shape {ki.shape} must be [B, S={k.shape[1]}, Di={qi.shape[-1]}]"
    return _kl(q, k, qi, ki, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
               block_size, interpret, t_chunk)
