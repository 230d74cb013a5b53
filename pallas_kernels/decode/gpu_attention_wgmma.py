"""Split-KV paged decode attention on Hopper: Pallas Mosaic GPU (TMA + ``wgmma``), dense and shared
sparse (MSA) tiles.

Math: MSA_SPEC.md section 5 (the same contract and split-KV schedule as the dense and ``"shared"`` modes
of ``gpu_attention._paged_attention``; the partials are merged by ``common.combine_splits`` like the
Triton kernel's, but stored in q.dtype, not f32: one more rounding per split).

Persistent launch: one CTA per SM walks a contiguous range of work items (request x kv group, row block,
split), balanced by pages (``schedule_items``), so the K/V pipeline runs on across items instead of
filling and draining per split. An empty item (no page to walk) is skipped: it takes no q slot and no
turn, and XLA masks its partial (o = 0, lse = -inf). Up to three warpgroups per CTA:

- a memory warpgroup, per item: TMAs the row block's q rows and positions into one of two q slots
  (the next item's q lands while the current one runs), then walks the item's logical pages (dense:
  consecutive; shared: the split's slots of the row block's union of selected pages,
  ``common.union_pages``), reads each page's physical id from the page table and TMAs its K and V rows
  ``[page, D]`` into a ring of ``stages`` SMEM slots;
- one or two compute warpgroups (the row block's 64 or 128 rows: query rows x heads of the group, as
  ``common.pack_rows`` stacks them), each 64 rows, run an online softmax over the item's pages: S = Q K^T
  (``wgmma``, f32), the masks, P (q.dtype, registers) @ V (``wgmma``) added to an f32 accumulator in
  registers; with two, they take turns on the tensor cores (``pingpong``: one's softmax overlaps the
  other's matmuls). Pages every row of the block sees whole (``n_free``) skip the causal mask (row r sees
  logical keys <= its position; padding rows at -1 see none); shared tiles always mask the rows that did
  not select the page. The normalised partial o (q.dtype, staged in the spent q slot) and its
  log-sum-exp (f32, natural log; -inf where a row saw no key) go out by TMA.

Every row's arithmetic is independent of the other rows of its tile (rows of a ``wgmma`` do not mix; a
visible score takes the same expression on the masked and the mask-free path) and a page a row cannot
see is an exact no-op of its online softmax (p = 0, the running max and scale unchanged), so a row rounds
alike alone or among other rows and whatever split holds its last page.

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

from pallas_kernels.common import (gpu_sm_count, mosaic_interpret_params, mosaic_load_rows, mosaic_smem_transforms,
                                   searchsorted, typed_out_struct)

__all__ = ["paged_decode_wgmma", "wgmma_decode_reason", "schedule_items", "default_ctas", "ROWS"]

ROWS = 64                      # rows per compute warpgroup: one wgmma M
_NEG = -1e30                   # finite "minus infinity" of a masked score
_SEEN = -1e28                  # running maxima (log2 units) below this: the row saw no key yet
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_SMEM_BYTES = 227 * 1024
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _smem_bytes(nwg, page, d, itemsize, stages, p_in_smem):
    """Shared memory of one CTA: two q slots per compute warpgroup (they stage o), the K/V ring, positions,
    LSEs, P."""
    return (2 * nwg * ROWS * d * itemsize + stages * 2 * page * d * itemsize + 2 * nwg * ROWS * 4 + nwg * ROWS * 4
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


def _body(items_ref, meta_ref, pt_ref, pos_ref, ids_ref, bits_ref, q_ref, k_ref, v_ref, o_ref, l_ref, *, page,
          stages, scale, g_count, nr, nsplit, nwg, hg, shared, p_in_smem, pingpong, one_each=False):
    c = lax.axis_index("c")
    if one_each:                # as many CTAs as items: CTA c runs item c
        lo, count = c, jnp.int32(1)
    else:
        lo = items_ref[c]
        count = items_ref[c + 1] - lo
    dtype = q_ref.dtype
    d = q_ref.shape[-1]

    def item_of(k):
        """(b, g, r, sp, j0, n, n_free) of this CTA's k-th work item."""
        it = lo + k
        sp = lax.rem(it, nsplit)
        r = lax.rem(lax.div(it, nsplit), nr)
        bg = lax.div(it, nsplit * nr)
        return (lax.div(bg, g_count), lax.rem(bg, g_count), r, sp, meta_ref[it, 0], meta_ref[it, 1],
                meta_ref[it, 2])

    def scope(q_smem, pos_smem, l_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, k_free, v_free,
              sched=None, p_smem=None):
        wg = lax.axis_index("wg")

        def logical(b, g, r, j):
            """Logical page of an item's slot j (shared tiles: its union slot j)."""
            return ids_ref[b, g, r, j] if shared else j

        @pl.when(wg == nwg)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def item(k, carry):         # an empty item takes no q slot and no turn (its partial is masked in XLA)
                t, nq = carry               # pages and non-empty items so far
                b, g, r, _, j0, n, _ = item_of(k)
                qs = lax.rem(nq, 2)

                @pl.when((n > 0) & (nq >= 2))
                def _():
                    plgpu.barrier_wait(q_free.at[qs])        # two non-empty items ago is done with this q slot

                @pl.when(n > 0)
                def _():
                    for w in range(nwg):
                        rows = pl.ds(w * ROWS, ROWS)
                        plgpu.copy_gmem_to_smem(q_ref.at[b, g, r, rows], q_smem.at[qs, w], q_ready.at[qs * nwg + w])
                        plgpu.copy_gmem_to_smem(pos_ref.at[b, r, rows], pos_smem.at[qs, w], q_ready.at[qs * nwg + w])

                def step(j, t):
                    slot = lax.rem(t, stages)
                    start = pl.multiple_of(pt_ref[b, logical(b, g, r, j0 + j)] * page, 8)

                    @pl.when(t >= stages)
                    def _():
                        plgpu.barrier_wait(k_free.at[slot])
                    plgpu.copy_gmem_to_smem(k_ref.at[g, pl.ds(start, page)], k_smem.at[slot], k_ready.at[slot])

                    @pl.when(t >= stages)
                    def _():
                        plgpu.barrier_wait(v_free.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[g, pl.ds(start, page)], v_smem.at[slot], v_ready.at[slot])
                    return t + 1
                return lax.fori_loop(0, n, step, t), nq + (n > 0).astype(jnp.int32)
            total, nq_total = lax.fori_loop(0, count, item, (jnp.int32(0), jnp.int32(0)))

            def drain(t, carry):        # observe the last releases before the barriers go away
                slot = lax.rem(t, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                return carry
            lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, None)

            def drain_q(i, carry):
                plgpu.barrier_wait(q_free.at[lax.rem(i, 2)])
                return carry
            lax.fori_loop(jnp.maximum(nq_total - 2, 0), nq_total, drain_q, None)

        @pl.when(wg < nwg)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qk_scale = scale * _LOG2E
            shape = (ROWS, page)
            col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            if shared:      # tile row -> query row of the row block (bit of ``bits``)
                row_q = jnp.minimum(lax.div(plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0,
                                                                   layout=plgpu.Layout.WGMMA.reduce(1))
                                            + wg * ROWS, jnp.int32(hg)), 31)       # padding rows: a bit < 32

            def schedule():
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

            def release(i):
                """The i-th non-empty item's o rows have left its q slot: hand the slot back to the memory
                warpgroup."""
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(q_free.at[lax.rem(i, 2)])

            def item(k, carry):
                t, nq = carry
                b, g, r, sp, j0, n, n_free = item_of(k)
                qs = lax.rem(nq, 2)
                q_tile = q_smem.at[qs, wg]

                @pl.when(n > 0)
                def _():
                    plgpu.barrier_wait(q_ready.at[qs * nwg + wg])
                # (read for an empty item too, unused there: its loops do not run)
                row_pos = lax.broadcast_in_dim(mosaic_load_rows(pos_smem.at[qs, wg]), shape, [0])

                def page_step(j, carry, masked):
                    acc, m_i, l_i, t = carry
                    slot = lax.rem(t, stages)
                    if pingpong:    # warpgroup 1 starts a turn behind (at its first page: it has no other waits)
                        pl.when((wg == 1) & (t == 0))(schedule)
                    page_id = logical(b, g, r, j0 + j)      # read before the wait: its latency hides there
                    if shared:
                        sel = bits_ref[b, g, r, j0 + j]
                    plgpu.barrier_wait(k_ready.at[slot])

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                        if pingpong:
                            schedule()
                        return acc_ref[...]
                    s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])

                    @pl.when((j == 0) & (nq >= 1))
                    def _():
                        release(nq - 1)
                    # Every path computes a visible score's p with the same expression, so a row rounds alike
                    # whichever path its page takes in a step (rows of other positions pick the path).
                    if shared:      # only the rows that selected the page: s + 0 or s + NEG
                        s = s + lax.broadcast_in_dim(jnp.where((jnp.right_shift(sel, row_q) & 1) == 1, 0.0, _NEG),
                                                     shape, [0])
                    if masked:
                        s = jnp.where(col + page_id * page <= row_pos, s, _NEG)
                    m_new = jnp.maximum(m_i, jnp.max(s, axis=1) * qk_scale)
                    m_sub = jnp.where(m_new < _SEEN, 0.0, m_new)      # rows that saw no key yet: p = 0
                    alpha = jnp.exp2(m_i - m_new)
                    p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_sub, shape, [0]))
                    l_new = l_i * alpha + jnp.sum(p, axis=1)
                    p16 = p.astype(dtype)
                    if p_smem is not None:      # P through SMEM (the interpreter's wgmma reads SMEM only)
                        p_smem.at[wg][...] = p16
                        plgpu.commit_smem()
                    if pingpong:
                        plgpu.barrier_arrive(sched)
                        plgpu.barrier_wait(v_ready.at[slot])
                        plgpu.barrier_wait(sched)
                    else:
                        plgpu.barrier_wait(v_ready.at[slot])

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16 if p_smem is None else p_smem.at[wg], v_smem.at[slot])
                        return acc_ref[...]
                    o = pl.run_scoped(pv, plgpu.ACC((ROWS, d), jnp.float32))
                    plgpu.barrier_arrive(v_free.at[slot])
                    acc = acc * lax.broadcast_in_dim(alpha, (ROWS, d), [0]) + o
                    return acc, m_new, l_new, t + 1

                acc0 = plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA)
                m0 = plgpu.layout_cast(jnp.full((ROWS,), _NEG * qk_scale, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                l0 = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                carry = lax.fori_loop(0, n_free, functools.partial(page_step, masked=False), (acc0, m0, l0, t))
                acc, m_i, l_i, t = lax.fori_loop(n_free, n, functools.partial(page_step, masked=True), carry)

                @pl.when(n > 0)
                def _():
                    l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
                    o = acc * lax.broadcast_in_dim(1.0 / l_safe, (ROWS, d), [0])
                    q_tile[...] = o.astype(dtype)                # q is spent: its slot stages the o rows
                    l_smem.at[wg][...] = jnp.where(l_i == 0.0, -jnp.inf, m_i * _LN2 + jnp.log(l_safe))
                    plgpu.commit_smem()
                    rows = pl.ds(wg * ROWS, ROWS)
                    plgpu.copy_smem_to_gmem(q_tile, o_ref.at[b, g, r, sp, rows])
                    plgpu.copy_smem_to_gmem(l_smem.at[wg], l_ref.at[b, g, r, sp, rows])
                return t, nq + (n > 0).astype(jnp.int32)
            total, nq_total = lax.fori_loop(0, count, item, (jnp.int32(0), jnp.int32(0)))
            if pingpong:                # warpgroup 0 catches up
                pl.when((wg == 0) & (total > 0))(schedule)

            @pl.when(nq_total >= 1)
            def _():
                release(nq_total - 1)
            plgpu.wait_smem_to_gmem(0)

    itemsize = jnp.dtype(dtype).itemsize
    extra = {}
    if pingpong:
        extra["sched"] = plgpu.Barrier(num_arrivals=nwg)
    if p_in_smem:
        extra["p_smem"] = plgpu.SMEM((nwg, ROWS, page), dtype, transforms=mosaic_smem_transforms(page, itemsize))
    pl.run_scoped(
        scope,
        q_smem=plgpu.SMEM((2, nwg, ROWS, d), dtype, transforms=mosaic_smem_transforms(d, itemsize)),
        pos_smem=plgpu.SMEM((2, nwg, ROWS), jnp.int32),
        l_smem=plgpu.SMEM((nwg, ROWS), jnp.float32),
        k_smem=plgpu.SMEM((stages, page, d), dtype, transforms=mosaic_smem_transforms(d, itemsize)),
        v_smem=plgpu.SMEM((stages, page, d), dtype, transforms=mosaic_smem_transforms(d, itemsize)),
        q_ready=plgpu.Barrier(num_arrivals=2, num_barriers=2 * nwg),
        q_free=plgpu.Barrier(num_arrivals=nwg, num_barriers=2),
        k_ready=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        v_ready=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),
        v_free=plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),
        **extra,
        collective_axes="wg",
    )


