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
- forward, grid (g, t, 2 * 2K) per query chunk: slots [0, 2K) are pass 1 (online max / sum of
  every head and of the student: log-sum-exps), slots [2K, 4K) re-walk the same tiles for pass 2
  (the KL, which needs the final teacher probabilities: the log of a mean over heads does not
  decompose online). One (token, group) per grid step sequence; outputs kl [B,T,G], lse_x
  [B,T,G], lse_m [B,T,G,M] (the last two are the backward's residuals).
- d qi, grid (g, t, 2K): same walk, accumulates sum_j (p_j - t_j) ki_j in a [1, Di] scratch.
- d ki, KV-outer, grid (e,) over a fixed window of the selections of ALL groups sorted by storage
  tile (stable sort of the (group, token, slot) entries, plus one inactive entry per tile so every
  output tile is written), one grid step per entry, accumulating (p - t) x qi_r into a
  [block_size, Di] VMEM scratch while consecutive entries hit the same tile; the output tile is
  written at the last entry of its run (a run cut by a window edge continues from an f32 carry).
Each kernel is one pallas_call inside one ``lax.fori_loop`` at any T (tpu_common.py: query chunks
for fwd / d qi, entry windows for d ki); scalar-prefetch tables <= 240 KiB of int32 per call.
Determinism: no atomics anywhere; d ki is KV-outer (chosen over per-selection contributions +
XLA segment-sum, which would write O(T * G * K * block_size * Di) floats to HBM), every sum is in
a fixed order (the sorted entry order is a pure function of block_ids), so the loss and both
gradients are bitwise repeatable. q and k get zero cotangents.
Dense warm-up (block_ids=None) has no kernel here (ValueError).
Limitations: one (token, group) per grid step (MXU rows = H/G heads; like tpu_attention.py).
Checked in interpret mode and by Mosaic lowering (jax.export, platforms=["tpu"]) only.
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
from pallas_kernels.msa.tpu_common import dot_t

__all__ = ["indexer_kl_tpu"]

_F32 = jnp.float32


def _tile(q_ref, k_ref, qi_ref, ki_ref, vis, *, scale, iscale):
    """Teacher logits s [blk, M] (-inf off-support) and student logits x [blk, 1]."""
    s = jnp.where(vis, dot_t(k_ref[...], q_ref[...]) * scale, -jnp.inf)
    x = jnp.sum(ki_ref[...].astype(_F32) * qi_ref[...].astype(_F32), axis=1, keepdims=True) * iscale
    return s, x


def _vis_block(kvp_ref, kvs_ref, n, q_pos, q_seg, blk):
    """[blk, 1] support of block n of a query (segment, causal, block membership)."""
    kvp = kvp_ref[...]
    kvs = kvs_ref[...]
    return ((n >= 0) & (kvs == q_seg) & (kvs >= 0) & (kvp <= q_pos)
            & (kvp >= n * blk) & (kvp < n * blk + blk))


def _teacher(s, lse_m, hg):
    """Mean over the group's heads of the renormalised main-branch probabilities: [blk, 1]."""
    return jnp.sum(jnp.exp(s - lse_m), axis=1, keepdims=True) * (1.0 / hg)


def _p_minus_t(s, x, vis, lse_m, lse_x, hg):
    p = jnp.where(vis, jnp.exp(x - lse_x), 0.0)
    return p - _teacher(s, lse_m, hg)                               # [blk, 1]


# ----------------------------------------------------------------------------- forward

def _fwd_kernel(scal_ref, tiles_ref, act_ref, ids_ref, qpos_ref, qseg_ref,
                q_ref, k_ref, qi_ref, ki_ref, kvp_ref, kvs_ref, kl_alias, lsex_alias, lsem_alias,
                kl_ref, lsex_ref, lsem_ref,
                m_sc, l_sc, mx_sc, lx_sc, lsem_sc, lsex_sc, acc_sc, *, tc, nslots, hg, consts):
    del scal_ref, tiles_ref, kl_alias, lsex_alias, lsem_alias
    g, t, j = (pl.program_id(i) for i in range(3))
    slot = jax.lax.rem(j, nslots)
    flat, sid = tc_.slot_index(tc, nslots)
    active = act_ref[flat(g, t, slot)] != 0

    def tile():
        vis = _vis_block(kvp_ref, kvs_ref, ids_ref[sid(g, t, slot)], qpos_ref[t], qseg_ref[t],
                         consts["blk"])
        s, x = _tile(q_ref, k_ref, qi_ref, ki_ref, vis, scale=consts["scale"],
                     iscale=consts["iscale"])
        return s, x, vis

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


def _query_outer_specs(m, d, di, blk, tc, nslots):
    """BlockSpecs of (q, k, qi, ki, kv pos, kv seg) for grid (g, t, slot) of one query chunk (batch
    row and chunk origin from the ``scal`` table); the slot axis may run over several passes of the
    2K slots (taken modulo nslots)."""
    flat, _ = tc_.slot_index(tc, nslots)
    q_map = lambda g, t, j, sc, *_: (sc[0], sc[1] + t, g, 0, 0)  # noqa: E731
    tl = lambda tl_, g, t, j: tl_[flat(g, t, jax.lax.rem(j, nslots))]  # noqa: E731
    k_map = lambda g, t, j, sc, tl_, *_: (sc[0], g, tl(tl_, g, t, j), 0)  # noqa: E731
    ki_map = lambda g, t, j, sc, tl_, *_: (sc[0], tl(tl_, g, t, j), 0)  # noqa: E731
    pos_map = lambda g, t, j, sc, tl_, *_: (sc[0], tl(tl_, g, t, j), 0, 0)  # noqa: E731
    return q_map, [pl.BlockSpec((None, None, None, m, d), q_map),
                   pl.BlockSpec((None, None, blk, d), k_map),
                   pl.BlockSpec((None, None, None, 1, di), q_map),
                   pl.BlockSpec((None, blk, di), ki_map),
                   pl.BlockSpec((None, None, blk, 1), pos_map),
                   pl.BlockSpec((None, None, blk, 1), pos_map)]


_QUERY_OUTER = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _fwd_call(tabs, c, bufs, *, tc, interpret):
    g, m, d = c["q5"].shape[2:]
    di = c["qi5"].shape[-1]
    nslots = 2 * c["ids"].shape[-1]
    kernel = functools.partial(_fwd_kernel, tc=tc, nslots=nslots, hg=c["hg"], consts=c["consts"])
    q_map, in_specs = _query_outer_specs(m, d, di, c["blk"], tc, nslots)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(tabs),
        grid=(g, tc, 2 * nslots),
        in_specs=in_specs + [tc_.aliased()] * 3,
        out_specs=[pl.BlockSpec((None, None, None, 1, 1), q_map),
                   pl.BlockSpec((None, None, None, 1, 1), q_map),
                   pl.BlockSpec((None, None, None, 1, m), q_map)],
        scratch_shapes=[pltpu.VMEM((1, m), _F32), pltpu.VMEM((1, m), _F32),
                        pltpu.VMEM((1, 1), _F32), pltpu.VMEM((1, 1), _F32),
                        pltpu.VMEM((1, m), _F32), pltpu.VMEM((1, 1), _F32),
                        pltpu.VMEM((1, 1), _F32)],
    )
    n_in = len(tabs) + 6
    return tuple(pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(x.shape, _F32) for x in bufs],
        input_output_aliases={n_in: 0, n_in + 1: 1, n_in + 2: 2},
        compiler_params=_QUERY_OUTER,
        interpret=interpret,
        name="msa_kl_fwd_tpu",
    )(*tabs, c["q5"], c["kt"], c["qi5"], c["kip"], c["kvp"], c["kvs"], *bufs))


