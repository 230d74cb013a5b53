"""Decode kernels for TPU (Pallas Mosaic): page scoring and paged flash-decoding attention.

Math: MSA_SPEC.md section 5 (inputs validated by ``minimax_jax.ops.paged``). Page tables, the
per-row selected page lists and the per-request page counts are scalar-prefetched into SMEM and
drive the BlockSpec index maps, so each grid step DMAs exactly one physical page (``[page, D]``
tiles) into VMEM. Pages a row does not need map to the previously fetched block index, so
Pallas skips the copy. SMEM holds the whole prefetched tables: for very long contexts and large
batches they should be chunked (a known limit of this version: ``B * NP`` int32 must fit SMEM).

``page_scores_tpu``: grid (request, logical page); one ``[R, Di] x [Di, page]`` product per page
(all rows x index heads of the request share the index key), max over the page's tokens.
``paged_attention_tpu``: grid (request, kv group, row block, slot); online softmax over the slots
(the last, "arbitrary" grid axis) in VMEM scratch; dense mode walks logical pages
``0 .. lim - 1``, sparse mode the row's selected logical pages (``-1`` skipped).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.decode.common import compute_dtype, pack_rows, pad_rows, unpack_rows

__all__ = ["page_scores_tpu", "paged_attention_tpu"]

_NEG = -1e30


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _nn(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- page scores

def _score_kernel(pt_ref, ns_ref, qi_ref, ki_ref, *rest, scale, has_scale, cdt):
    if has_scale:
        ks_ref, o_ref = rest
    else:
        (o_ref,) = rest
    b = pl.program_id(0)
    p = pl.program_id(1)

    @pl.when(p < ns_ref[b])
    def _():
        s = _nt(qi_ref[...].astype(cdt), ki_ref[...].astype(cdt))         # [R, page]
        if has_scale:
            s = s * ks_ref[...]                                          # [1, page]
        o_ref[...] = jnp.max(s, axis=1, keepdims=True) * scale           # [R, 1]


@functools.partial(jax.jit, static_argnames=("interpret",))
def page_scores_tpu(qi, ki_pages, page_table, q_positions, ki_scale=None, *, interpret=False):
    """Raw page scores ``[B, Hi, Q, NP]`` f32; pages ``>= max_i(pos_i // page)`` hold junk.

    Args: qi ``[B,Q,Hi,Di]``, ki_pages ``[P,page,Di]``, page_table ``[B,NP]`` int32, q_positions
      ``[B,Q]`` int32, ki_scale ``[P,page]`` f32 or None; interpret: Pallas interpret mode (CPU).
    """
    b, nq, hi, di = qi.shape
    n_phys, page, _ = ki_pages.shape
    npg = page_table.shape[1]
    cdt = compute_dtype(ki_pages.dtype)
    r = _round_up(nq * hi, 8)
    q2 = pad_rows(qi.reshape(b, nq * hi, di).astype(cdt), 1, r)
    ns = jnp.clip(jnp.max(q_positions, axis=1) // page, 0, npg).astype(jnp.int32)
    pt = page_table.astype(jnp.int32).reshape(-1)

    def phys(bi, p, pt_ref, ns_ref):
        return pt_ref[bi * npg + jnp.minimum(p, jnp.maximum(ns_ref[bi] - 1, 0))]

    in_specs = [pl.BlockSpec((None, r, di), lambda bi, p, pt_ref, ns_ref: (bi, 0, 0)),
                pl.BlockSpec((None, page, di), lambda bi, p, pt_ref, ns_ref: (phys(bi, p, pt_ref, ns_ref), 0, 0))]
    args = [q2, ki_pages]
    if ki_scale is not None:
        in_specs.append(pl.BlockSpec((None, 1, page),
                                     lambda bi, p, pt_ref, ns_ref: (phys(bi, p, pt_ref, ns_ref), 0, 0)))
        args.append(ki_scale.astype(jnp.float32).reshape(n_phys, 1, page))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(b, npg), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, r, 1), lambda bi, p, pt_ref, ns_ref: (bi, p, 0, 0)))
    kernel = functools.partial(_score_kernel, scale=1.0 / math.sqrt(di), has_scale=ki_scale is not None, cdt=cdt)
    out = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, npg, r, 1), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret, name="msa_decode_page_scores_tpu",
    )(pt, ns, *args)
    return out[:, :, : nq * hi, 0].reshape(b, npg, nq, hi).transpose(0, 3, 2, 1)


# ----------------------------------------------------------------------------- attention

def _attn_kernel(pt_ref, ids_ref, lim_ref, q_ref, pos_ref, k_ref, v_ref, *rest, page, nl, scale, dense,
                 has_scale, cdt, g_count, r_count):
    if has_scale:
        ks_ref, vs_ref, o_ref, l_ref, m_sc, l_sc, acc_sc = rest
    else:
        o_ref, l_ref, m_sc, l_sc, acc_sc = rest
    b, g, r, j = (pl.program_id(i) for i in range(4))

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    if dense:
        logical = j
        ok = j < lim_ref[b]
    else:
        logical = ids_ref[((b * g_count + g) * r_count + r) * nl + j]
        ok = logical >= 0

    @pl.when(ok)
    def _():
        s = _nt(q_ref[...].astype(cdt), k_ref[...].astype(cdt)) * scale  # [M, page]
        if has_scale:
            s = s * ks_ref[...]
        kpos = logical * page + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        vis = kpos <= pos_ref[...]                                       # [M, 1] broadcast
        s = jnp.where(vis, s, _NEG)
        m_prev = m_sc[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        corr = jnp.exp(m_prev - m_next)
        p = jnp.where(vis, jnp.exp(s - m_next), 0.0)
        l_sc[...] = l_sc[...] * corr + jnp.sum(p, axis=1, keepdims=True)
        if has_scale:
            p = p * vs_ref[...]
        acc_sc[...] = acc_sc[...] * corr + _nn(p.astype(cdt), v_ref[...].astype(cdt))
        m_sc[...] = m_next

    @pl.when(j == nl - 1)
    def _():
        l_fin = l_sc[...]
        safe = jnp.where(l_fin == 0.0, 1.0, l_fin)
        o_ref[...] = acc_sc[...] / safe
        l_ref[...] = jnp.where(l_fin == 0.0, -jnp.inf, m_sc[...] + jnp.log(safe))


@functools.partial(jax.jit, static_argnames=("interpret",))
def paged_attention_tpu(q, k_pages, v_pages, page_table, q_positions, k_scale=None, v_scale=None, block_ids=None,
                        *, interpret=False):
    """Paged decode attention on TPU; same contract as ``minimax_jax.ops.paged.paged_attention``.

    Returns ``(o [B,Q,H,D] q.dtype, lse [B,Q,H] f32)``.
    """
    b, nq, h, d = q.shape
    g, n_phys, page, _ = k_pages.shape
    npg = page_table.shape[1]
    dense = block_ids is None
    cdt = compute_dtype(k_pages.dtype)
    qr, pos, hg, m, qpb = pack_rows(q, q_positions, g, dense, 8)
    m = _round_up(m, 8)
    qr, pos = pad_rows(qr, 3, m), pad_rows(pos, 2, m, -1)
    rows = qr.shape[2]
    pt = page_table.astype(jnp.int32).reshape(-1)
    if dense:
        nl = npg
        ids = jnp.zeros((1,), jnp.int32)
        lim = jnp.clip(jnp.max(q_positions, axis=1) // page + 1, 0, npg).astype(jnp.int32)
    else:
        nl = block_ids.shape[-1]
        ids = block_ids.astype(jnp.int32).reshape(-1)
        lim = jnp.zeros((b,), jnp.int32)

    def phys(bi, gi, ri, j, pt_ref, ids_ref, lim_ref):
        if dense:
            logical = jnp.minimum(j, jnp.maximum(lim_ref[bi] - 1, 0))
        else:
            logical = jnp.maximum(ids_ref[((bi * g + gi) * rows + ri) * nl + j], 0)
        return pt_ref[bi * npg + logical]

    kv_spec = pl.BlockSpec((None, None, page, d), lambda bi, gi, ri, j, *s: (gi, phys(bi, gi, ri, j, *s), 0, 0))
    in_specs = [pl.BlockSpec((None, None, None, m, d), lambda bi, gi, ri, j, *s: (bi, gi, ri, 0, 0)),
                pl.BlockSpec((None, None, m, 1), lambda bi, gi, ri, j, *s: (bi, ri, 0, 0)),
                kv_spec, kv_spec]
    args = [qr, pos.reshape(b, rows, m, 1), k_pages, v_pages]
    if k_scale is not None:
        sc_spec = pl.BlockSpec((None, None, 1, page), lambda bi, gi, ri, j, *s: (gi, phys(bi, gi, ri, j, *s), 0, 0))
        in_specs += [sc_spec, sc_spec]
        args += [k_scale.astype(jnp.float32).reshape(g, n_phys, 1, page),
                 v_scale.astype(jnp.float32).reshape(g, n_phys, 1, page)]
    out_specs = [pl.BlockSpec((None, None, None, m, d), lambda bi, gi, ri, j, *s: (bi, gi, ri, 0, 0)),
                 pl.BlockSpec((None, None, None, m, 1), lambda bi, gi, ri, j, *s: (bi, gi, ri, 0, 0))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, g, rows, nl), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((m, 1), jnp.float32), pltpu.VMEM((m, 1), jnp.float32),
                        pltpu.VMEM((m, d), jnp.float32)])
    kernel = functools.partial(_attn_kernel, page=page, nl=nl, scale=1.0 / math.sqrt(d), dense=dense,
                               has_scale=k_scale is not None, cdt=cdt, g_count=g, r_count=rows)
    o, lse = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, g, rows, m, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, g, rows, m, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="paged_decode_attention_tpu",
    )(pt, ids, lim, *args)
    o, lse = unpack_rows(o, lse[..., 0], nq, hg, qpb)
    return o.astype(q.dtype), lse
