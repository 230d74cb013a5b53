"""MSA indexer KL loss on GPU (Pallas, Triton lowering), sparse support; forward and backward.

Math (MSA_SPEC.md section 4; minimax_jax.ops.msa.kl is the reference): for query i and group r the
support U is the visible keys of the selected blocks block_ids[b, r, i, :].
  teacher t_j = mean over the group's H/G heads of softmax_U(q_h . k_j / sqrt(D))   (no gradient)
  student p_j = softmax_U(qi_r . ki_j / sqrt(Di))
  KL(t || p) = sum_j t_j (log t_j - log p_j);  d KL / d x_j = p_j - t_j  (x = student logits).
Returns (sum of KL over (b, i, r), number of rows with a non-empty support).

Kernels: forward, one program per (token, group, batch row): pass 1 over the selected blocks gets
each head's and the student's log-sum-exp (online), pass 2 accumulates the KL. The group's heads
form the M rows of the q.k matmul; the student logits (one index head) are an elementwise product
summed over Di. Backward: d qi with the same query-outer program; d ki KV-outer: one program per
(key tile, batch row) walks, for every group, the selections that touch its tile (the stable
sorted inverse map, ``_inverse_map``), so the shared index key's gradient needs no atomics and is
bitwise deterministic. Dense warm-up (block_ids=None) has no kernel (ValueError).

The group's H/G heads are padded to M = max(16, next_pow2(H/G)) rows (the smallest tensor-core
tile) only in registers: q and the per-head teacher log-sum-exp (lse_m, a forward residual) are read
and written in their natural [B,T,H,...] layout, rows ``g*H/G + [0, M)`` with a row mask (as
``_load_group`` below; masked-off rows load 0 for q, +inf for lse_m, and are never
stored). No [B,T,G,M,...] copy is materialised in HBM: at M2 shapes (H/G = 6 -> M = 16) a padded q
was 2.7x q (32 GiB at T = 1M).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import searchsorted
from pallas_kernels.msa import layout

__all__ = ["indexer_kl_gpu"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _mask(kvp, kvs, n, q_pos, q_seg, blk):
    """Visibility of the B loaded keys for one query and selected block id n: bool [B]."""
    return ((n >= 0) & (kvs == q_seg) & (kvs >= 0) & (kvp <= q_pos)
            & (kvp >= n * blk) & (kvp < n * blk + blk))


def _group_rows(ref, b, t, g, hg, m_pad):
    """(ref view of rows g*hg .. g*hg+m_pad of token t, row mask or None), for [B,T,H,...] refs.

    The view is the group's M = m_pad rows in the natural [B,T,H,...] layout; rows >= hg (another
    group's heads, or past the end of the array for the last group) are masked (mask None when
    hg == m_pad: every row is the group's own).
    """
    view = ref.at[(b, t, pl.ds(g * hg, m_pad)) + (slice(None),) * (len(ref.shape) - 3)]
    if hg == m_pad:
        return view, None
    return view, jax.lax.broadcasted_iota(jnp.int32, view.shape, 0) < hg


def _load_group(ref, b, t, g, hg, m_pad, fill=0.0):
    """The group's M rows of token t of a [B,T,H,...] ref; rows >= hg read as ``fill``."""
    view, mask = _group_rows(ref, b, t, g, hg, m_pad)
    if mask is None:
        return view[...]
    return pltriton.load(view, mask=mask, other=jnp.asarray(fill, ref.dtype))


def _store_group(ref, b, t, g, hg, m_pad, val):
    """Write the group's first hg of M rows of ``val`` into token t of a [B,T,H,...] ref."""
    view, mask = _group_rows(ref, b, t, g, hg, m_pad)
    if mask is None:
        view[...] = val
    else:
        pltriton.store(view, val, mask=mask)


def _inverse_map(block_ids, starts, blk, n_tiles):
    """Sort the selections by storage tile: entries [B,G,2TK] (t*K+slot), offsets [B,G,NT+1]."""
    bsz, g, t, k = block_ids.shape
    valid = block_ids >= 0
    tile_a = starts // blk
    misaligned = (starts % blk) != 0
    t0 = jnp.where(valid, tile_a, n_tiles).reshape(bsz, g, t * k)
    t1 = jnp.where(valid & misaligned, tile_a + 1, n_tiles).reshape(bsz, g, t * k)
    tiles = jnp.concatenate([t0, t1], axis=-1)
    flat = jnp.arange(t * k, dtype=jnp.int32)
    flat = jnp.broadcast_to(jnp.concatenate([flat, flat]), tiles.shape)
    tiles, flat = jax.lax.sort((tiles, flat), dimension=2, num_keys=1, is_stable=True)
    bounds = jnp.arange(n_tiles + 1, dtype=jnp.int32)
    offs = jax.vmap(jax.vmap(lambda a: searchsorted(a, bounds, side="left")))(tiles)
    return flat, offs