# ----------------------------------------------------------------------------- backward: d qi

def _dqi_kernel(scal_ref, tiles_ref, act_ref, ids_ref, qpos_ref, qseg_ref,
                q_ref, k_ref, qi_ref, ki_ref, kvp_ref, kvs_ref, lsem_ref, lsex_ref, dqi_alias,
                dqi_ref, acc_sc, *, tc, nslots, hg, consts):
    del scal_ref, tiles_ref, dqi_alias
    g, t, j = (pl.program_id(i) for i in range(3))
    flat, sid = tc_.slot_index(tc, nslots)

    @pl.when(j == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    @pl.when(act_ref[flat(g, t, j)] != 0)
    def _step():
        vis = _vis_block(kvp_ref, kvs_ref, ids_ref[sid(g, t, j)], qpos_ref[t], qseg_ref[t],
                         consts["blk"])
        s, x = _tile(q_ref, k_ref, qi_ref, ki_ref, vis, scale=consts["scale"],
                     iscale=consts["iscale"])
        dx = _p_minus_t(s, x, vis, lsem_ref[...], lsex_ref[...], hg)           # [blk, 1]
        acc_sc[...] += jnp.sum(dx * ki_ref[...].astype(_F32), axis=0, keepdims=True)

    @pl.when(j == nslots - 1)
    def _fin():
        dqi_ref[...] = acc_sc[...]


def _dqi_call(tabs, c, lsem5, lsex5, dqi5, *, tc, interpret):
    g, m, d = c["q5"].shape[2:]
    di = c["qi5"].shape[-1]
    nslots = 2 * c["ids"].shape[-1]
    kernel = functools.partial(_dqi_kernel, tc=tc, nslots=nslots, hg=c["hg"], consts=c["consts"])
    q_map, in_specs = _query_outer_specs(m, d, di, c["blk"], tc, nslots)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(tabs),
        grid=(g, tc, nslots),
        in_specs=in_specs + [pl.BlockSpec((None, None, None, 1, m), q_map),
                             pl.BlockSpec((None, None, None, 1, 1), q_map), tc_.aliased()],
        out_specs=pl.BlockSpec((None, None, None, 1, di), q_map),
        scratch_shapes=[pltpu.VMEM((1, di), _F32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(dqi5.shape, _F32),
        input_output_aliases={len(tabs) + 8: 0},
        compiler_params=_QUERY_OUTER,
        interpret=interpret,
        name="msa_kl_dqi_tpu",
    )(*tabs, c["q5"], c["kt"], c["qi5"], c["kip"], c["kvp"], c["kvs"], lsem5, lsex5, dqi5)


# ----------------------------------------------------------------------------- backward: d ki

def _dki_kernel(tile_ref, qrow_ref, lo_ref, hi_ref, qseg_ref, flag_ref,
                q_ref, k_ref, qi_ref, ki_ref, kvp_ref, kvs_ref, lsem_ref, lsex_ref, carry_ref,
                dki_alias, dki_ref, carry_out, acc_sc, *, hg, consts, width):
    del tile_ref, qrow_ref, dki_alias
    e = pl.program_id(0)
    flag = flag_ref[e]            # bit0 first of its tile, bit1 last, bit2 active
    first = (flag & 1) != 0

    @pl.when(first)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    @pl.when((e == 0) & jnp.logical_not(first))
    def _resume():                # the tile's run began in the previous window
        acc_sc[...] = carry_ref[...]

    @pl.when((flag & 4) != 0)
    def _step():
        kvp = kvp_ref[...]
        kvs = kvs_ref[...]
        vis = (kvs == qseg_ref[e]) & (kvs >= 0) & (kvp >= lo_ref[e]) & (kvp <= hi_ref[e])
        s, x = _tile(q_ref, k_ref, qi_ref, ki_ref, vis, scale=consts["scale"],
                     iscale=consts["iscale"])
        dx = _p_minus_t(s, x, vis, lsem_ref[...], lsex_ref[...], hg)           # [blk, 1]
        acc_sc[...] += dx * qi_ref[...].astype(_F32)                         # [blk, Di]

    @pl.when(((flag & 2) != 0) | (e == width - 1))
    def _fin():                   # a run cut by the window edge is written again by a later call
        dki_ref[...] = acc_sc[...]

    @pl.when(e == width - 1)
    def _carry():
        carry_out[...] = acc_sc[...]


def _dki_call(tabs, r, carry, dki, *, g, nt, hg, consts, interpret):
    m, d = r["q"].shape[-2:]
    di = r["qi"].shape[-1]
    blk = consts["blk"]
    width = tabs[0].shape[0]
    kernel = functools.partial(_dki_kernel, hg=hg, consts=consts, width=width)
    q_map = lambda e, tl, qr, *_: (qr[e], 0, 0)  # noqa: E731
    k_map = lambda e, tl, qr, *_: (  # noqa: E731
        (jax.lax.div(tl[e], nt) * g + jax.lax.rem(qr[e], g)) * nt + jax.lax.rem(tl[e], nt), 0, 0)
    ki_map = lambda e, tl, *_: (tl[e], 0, 0)  # noqa: E731
    fixed = lambda e, *_: (0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(tabs),
        grid=(width,),
        in_specs=[pl.BlockSpec((None, m, d), q_map),
                  pl.BlockSpec((None, blk, d), k_map),
                  pl.BlockSpec((None, 1, di), q_map),
                  pl.BlockSpec((None, blk, di), ki_map),
                  pl.BlockSpec((None, blk, 1), ki_map),
                  pl.BlockSpec((None, blk, 1), ki_map),
                  pl.BlockSpec((None, 1, m), q_map),
                  pl.BlockSpec((None, 1, 1), q_map),
                  pl.BlockSpec((blk, di), fixed),
                  tc_.aliased()],
        out_specs=[pl.BlockSpec((None, blk, di), ki_map), pl.BlockSpec((blk, di), fixed)],
        scratch_shapes=[pltpu.VMEM((blk, di), _F32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(dki.shape, _F32), jax.ShapeDtypeStruct(carry.shape, _F32)],
        input_output_aliases={len(tabs) + 9: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="msa_kl_dki_tpu",
    )(*tabs, r["q"], r["k"], r["qi"], r["ki"], r["kvp"], r["kvs"], r["lsem"], r["lsex"], carry, dki)


# ----------------------------------------------------------------------------- wrappers

def _setup(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk):
    bsz, t, h, d = q.shape
    g = k.shape[2]
    hg = h // g
    m = -(-hg // 8) * 8
    prep = layout.prepare(k, ki[:, :, None, :], q_positions, kv_positions, q_seg, kv_seg, blk)
    nt = prep.s_pad // blk
    return dict(
        blk=blk, hg=hg, nt=nt, prep=prep, ids=layout.dedupe_ids(block_ids),
        q5=tc_.group_heads(jax.lax.stop_gradient(q), g, m),
        kt=jnp.transpose(jax.lax.stop_gradient(prep.k), (0, 2, 1, 3)),
        qi5=qi[:, :, :, None, :], kip=prep.v[:, :, 0, :],
        kvp=prep.kv_pos.reshape(bsz, nt, blk, 1), kvs=prep.kv_seg.reshape(bsz, nt, blk, 1),
        qpos=q_positions.astype(jnp.int32), qseg=prep.q_seg,
        consts=dict(blk=blk, scale=1.0 / math.sqrt(d), iscale=1.0 / math.sqrt(qi.shape[-1])))


def _forward(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret):
    c = _setup(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk)
    bsz, t, g, m = c["q5"].shape[:4]
    bufs = (jnp.zeros((bsz, t, g, 1, 1), _F32), jnp.zeros((bsz, t, g, 1, 1), _F32),
            jnp.zeros((bsz, t, g, 1, m), _F32))
    call = lambda tabs, bufs, tc: _fwd_call(tabs, c, bufs, tc=tc, interpret=interpret)  # noqa: E731
    kl5, lsex5, lsem5 = tc_.query_loop(c["ids"], c["prep"], c["qpos"], c["blk"], call, bufs)
    count = jnp.sum(jnp.isfinite(lsex5).astype(jnp.int32))
    return jnp.sum(kl5), count, (lsex5, lsem5)


def _backward(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, lsex5, lsem5,
              ct, blk, interpret):
    c = _setup(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk)
    bsz, t, g, m, d = c["q5"].shape
    di, nt, prep = qi.shape[-1], c["nt"], c["prep"]
    mult = ct.astype(_F32) * c["consts"]["iscale"]
    call = lambda tabs, dqi5, tc: _dqi_call(tabs, c, lsem5, lsex5, dqi5, tc=tc,  # noqa: E731
                                            interpret=interpret)
    dqi5 = tc_.query_loop(c["ids"], prep, c["qpos"], blk, call,
                            jnp.zeros((bsz, t, g, 1, di), _F32))

    starts = layout.window_starts(c["ids"], prep.base, blk, prep.s_pad)
    tables, n_windows = tc_.sorted_entries(c["ids"], starts, c["qpos"], c["qseg"], blk, nt,
                                           per_group=False)
    rows = bsz * t * g
    r = dict(q=c["q5"].reshape(rows, m, d), k=c["kt"].reshape(bsz * g * nt, blk, d),
             qi=c["qi5"].reshape(rows, 1, di), ki=c["kip"].reshape(bsz * nt, blk, di),
             kvp=c["kvp"].reshape(bsz * nt, blk, 1), kvs=c["kvs"].reshape(bsz * nt, blk, 1),
             lsem=lsem5.reshape(rows, 1, m), lsex=lsex5.reshape(rows, 1, 1))

    def body(i, bufs):
        dki, carry = _dki_call(tc_.window(tables, i), r, *bufs, g=g, nt=nt, hg=c["hg"],
                               consts=c["consts"], interpret=interpret)
        return carry, dki
    bufs = (jnp.zeros((blk, di), _F32), jnp.zeros((bsz * nt, blk, di), _F32))
    _, dki = jax.lax.fori_loop(0, n_windows, body, bufs)
    dqi = (dqi5[:, :, :, 0, :] * mult).astype(qi.dtype)
    dki = (dki.reshape(bsz, prep.s_pad, di)[:, :ki.shape[1]] * mult).astype(ki.dtype)
    return dqi, dki


def _f0(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def _kl(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret):
    kl, count, _ = _forward(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg,
                            blk, interpret)
    return kl, count


def _kl_fwd(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret):
    kl, count, (lsex5, lsem5) = _forward(q, k, qi, ki, block_ids, q_positions, kv_positions,
                                         q_seg, kv_seg, blk, interpret)
    return (kl, count), (q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg,
                         lsex5, lsem5)


def _kl_bwd(blk, interpret, res, cot):
    q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, lsex5, lsem5 = res
    ct, _ = cot
    dqi, dki = _backward(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg,
                         lsex5, lsem5, ct, blk, interpret)
    return (jnp.zeros_like(q), jnp.zeros_like(k), dqi, dki, _f0(block_ids), _f0(q_positions),
            _f0(kv_positions), _f0(q_seg), _f0(kv_seg))


_kl.defvjp(_kl_fwd, _kl_bwd)


def indexer_kl_tpu(q, k, qi, ki, block_ids, *, q_positions, kv_positions, q_segment_ids=None,
                   kv_segment_ids=None, block_size=None, interpret=False):
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
               block_size, interpret)