def default_ctas(interpret: bool = False) -> int:
    """CTAs of a persistent launch: the first device's SM count (132 where it reports none); 4 when
    interpreted (several items per CTA, quickly)."""
    return 4 if interpret else gpu_sm_count()


def schedule_items(lim, q_min_pos, *, g, pps, nsplit, ctas, page, ids=None, items=None):
    """The persistent launch's work list: items (request, kv group, row block, split) in that order, each
    ``(j0, n, n_free)`` (first slot, slots to walk, how many of the first of them every row of the block sees
    whole, i.e. need no causal mask), and each CTA's contiguous range of items, balanced by ``n + 1`` (its
    pages plus about a page for the item itself); with at least as many CTAs as items, CTA c runs item c and
    no ranges are built.

    Args: lim, pps, nsplit, ids as ``paged_decode_wgmma``; q_min_pos ``[B, R]`` int32: the lowest position
      of a row block's rows (-1 with a padding row); g: kv groups; ctas: CTAs of the launch; page: tokens
      per page; items: the items ``[B, G, R, nsplit, 3]`` when already built (``gpu_union.union_pages_gpu``
      with ``positions``: no XLA work here).
    Returns: ``(meta [B * G * R * nsplit, 3] int32, bounds [ctas + 1] int32 or None)``: CTA c takes the items
      ``[bounds[c], bounds[c + 1])``; None when ``ctas`` >= the item count (CTA c takes item c).
    """
    bsz, nr = q_min_pos.shape
    free_pages = (q_min_pos + 1) // page                              # [B, R] pages every row sees whole
    if items is not None:
        meta = items.reshape(-1, 3).astype(jnp.int32)
    elif ids is not None:                                             # shared: lim = starts [B, G, R, nsplit + 1]
        j0 = lim[..., :-1]
        n = jnp.maximum(lim[..., 1:] - j0, 0)
        below = (ids >= 0) & (ids < free_pages[:, None, :, None])      # a split's slots ascend: a prefix of it
        cnt = jnp.concatenate([jnp.zeros(below.shape[:-1] + (1,), jnp.int32),
                               jnp.cumsum(below, axis=-1, dtype=jnp.int32)], axis=-1)
        n_free = jnp.take_along_axis(cnt, j0 + n, axis=-1) - jnp.take_along_axis(cnt, j0, axis=-1)
    else:                                                             # dense: lim [B] pages to walk
        j0 = jnp.broadcast_to(jnp.arange(nsplit, dtype=jnp.int32) * pps, (bsz, g, nr, nsplit))
        n = jnp.clip(lim[:, None, None, None] - j0, 0, pps)
        n_free = jnp.clip(free_pages[:, None, :, None] - j0, 0, n)
    if items is None:
        meta = jnp.stack([j0, n, n_free], axis=-1).reshape(-1, 3).astype(jnp.int32)
    if ctas >= meta.shape[0]:     # an item per CTA (small batches): nothing to balance, no launches for it
        return meta, None
    w = meta[:, 1] + 1
    before = jnp.cumsum(w) - w                                        # weight of the items before each
    tot, c = jnp.sum(w), jnp.arange(ctas, dtype=jnp.int32)
    targets = c * (tot // ctas) + (c * (tot % ctas)) // ctas          # c * tot // ctas without int32 overflow
    # common.searchsorted: jnp.searchsorted's default lowers to an XLA while loop, a host round trip per
    # iteration on a GPU, which stalls every decode step (and layer) behind it
    bounds = jnp.concatenate([searchsorted(before, targets, side="left"), jnp.full((1,), meta.shape[0], jnp.int32)])
    return meta, bounds


def paged_decode_wgmma(qr, pos, lim, page_table, k_flat, v_flat, *, page, pps, nsplit, stages=2, interpret=False,
                       ids=None, bits=None, hg=1, ctas=None, pingpong=True, items=None):
    """Split-KV partials of paged decode attention (Hopper, Mosaic GPU): dense, or shared sparse tiles.

    Args: qr ``[B, G, R, M, D]`` (``common.pack_rows``; M = 64 or 128 rows), pos ``[B, R, M]`` int32 (-1 =
      padding row), lim ``[B]`` int32 logical pages to walk per request, page_table ``[B, NP]`` int32,
      k_flat / v_flat ``[G, P * page, D]`` (physical page p = rows ``[p * page, (p + 1) * page)``);
      pps: pages per split; nsplit: splits (split s walks logical pages ``[s * pps, min((s + 1) * pps,
      lim))``); stages: K/V ring slots; interpret: the Mosaic GPU interpreter (jax >= 0.11).
      Shared sparse (MSA) tiles: ids / bits ``[B, G, R, U]`` and lim = starts ``[B, G, R, nsplit + 1]``
      from ``common.union_pages`` (split s walks slots ``[starts[s], starts[s + 1])``; a row sees a page
      only if bit ``row // hg`` of its slot's bits is set); pps unused.
      ctas: CTAs of the persistent launch (None: the GPU's SM count, 132 if it reports none; 4 when
      interpreted; with at least as many CTAs as work items, CTA c runs item c); pingpong: with 128-row
      tiles, the two compute warpgroups take turns on the tensor cores; items: shared tiles' work items
      ``[B, G, R, nsplit, 3]`` when built with the union (``schedule_items``).
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
    if ctas is None:
        ctas = default_ctas(interpret)
    n_items = bsz * g * nr * nsplit
    ctas = max(1, min(int(ctas), n_items))
    meta, bounds = schedule_items(lim.astype(jnp.int32), jnp.min(pos, axis=-1).astype(jnp.int32), g=g, pps=pps,
                                  nsplit=nsplit, ctas=ctas, page=page, ids=ids.astype(jnp.int32) if shared else None,
                                  items=items)
    one_each = bounds is None
    if one_each:        # CTA c runs item c; the kernel reads no bounds (meta stands in for the operand)
        bounds = meta
    body = functools.partial(_body, page=page, stages=stages, scale=1.0 / math.sqrt(d), g_count=g, nr=nr,
                             nsplit=nsplit, nwg=nwg, hg=hg, shared=shared, p_in_smem=p_in_smem,
                             pingpong=bool(pingpong) and nwg == 2, one_each=one_each)
    if not shared:
        ids = bits = jnp.zeros((1, 1, 1, 1), jnp.int32)
    kernel = plgpu.kernel(
        body,
        out_type=[typed_out_struct((bsz, g, nr, nsplit, m, d), qr.dtype, qr),
                  typed_out_struct((bsz, g, nr, nsplit, m), jnp.float32, qr)],
        grid=(ctas,), grid_names=("c",),
        num_threads=nwg + 1, thread_name="wg", kernel_name="paged_decode_wgmma",
        interpret=mosaic_interpret_params("paged_decode_wgmma", nwg + 1) if interpret else None,
    )
    o, lse = kernel(bounds, meta, page_table.astype(jnp.int32), pos.astype(jnp.int32), ids.astype(jnp.int32),
                    bits.astype(jnp.int32), qr, k_flat, v_flat)
    walked = (meta[:, 1] > 0).reshape(bsz, g, nr, nsplit, 1)          # empty items write nothing
    return jnp.where(walked[..., None], o, jnp.zeros((), o.dtype)), jnp.where(walked, lse, -jnp.inf)
