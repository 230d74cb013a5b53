"""MSA block-sparse attention on GPU: Pallas kernels with the Triton lowering (fwd, dq, dk/dv).

The forward is KV-outer (gpu_sparse_fwd.py: each selected K/V block loaded once for all the queries
that chose it, partial outputs merged by LSE); this module holds the backward kernels and the
``custom_vjp``.

Math (MSA_SPEC.md section 3): query head h of group r = h // (H/G) attends over the union of the
keys of its selected blocks (block_ids[b, r, i, :], -1 = unused slot), keeping only visible keys;
scale 1/sqrt(D); exact softmax with fp32 statistics. Outputs o [B,T,H,D] (q.dtype) and
lse [B,T,H] f32 (natural log; -inf for a query that sees no key, whose o is 0).

Backward (``jax.custom_vjp``): delta = rowsum(o * do) in XLA. dq: one program per (query token,
kv group, batch row); the group's H/G heads are the M rows of every matmul (padded in registers to
a power of two >= 16, the smallest tensor-core tile Triton accepts; q / do / lse / delta / dq are
read and written in their natural [B,T,H,...] layout with a row mask, nothing padded in HBM); each
selected block is gathered with a data-dependent ``pl.ds(start, B)`` (layout.py). dk/dv KV-outer:
the (token, slot) selections are sorted by the storage tile they touch (stable sort: bitwise
deterministic) and one program per (tile, group, batch row) loops over them. No atomics.
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
from pallas_kernels.msa.gpu_sparse_fwd import sparse_fwd_kv_outer

__all__ = ["msa_attention_gpu"]


def _dot(a, b, trans_a=False, trans_b=False):
    """2-D matmul with fp32 accumulation; lowers to a Triton tensor-core dot (tl.dot)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

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


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, ids_ref, start_ref, qpos_ref,
               qseg_ref, kvpos_ref, kvseg_ref, dq_ref, *, blk, topk, scale, hg, m_pad):
    t = pl.program_id(0)
    g = pl.program_id(1)
    b = pl.program_id(2)
    q = _load_group(q_ref, b, t, g, hg, m_pad)            # [M, D]
    do = _load_group(do_ref, b, t, g, hg, m_pad)
    lse = _load_group(lse_ref, b, t, g, hg, m_pad, jnp.inf) * _LOG2E   # [M] log2; pad: p = 0
    delta = _load_group(delta_ref, b, t, g, hg, m_pad)
    q_pos = qpos_ref[b, t]
    q_seg = qseg_ref[b, t]
    qk_scale = scale * _LOG2E

    def body(kk, dq):
        n = ids_ref[b, g, t, kk]
        start = start_ref[b, g, t, kk]
        sl = pl.ds(start, blk)
        kb = k_ref[b, sl, g, :]
        vb = v_ref[b, sl, g, :]
        vis = _mask(kvpos_ref[b, sl], kvseg_ref[b, sl], n, q_pos, q_seg, blk)
        s = _dot(q, kb, trans_b=True) * qk_scale
        p = jnp.where(vis[None, :], jnp.exp2(s - lse[:, None]), 0.0)
        dp = _dot(do, vb, trans_b=True)
        ds = p * (dp - delta[:, None])
        return dq + _dot(ds.astype(kb.dtype), kb)

    dq = jax.lax.fori_loop(0, topk, body, jnp.zeros(q.shape, jnp.float32))
    _store_group(dq_ref, b, t, g, hg, m_pad, (dq * scale).astype(dq_ref.dtype))


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, ids_ref, ent_ref, off_ref,
                 qpos_ref, qseg_ref, kvpos_ref, kvseg_ref, dk_ref, dv_ref, *, blk, topk, scale, hg,
                 m_pad):
    tile = pl.program_id(0)
    g = pl.program_id(1)
    b = pl.program_id(2)
    sl = pl.ds(tile * blk, blk)
    kb = k_ref[b, sl, g, :]                  # [B, D]
    vb = v_ref[b, sl, g, :]
    kvp = kvpos_ref[b, sl]
    kvs = kvseg_ref[b, sl]
    qk_scale = scale * _LOG2E
    lo = off_ref[b, g, tile]
    hi = off_ref[b, g, tile + 1]

    def body(e, carry):
        dk, dv = carry
        flat = ent_ref[b, g, e]
        t = jax.lax.div(flat, topk)
        slot = flat - t * topk
        n = ids_ref[b, g, t, slot]
        q = _load_group(q_ref, b, t, g, hg, m_pad)          # [M, D]
        do = _load_group(do_ref, b, t, g, hg, m_pad)
        lse = _load_group(lse_ref, b, t, g, hg, m_pad, jnp.inf) * _LOG2E
        delta = _load_group(delta_ref, b, t, g, hg, m_pad)
        vis = _mask(kvp, kvs, n, qpos_ref[b, t], qseg_ref[b, t], blk)
        s = _dot(q, kb, trans_b=True) * qk_scale          # [M, B]
        p = jnp.where(vis[None, :], jnp.exp2(s - lse[:, None]), 0.0)
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)      # [B, D]
        dp = _dot(do, vb, trans_b=True)
        ds = p * (dp - delta[:, None])
        dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    dk, dv = jax.lax.fori_loop(lo, hi, body, (jnp.zeros(kb.shape, jnp.float32),
                                              jnp.zeros(vb.shape, jnp.float32)))
    dk_ref[b, sl, g, :] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[b, sl, g, :] = dv.astype(dv_ref.dtype)