def _dot_t(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _block(k_ref, ki_ref, kvpos_ref, kvseg_ref, b, g, start, n, q_pos, q_seg, blk):
    sl = pl.ds(start, blk)
    vis = _mask(kvpos_ref[b, sl], kvseg_ref[b, sl], n, q_pos, q_seg, blk)
    return k_ref[b, sl, g, :], ki_ref[b, sl, :].astype(jnp.float32), vis


def _fwd_kernel(q_ref, k_ref, qi_ref, ki_ref, ids_ref, start_ref, qpos_ref, qseg_ref, kvpos_ref,
                kvseg_ref, kl_ref, lsex_ref, lsem_ref, *, blk, topk, scale, iscale, hg, m_pad):
    t = pl.program_id(0)
    g = pl.program_id(1)
    b = pl.program_id(2)
    q = _load_group(q_ref, b, t, g, hg, m_pad)            # [M, D]; q_ref [B,T,H,D], pad rows 0
    qi = qi_ref[b, t, g].astype(jnp.float32)              # [Di]
    q_pos = qpos_ref[b, t]
    q_seg = qseg_ref[b, t]
    m_rows = q.shape[0]

    def logits(kk):
        n = ids_ref[b, g, t, kk]
        kb, kib, vis = _block(k_ref, ki_ref, kvpos_ref, kvseg_ref, b, g, start_ref[b, g, t, kk], n,
                              q_pos, q_seg, blk)
        s = jnp.where(vis[None, :], _dot_t(q, kb) * (scale * _LOG2E), -jnp.inf)     # [M, B]
        x = jnp.where(vis, jnp.sum(kib * qi[None, :], axis=1) * (iscale * _LOG2E), -jnp.inf)
        return s, x, vis

    def pass1(kk, c):
        m, l, mx, lx = c
        s, x, _ = logits(kk)
        m2 = jnp.maximum(m, jnp.max(s, axis=1))
        ms = jnp.where(m2 == -jnp.inf, 0.0, m2)
        l = l * jnp.exp2(m - ms) + jnp.sum(jnp.exp2(s - ms[:, None]), axis=1)
        mx2 = jnp.maximum(mx, jnp.max(x))
        mxs = jnp.where(mx2 == -jnp.inf, 0.0, mx2)
        lx = lx * jnp.exp2(mx - mxs) + jnp.sum(jnp.exp2(x - mxs))
        return m2, l, mx2, lx

    m0 = jnp.full((m_rows,), -jnp.inf, jnp.float32)
    m, l, mx, lx = jax.lax.fori_loop(
        0, topk, pass1, (m0, jnp.zeros((m_rows,), jnp.float32), jnp.float32(-jnp.inf),
                         jnp.float32(0.0)))
    row_ok = jax.lax.broadcasted_iota(jnp.int32, (m_rows,), 0) < hg
    lse_m = jnp.where((l > 0) & row_ok, m + jnp.log2(jnp.where(l > 0, l, 1.0)), jnp.inf)  # log2
    lse_x = jnp.where(lx > 0, mx + jnp.log2(jnp.where(lx > 0, lx, 1.0)), -jnp.inf)

    def pass2(kk, acc):
        s, x, vis = logits(kk)
        tch = jnp.sum(jnp.exp2(s - lse_m[:, None]), axis=0) / hg      # [B] teacher
        log_t = jnp.log2(jnp.where(tch > 0, tch, 1.0))
        term = jnp.where(vis & (tch > 0), tch * (log_t - (x - lse_x)), 0.0)
        return acc + jnp.sum(term)

    kl = jax.lax.fori_loop(0, topk, pass2, jnp.float32(0.0)) * _LN2
    kl_ref[b, t, g] = jnp.where(lx > 0, kl, 0.0)
    lsex_ref[b, t, g] = lse_x
    _store_group(lsem_ref, b, t, g, hg, m_pad, lse_m)    # [B,T,H]: the group's hg rows only


def _grad_row(q, qi, kb, kib, vis, lse_m, lse_x, scale, iscale, hg):
    """p - t over one block's keys ([B]) for one (token, group)."""
    s = _dot_t(q, kb) * (scale * _LOG2E)
    tch = jnp.sum(jnp.where(vis[None, :], jnp.exp2(s - lse_m[:, None]), 0.0), axis=0) / hg
    x = jnp.sum(kib * qi[None, :], axis=1) * (iscale * _LOG2E)
    p = jnp.where(vis, jnp.exp2(x - lse_x), 0.0)
    return p - tch


def _dqi_kernel(q_ref, k_ref, qi_ref, ki_ref, ids_ref, start_ref, qpos_ref, qseg_ref, kvpos_ref,
                kvseg_ref, lsex_ref, lsem_ref, ct_ref, dqi_ref, *, blk, topk, scale, iscale, hg,
                m_pad):
    t = pl.program_id(0)
    g = pl.program_id(1)
    b = pl.program_id(2)
    q = _load_group(q_ref, b, t, g, hg, m_pad)                      # [M, D]
    qi = qi_ref[b, t, g].astype(jnp.float32)
    lse_m = _load_group(lsem_ref, b, t, g, hg, m_pad, jnp.inf)      # [M]; pad rows: teacher 0
    lse_x = lsex_ref[b, t, g]
    q_pos = qpos_ref[b, t]
    q_seg = qseg_ref[b, t]

    def body(kk, acc):
        n = ids_ref[b, g, t, kk]
        kb, kib, vis = _block(k_ref, ki_ref, kvpos_ref, kvseg_ref, b, g, start_ref[b, g, t, kk], n,
                              q_pos, q_seg, blk)
        d = _grad_row(q, qi, kb, kib, vis, lse_m, lse_x, scale, iscale, hg)
        return acc + jnp.sum(d[:, None] * kib, axis=0)

    acc = jax.lax.fori_loop(0, topk, body, jnp.zeros(qi.shape, jnp.float32))
    dqi_ref[b, t, g] = (acc * (iscale * ct_ref[0])).astype(dqi_ref.dtype)


def _dki_kernel(q_ref, k_ref, qi_ref, ki_ref, ids_ref, ent_ref, off_ref, qpos_ref, qseg_ref,
                kvpos_ref, kvseg_ref, lsex_ref, lsem_ref, ct_ref, dki_ref, *, blk, topk, scale,
                iscale, hg, m_pad, groups):
    tile = pl.program_id(0)
    b = pl.program_id(1)
    sl = pl.ds(tile * blk, blk)
    kib = ki_ref[b, sl, :].astype(jnp.float32)            # [B, Di]
    kvp = kvpos_ref[b, sl]
    kvs = kvseg_ref[b, sl]

    def group(g, acc):
        kb = k_ref[b, sl, g, :]

        def body(e, acc):
            flat = ent_ref[b, g, e]
            t = jax.lax.div(flat, topk)
            n = ids_ref[b, g, t, flat - t * topk]
            vis = _mask(kvp, kvs, n, qpos_ref[b, t], qseg_ref[b, t], blk)
            qi = qi_ref[b, t, g].astype(jnp.float32)
            q = _load_group(q_ref, b, t, g, hg, m_pad)
            lse_m = _load_group(lsem_ref, b, t, g, hg, m_pad, jnp.inf)
            d = _grad_row(q, qi, kb, kib, vis, lse_m, lsex_ref[b, t, g], scale, iscale, hg)
            return acc + d[:, None] * qi[None, :]

        return jax.lax.fori_loop(off_ref[b, g, tile], off_ref[b, g, tile + 1], body, acc)

    acc = jax.lax.fori_loop(0, groups, group, jnp.zeros(kib.shape, jnp.float32))
    dki_ref[b, sl, :] = (acc * (iscale * ct_ref[0])).astype(dki_ref.dtype)


def _setup(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk):
    g = k.shape[2]
    hg = q.shape[2] // g
    m_pad = max(16, layout.next_pow2(hg))
    prep = layout.prepare(k, ki[:, :, None, :], q_positions, kv_positions, q_seg, kv_seg, blk)
    ids = layout.dedupe_ids(block_ids)
    starts = layout.window_starts(ids, prep.base, blk, prep.s_pad)
    return dict(hg=hg, prep=prep, kp=prep.k, kip=prep.v[:, :, 0, :],
                ids=ids, starts=starts, qpos=q_positions.astype(jnp.int32),
                consts=dict(blk=blk, topk=ids.shape[-1], scale=1.0 / math.sqrt(q.shape[-1]),
                            iscale=1.0 / math.sqrt(qi.shape[-1]), hg=hg, m_pad=m_pad))


def _params(interpret):
    return dict(compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
                interpret=interpret)


def _forward(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret):
    c = _setup(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk)
    bsz, t, h, _ = q.shape
    g = k.shape[2]
    kl, lse_x, lse_m = pl.pallas_call(     # q, lse_m in their natural layout (no padded copies)
        functools.partial(_fwd_kernel, **c["consts"]),
        grid=(t, g, bsz),
        out_shape=[jax.ShapeDtypeStruct((bsz, t, g), jnp.float32),
                   jax.ShapeDtypeStruct((bsz, t, g), jnp.float32),
                   jax.ShapeDtypeStruct((bsz, t, h), jnp.float32)],
        name="msa_kl_fwd_gpu", **_params(interpret),
    )(q, c["kp"], qi, c["kip"], c["ids"], c["starts"], c["qpos"], c["prep"].q_seg,
      c["prep"].kv_pos, c["prep"].kv_seg)
    count = jnp.sum(jnp.isfinite(lse_x).astype(jnp.int32))
    return jnp.sum(kl), count, (lse_x, lse_m)


def _backward(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, lse_x, lse_m,
              ct, blk, interpret):
    c = _setup(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk)
    bsz, t, _, _ = q.shape
    g = k.shape[2]
    ct = jnp.reshape(ct.astype(jnp.float32), (1,))
    common = (q, c["kp"], qi, c["kip"], c["ids"])
    pos = (c["qpos"], c["prep"].q_seg, c["prep"].kv_pos, c["prep"].kv_seg)
    dqi = pl.pallas_call(
        functools.partial(_dqi_kernel, **c["consts"]),
        grid=(t, g, bsz),
        out_shape=jax.ShapeDtypeStruct(qi.shape, qi.dtype),
        name="msa_kl_dqi_gpu", **_params(interpret),
    )(*common, c["starts"], *pos, lse_x, lse_m, ct)
    n_tiles = c["prep"].s_pad // blk
    ent, offs = _inverse_map(c["ids"], c["starts"], blk, n_tiles)
    dki = pl.pallas_call(
        functools.partial(_dki_kernel, groups=g, **c["consts"]),
        grid=(n_tiles, bsz),
        out_shape=jax.ShapeDtypeStruct(c["kip"].shape, ki.dtype),
        name="msa_kl_dki_gpu", **_params(interpret),
    )(*common, ent, offs, *pos, lse_x, lse_m, ct)
    return dqi, dki[:, :ki.shape[1]]


def _f0(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def _kl(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret):
    kl, count, _ = _forward(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg,
                            blk, interpret)
    return kl, count


def _kl_fwd(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret):
    kl, count, (lse_x, lse_m) = _forward(q, k, qi, ki, block_ids, q_positions, kv_positions,
                                         q_seg, kv_seg, blk, interpret)
    return (kl, count), (q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg,
                         lse_x, lse_m)


def _kl_bwd(blk, interpret, res, cot):
    q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, lse_x, lse_m = res
    ct, _ = cot
    dqi, dki = _backward(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg,
                         lse_x, lse_m, ct, blk, interpret)
    return (jnp.zeros_like(q), jnp.zeros_like(k), dqi, dki, _f0(block_ids), _f0(q_positions),
            _f0(kv_positions), _f0(q_seg), _f0(kv_seg))


_kl.defvjp(_kl_fwd, _kl_bwd)


def indexer_kl_gpu(q, k, qi, ki, block_ids, *, q_positions, kv_positions, q_segment_ids=None,
                   kv_segment_ids=None, block_size=None, interpret=False):
    """Indexer KL(teacher || student) on the selected support, Pallas/Triton GPU kernels.

    Args:
      q [B,T,H,D], k [B,S,G,D]: main branch (no gradient reaches them; D a power of two >= 16).
      qi [B,T,G,Di], ki [B,S,Di]: index branch (gradients flow here; Di a power of two >= 16).
      block_ids int [B,G,T,K] (-1 = empty); positions / segment ids (layout.py conventions);
      block_size B (power of two >= 16); interpret: Pallas interpret mode (CPU tests).
    Returns: (kl_sum f32 [], count int32 []) as minimax_jax.ops.msa.indexer_kl.
    Raises: ValueError for block_ids=None (the dense warm-up has no kernel). Other preconditions
      (tile sizes, head counts) are asserted; the ops layer checks them for its callers.
    """
    if block_ids is None:
        raise ValueError("indexer_kl_gpu covers the sparse support only; the dense warm-up "
                         "(block_ids=None) has no kernel")
    for name, x in (("block_size", block_size), ("head dim", q.shape[-1]), ("index dim", qi.shape[-1])):
        assert x is not None and x >= 16 and not x & (x - 1), f"{name} must be a power of two >= 16, got {x}"
    assert qi.shape[2] == k.shape[2], f"index heads {qi.shape[2]} must equal kv heads {k.shape[2]}"
    return _kl(q, k, qi, ki, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
               block_size, interpret)
