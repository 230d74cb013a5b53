"""Split-KV paged decode attention on Hopper: Pallas Mosaic GPU (TMA + ``wgmma``), dense and shared
sparse (MSA) tiles.

Math: MSA_SPEC.md section 5 (the same contract and split-KV schedule as the dense and ``"shared"`` modes
of ``gpu_attention._paged_attention``; the partials are merged by ``common.combine_splits`` like the
Triton kernel's, but stored in q.dtype, not f32: one more rounding per split). One CTA per (request x kv
group, row block, split) and up to three warpgroups:

- a memory warpgroup walks the split's logical pages (dense: consecutive; shared: the split's slots of
  the row block's union of selected pages, ``common.union_pages``), reads each page's physical id from
  the page table and TMAs its K and V rows ``[page, D]`` into a ring of ``stages`` SMEM slots;
- one or two compute warpgroups (the row block's 64 or 128 rows: query rows x heads of the group, as
  ``common.pack_rows`` stacks them) each hold 64 rows of q in SMEM and run an online softmax over the
  pages: S = Q K^T (``wgmma``, f32), the causal mask (row r sees logical keys <= its position; padding
  rows at position -1 see none; shared tiles: and only the pages the row's query row selected), P
  (q.dtype, registers) @ V (``wgmma``) added to an f32 accumulator in
  registers. The normalised partial o (q.dtype) and its log-sum-exp (f32, natural log; -inf where a row
  saw no key) go out by TMA.

Every row's arithmetic is independent of the other rows of its tile (rows of a ``wgmma`` do not mix)
and a page a row cannot see is an exact no-op of its online softmax (p = 0, the running max and scale
unchanged), so a row rounds alike alone or among other rows and whatever split holds its last page.

Restrictions (``wgmma_decode_reason``): bf16 / f16 caches without scales, D in {64, 128}, pages of 64
or 128 tokens, 64 or 128 rows per tile.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import mosaic_interpret_params, mosaic_load_rows, mosaic_smem_transforms, typed_out_struct

__all__ = ["paged_decode_wgmma", "wgmma_decode_reason", "ROWS"]

ROWS = 64                      # rows per compute warpgroup: one wgmma M
_NEG = -1e30                   # finite "minus infinity" of the running max (log2 units)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_SMEM_BYTES = 227 * 1024
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _smem_bytes(nwg, page, d, itemsize, stages, p_in_smem):
    """Shared memory of one CTA: the q tiles (they stage o), the K/V ring, positions, LSEs, P."""
    return (nwg * ROWS * d * itemsize + stages * 2 * page * d * itemsize + nwg * ROWS * 8
            + p_in_smem * nwg * ROWS * page * itemsize + 3072)


def wgmma_decode_reason(m_rows, d, cache_dtype, q_dtype, page, has_scale, stages=2) -> str | None:
    """None when ``paged_decode_wgmma`` serves a tile (dense or shared sparse) of ``m_rows`` rows, else why
    (one sentence)."""
    if has_scale:
        return "scaled (fp8) caches are not supported"
    if jnp.dtype(cache_dtype) not in _DTYPES or jnp.dtype(q_dtype) != jnp.dtype(cache_dtype):
        return f"cache dtype {jnp.dtype(cache_dtype)} / q dtype {jnp.dtype(q_dtype)}: need equal bf16 or f16"
    if m_rows not in (ROWS, 2 * ROWS):
        return f"{m_rows} rows per tile: need 64 or 128"
    if d not in (64, 128):
        return f"head dim {d} not in (64, 128)"
    if page not in (64, 128):
        return f"page size {page} not in (64, 128)"
    if _smem_bytes(m_rows // ROWS, page, d, jnp.dtype(cache_dtype).itemsize, stages, False) > _SMEM_BYTES:
        return f"{stages} K/V stages of {page} x {d} need more than {_SMEM_BYTES // 1024} KiB of shared memory"
    return None


def _body(pt_ref, pos_ref, lim_ref, ids_ref, bits_ref, q_ref, k_ref, v_ref, o_ref, l_ref, *, page, pps, stages, scale,
          g_count, nwg, hg, shared, p_in_smem):
    bg, r, sp = lax.axis_index("bg"), lax.axis_index("r"), lax.axis_index("sp")
    b = lax.div(bg, g_count)
    g = lax.rem(bg, g_count)
    if shared:      # this split's slots [lo, hi) of the row block's union of pages (common.union_pages)
        j0 = lim_ref[b, g, r, sp]
        n = jnp.maximum(lim_ref[b, g, r, sp + 1] - j0, 0)
    else:           # logical pages [sp * pps, min((sp + 1) * pps, lim))
        j0 = sp * pps
        n = jnp.clip(lim_ref[b] - j0, 0, pps)

    def logical(j):
        """Logical page of the split's j-th step."""
        return ids_ref[b, g, r, j0 + j] if shared else j0 + j
    dtype = q_ref.dtype
    d = q_ref.shape[-1]

    def scope(q_smem, pos_smem, l_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_free, v_free, p_smem=None):
        wg = lax.axis_index("wg")

        @pl.when(wg == nwg)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def step(j, carry):
                slot = lax.rem(j, stages)
                start = pl.multiple_of(pt_ref[b, logical(j)] * page, 8)

                @pl.when(j >= stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[g, pl.ds(start, page)], k_smem.at[slot], k_ready.at[slot])

                @pl.when(j >= stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[g, pl.ds(start, page)], v_smem.at[slot], v_ready.at[slot])
                return carry
            lax.fori_loop(0, n, step, None)

            def drain(j, carry):        # observe the last releases before the barriers go away
                slot = lax.rem(j, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                return carry
            lax.fori_loop(jnp.maximum(n - stages, 0), n, drain, None)

        @pl.when(wg < nwg)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            rows = pl.ds(wg * ROWS, ROWS)
            plgpu.copy_gmem_to_smem(q_ref.at[b, g, r, rows], q_smem.at[wg], q_ready.at[wg])
            plgpu.copy_gmem_to_smem(pos_ref.at[b, r, rows], pos_smem.at[wg], q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])
            qpos = mosaic_load_rows(pos_smem.at[wg])
            qk_scale = scale * _LOG2E
            shape = (ROWS, page)
            row_pos = lax.broadcast_in_dim(qpos, shape, [0])
            col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            if shared:      # tile row -> query row of the row block (bit of ``bits``)
                row_q = jnp.minimum(lax.div(plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                                            + wg * ROWS, jnp.int32(hg)), 31)       # padding rows: a bit < 32

            def page_step(j, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(j, stages)
                page_id = logical(j)                # read before the wait: its latency hides there
                if shared:
                    sel = bits_ref[b, g, r, j0 + j]
                plgpu.barrier_wait(k_ready.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                vis = col + page_id * page <= row_pos
                if shared:                          # only the rows that selected the page
                    vis = vis & ((jnp.right_shift(sel, row_q) & 1) == 1)
                s = jnp.where(vis, s * qk_scale, _NEG)
                m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.where(vis, jnp.exp2(s - lax.broadcast_in_dim(m_new, shape, [0])), 0.0)
                l_new = l_i * alpha + jnp.sum(p, axis=1)
                p16 = p.astype(dtype)
                if p_smem is not None:      # P through SMEM (the interpreter's wgmma reads SMEM only)
                    p_smem.at[wg][...] = p16
                    plgpu.commit_smem()
                plgpu.barrier_wait(v_ready.at[slot])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16 if p_smem is None else p_smem.at[wg], v_smem.at[slot])
                    return acc_ref[...]
                o = pl.run_scoped(pv, plgpu.ACC((ROWS, d), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                acc = acc * lax.broadcast_in_dim(alpha, (ROWS, d), [0]) + o
                return acc, m_new, l_new

            acc0 = plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA)
            m0 = plgpu.layout_cast(jnp.full((ROWS,), _NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l0 = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc, m_i, l_i = lax.fori_loop(0, n, page_step, (acc0, m0, l0))
            l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
            o = acc * lax.broadcast_in_dim(1.0 / l_safe, (ROWS, d), [0])
            q_smem.at[wg][...] = o.astype(dtype)           # q is spent: it stages the o rows
            l_smem.at[wg][...] = jnp.where(l_i == 0.0, -jnp.inf, m_i * _LN2 + jnp.log(l_safe))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[b, g, r, sp, rows])
            plgpu.copy_smem_to_gmem(l_smem.at[wg], l_ref.at[b, g, r, sp, rows])
            plgpu.wait_smem_to_gmem(0)

    itemsize = jnp.dtype(dtype).itemsize
    extra = {}
    if p_in_smem:
        extra["p_smem"] = plgpu.SMEM((nwg, ROWS, page), dtype, transforms=mosaic_smem_transforms(page, itemsize))
    pl.run_scoped(
        scope,
        q_smem=plgpu.SMEM((nwg, ROWS, d), dtype, transforms=mosaic_smem_transforms(d, itemsize)),
        pos_smem=plgpu.SMEM((nwg, ROWS), jnp.int32),
        l_smem=plgpu.SMEM((nwg, ROWS), jnp.float32),
        k_smem=plgpu.SMEM((stages, page, d), dtype, transforms=mosaic_smem_transforms(d, itemsize)),
        v_smem=plgpu.SMEM((stages, page, d), dtype, transforms=mosaic_smem_transforms(d, itemsize)),
        q_ready=plgpu.Barrier(num_arrivals=2, num_barriers=nwg),
        k_ready=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        v_ready=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),
        v_free=plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),
        **extra,
        collective_axes="wg",
    )


def paged_decode_wgmma(qr, pos, lim, page_table, k_flat, v_flat, *, page, pps, nsplit, stages=2, interpret=False,
                       ids=None, bits=None, hg=1):
    """Split-KV partials of paged decode attention (Hopper, Mosaic GPU): dense, or shared sparse tiles.

    Args: qr ``[B, G, R, M, D]`` (``common.pack_rows``; M = 64 or 128 rows), pos ``[B, R, M]`` int32 (-1 =
      padding row), lim ``[B]`` int32 logical pages to walk per request, page_table ``[B, NP]`` int32,
      k_flat / v_flat ``[G, P * page, D]`` (physical page p = rows ``[p * page, (p + 1) * page)``);
      pps: pages per split; nsplit: splits (split s walks logical pages ``[s * pps, min((s + 1) * pps,
      lim))``); stages: K/V ring slots; interpret: the Mosaic GPU interpreter (jax >= 0.11).
      Shared sparse (MSA) tiles: ids / bits ``[B, G, R, U]`` and lim = starts ``[B, G, R, nsplit + 1]``
      from ``common.union_pages`` (split s walks slots ``[starts[s], starts[s + 1])``; a row sees a page
      only if bit ``row // hg`` of its slot's bits is set); pps unused.
    Returns: ``(o_part [B, G, R, nsplit, M, D] q.dtype, lse_part [B, G, R, nsplit, M] f32)``, each split
      normalised over its own keys (``common.combine_splits`` merges them).
    Raises ValueError when ``wgmma_decode_reason`` refuses the shapes.
    """
    bsz, g, nr, m, d = qr.shape
    why = wgmma_decode_reason(m, d, k_flat.dtype, qr.dtype, page, False, stages)
    if why is not None:
        raise ValueError(f"paged_decode_wgmma: {why}")
    nwg = m // ROWS
    p_in_smem = bool(interpret)
    shared = ids is not None
    body = functools.partial(_body, page=page, pps=pps, stages=stages, scale=1.0 / math.sqrt(d), g_count=g, nwg=nwg,
                             hg=hg, shared=shared, p_in_smem=p_in_smem)
    if not shared:
        ids = bits = jnp.zeros((1, 1, 1, 1), jnp.int32)
    kernel = plgpu.kernel(
        body,
        out_type=[typed_out_struct((bsz, g, nr, nsplit, m, d), qr.dtype, qr),
                  typed_out_struct((bsz, g, nr, nsplit, m), jnp.float32, qr)],
        grid=(bsz * g, nr, nsplit), grid_names=("bg", "r", "sp"),
        num_threads=nwg + 1, thread_name="wg",
        interpret=mosaic_interpret_params("paged_decode_wgmma", nwg + 1) if interpret else None,
    )
    o, lse = kernel(page_table.astype(jnp.int32), pos.astype(jnp.int32), lim.astype(jnp.int32), ids.astype(jnp.int32),
                    bits.astype(jnp.int32), qr, k_flat, v_flat)
    return o, lse