def _params(num_warps, num_stages):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


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


def _fwd(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, *,
         block_size, interpret, num_warps, num_stages):
    del num_warps, num_stages          # the backward kernels' launch parameters
    return sparse_fwd_kv_outer(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                               kv_segment_ids, block_size=block_size, interpret=interpret)


def _bwd(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, o, lse,
         do, *, block_size, interpret, num_warps, num_stages):
    bsz, t, h, d = q.shape
    s = k.shape[1]
    g = k.shape[2]
    hg = h // g
    m_pad = max(16, layout.next_pow2(hg))
    topk = block_ids.shape[-1]
    scale = 1.0 / math.sqrt(d)
    prep = layout.prepare(k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                          block_size)
    ids = layout.dedupe_ids(block_ids)
    starts = layout.window_starts(ids, prep.base, block_size, prep.s_pad)
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)   # [B,T,H] (fused)
    do = do.astype(q.dtype)
    lse = lse.astype(jnp.float32)
    qpos = q_positions.astype(jnp.int32)
    # q, do, lse, delta, dq in their natural [B,T,H,...] layout: the kernels mask the group's
    # padded rows in registers (no [B,T,G,M,...] copies in HBM).
    common = dict(blk=block_size, topk=topk, scale=scale, hg=hg, m_pad=m_pad)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **common),
        grid=(t, g, bsz),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name="msa_dq_gpu",
    )(q, prep.k, prep.v, do, lse, delta, ids, starts, qpos, prep.q_seg, prep.kv_pos,
      prep.kv_seg)
    n_tiles = prep.s_pad // block_size
    ent, offs = _inverse_map(ids, starts, block_size, n_tiles)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, **common),
        grid=(n_tiles, g, bsz),
        out_shape=[jax.ShapeDtypeStruct(prep.k.shape, k.dtype),
                   jax.ShapeDtypeStruct(prep.v.shape, v.dtype)],
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name="msa_dkdv_gpu",
    )(q, prep.k, prep.v, do, lse, delta, ids, ent, offs, qpos, prep.q_seg, prep.kv_pos,
      prep.kv_seg)
    return dq, dk[:, :s], dv[:, :s]


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _attn(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
          block_size, interpret, num_warps, num_stages):
    return _fwd(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                block_size=block_size, interpret=interpret, num_warps=num_warps,
                num_stages=num_stages)


def _attn_fwd(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
              block_size, interpret, num_warps, num_stages):
    o, lse = _attn(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                   kv_segment_ids, block_size, interpret, num_warps, num_stages)
    return (o, lse), (q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                      kv_segment_ids, o, lse)


def _zero_cot(x):
    if x is None:
        return None
    return np.zeros(x.shape, jax.dtypes.float0)


def _attn_bwd(block_size, interpret, num_warps, num_stages, res, cot):
    q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, o, lse = res
    do, _dlse = cot   # lse is an auxiliary output; its cotangent is not propagated (documented)
    dq, dk, dv = _bwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, o, lse, do,
                      block_size=block_size, interpret=interpret, num_warps=num_warps,
                      num_stages=num_stages)
    return (dq, dk, dv, _zero_cot(block_ids), _zero_cot(q_positions), _zero_cot(kv_positions),
            _zero_cot(q_seg), _zero_cot(kv_seg))


_attn.defvjp(_attn_fwd, _attn_bwd)


def _pow2_tile(x: int) -> bool:
    """A Triton tile size: a power of two >= 16."""
    return x >= 16 and not x & (x - 1)


def msa_attention_gpu(q, k, v, block_ids, *, q_positions, kv_positions, q_segment_ids=None,
                      kv_segment_ids=None, block_size, interpret=False, num_warps=4,
                      num_stages=2):
    """Block-sparse MSA attention, Pallas/Triton GPU kernels, differentiable in q, k, v.

    Args:
      q: [B,T,H,D] bf16/f32. k: [B,S,G,D], v: [B,S,G,Dv], same dtype. T <= S.
      block_ids: int [B,G,T,K], selected block ids per (group, query), -1 = unused slot, any order;
        duplicates count once. Block n of query i = keys of i's segment with n*B <= kv_pos < (n+1)*B.
      q_positions [B,T], kv_positions [B,S] int; segment ids [B,T]/[B,S] or None (both or neither);
        the storage layout of layout.py (a precondition, not checked here).
      block_size: B (power of two >= 16); D and Dv powers of two >= 16 (Triton tiles).
      interpret: run the same kernels in Pallas interpret mode (CPU tests).
      num_warps, num_stages: Triton launch parameters.
    Returns:
      (o [B,T,H,Dv] q.dtype, lse [B,T,H] f32 natural log, -inf where a query sees no key).
    Preconditions are asserted (AssertionError); the ops layer checks them for its callers.
    num_warps / num_stages set the backward kernels (the forward has its own tuned launch).
    The gradient of lse is not propagated (it is an auxiliary output for combining partial
    attentions; using it in a loss raises nothing but contributes zero gradient).
    Math: MSA_SPEC.md section 3 (arXiv 2606.13392).
    """
    layout.check_shapes(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    assert _pow2_tile(block_size), f"block_size must be a power of two >= 16, got {block_size}"
    assert _pow2_tile(q.shape[-1]) and _pow2_tile(v.shape[-1]), \
        f"head dims {q.shape[-1]}, {v.shape[-1]} must be powers of two >= 16 (Triton tiles)"
    return _attn(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                 block_size, interpret, num_warps, num_stages)
