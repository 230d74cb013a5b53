"""MSA sparse attention forward on Hopper, KV-outer: the work list of ``gpu_sparse_fwd`` with a
warp-specialised Pallas Mosaic GPU kernel (TMA + ``wgmma``) per program.

Math: MSA_SPEC.md section 3 (contract of ``gpu_sparse_fwd.sparse_fwd_kv_outer``: same arguments,
same outputs). Schedule: ``gpu_sparse_fwd.worklist`` (sorted work list, program i takes the fixed
slice [i*C, (i+1)*C) of its group's list, runs = one K/V window) and ``gpu_sparse_fwd._combine``
(LSE merge of the K partials). Per CTA (slice i, group g, batch row b), three warpgroups:

- at the start, the memory warpgroup TMAs the slice's work-list entries (token-slot, window start, run end)
  into SMEM, where all three warpgroups read them;
- memory warpgroup: per run, TMA of the K and V window [B_blk, D] into one of two SMEM slots (one
  when they do not fit); per row tile of 64 rows (64 / sr selections x sr head rows, sr = ``head_slot(H/G)``), one TMA
  per selection of its token's sr contiguous q rows into a 2-stage q ring per compute warpgroup, plus the tile's 64
  visible-key intervals;
- two compute warpgroups take the tiles of a run alternately: S = Q K^T (``wgmma``, fp32), the
  mask (each row sees the keys of one interval of window columns), the exact softmax of the one
  block, P (q.dtype, registers) @ V (``wgmma``), normalise, then TMA stores of the partial o rows
  (q.dtype) and LSEs (f32) of each live selection to (token, slot).

The per-row intervals come from XLA: under the storage-layout contract (layout.py) the keys of a
segment occupy storage [j0, j1] with kv_pos = j - base, so row (block n, query position p) sees the
window columns [max(base + nB, j0), min(base + min(nB + B - 1, p), j1)] - window start; a query
of segment < 0 (or none found) sees nothing. Rows past a run's end compute on a valid token and
are not stored.

TMA row offsets into 8-row tiled SMEM must be multiples of 8: a window starting off an 8-row
boundary (packed documents of unaligned lengths) is loaded from the aligned row below it with 64
more rows (the ``wgmma`` contraction of P V needs a multiple of 64); a second compiled variant with
room for such windows (one K/V slot at B = 128) runs when any window is unaligned (``lax.cond``).

Restrictions: ``wgmma_supported`` (bf16 / f16, H/G <= 64, D = Dv in {64, 128}, B in {64, 128}).
H/G not in {8, 16, 32, 64} runs in padded head slots (``head_slot``: q padded in XLA, spare rows
computed and dropped). Served through the ops registry as ``pallas_hopper_gpu`` (gpu_attention.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import mosaic_interpret_params, mosaic_load_rows, mosaic_smem_transforms, typed_out_struct
from pallas_kernels.msa import layout
from pallas_kernels.msa.gpu_sparse_fwd import _combine, check_launch, default_query_chunk, worklist

__all__ = ["sparse_fwd_wgmma", "wgmma_supported", "head_slot", "to_head_slots", "from_head_slots", "WorkTables",
           "ROWS", "DTYPES"]

ROWS = 64                      # rows per tile: one wgmma M per compute warpgroup
_TAB_PIECE = 256               # work-list entries per TMA copy of the SMEM tables (a TMA's limit)
_WIDE = 64                     # extra window rows when a window starts off an 8-row boundary (wgmma K % 64)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_SMEM_BYTES = 227 * 1024
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))   # what the wgmma kernels take


def _smem_bytes(widths, d, dv, itemsize, kv_slots, p_in_smem, chunk):
    """Shared memory of one CTA: K/V window slots, the q ring (4 stages, also staging o), lse, P and the
    slice's work-list tables (3 x chunk int32)."""
    kv = kv_slots * max(widths) * (d + dv) * itemsize
    q = 4 * ROWS * (d * itemsize + 2 * 4) + 2 * ROWS * 4
    p = p_in_smem * 2 * ROWS * sum(widths) * itemsize
    return kv + q + p + 3 * 4 * chunk + 1024


def _windows(blk, d, dv, itemsize, p_in_smem, wide_runs, interpret, chunk):
    """(window widths the kernel handles, K/V slots): B only, or B for aligned runs and B + 64 for the
    others (with P through SMEM on a device and no room for both P buffers: B + 64 for every run);
    two K/V slots where they fit. Raises ValueError when even one slot does not fit."""
    widths = (blk, blk + _WIDE) if wide_runs else (blk,)
    if (wide_runs and p_in_smem and not interpret
            and _smem_bytes(widths, d, dv, itemsize, 1, True, chunk) > _SMEM_BYTES):
        widths = (blk + _WIDE,)
    for slots in (2, 1):
        if interpret or _smem_bytes(widths, d, dv, itemsize, slots, p_in_smem, chunk) <= _SMEM_BYTES:
            return widths, slots
    raise ValueError(f"sparse_fwd_wgmma: windows {widths} x D={d}, Dv={dv} need more than "
                     f"{_SMEM_BYTES // 1024} KiB of shared memory")


def head_slot(hg: int) -> int:
    """q rows one selection occupies in a 64-row tile: H/G rounded up to 8, 16, 32 or 64 (TMA row
    offsets into 8-row tiled SMEM are multiples of 8); the padded rows compute and are dropped."""
    return next(r for r in (8, 16, 32, 64) if r >= hg)


def to_head_slots(x, g, sr, axis):
    """x [..., G*hg, ...] (heads on ``axis``) -> [..., G*sr, ...]: each kv group's hg head rows followed by
    sr - hg zero rows (its ``head_slot``); x itself when sr == hg."""
    hg = x.shape[axis] // g
    if sr == hg:
        return x
    y = x.reshape(x.shape[:axis] + (g, hg) + x.shape[axis + 1:])
    pad = [(0, 0)] * y.ndim
    pad[axis + 1] = (0, sr - hg)
    return jnp.pad(y, pad).reshape(x.shape[:axis] + (g * sr,) + x.shape[axis + 1:])


def from_head_slots(x, g, hg, axis):
    """The inverse of ``to_head_slots``: [..., G*sr, ...] -> [..., G*hg, ...], each group's spare rows dropped."""
    sr = x.shape[axis] // g
    if sr == hg:
        return x
    y = lax.slice_in_dim(x.reshape(x.shape[:axis] + (g, sr) + x.shape[axis + 1:]), 0, hg, axis=axis + 1)
    return y.reshape(x.shape[:axis] + (g * hg,) + x.shape[axis + 1:])


def wgmma_supported(q_shape, kv_shape, v_dim, dtype, block_size) -> str | None:
    """None when ``sparse_fwd_wgmma`` serves these shapes, else the reason (a short sentence).

    q_shape [B,T,H,D], kv_shape [B,S,G,D], v_dim Dv. Needs bf16 / f16, H/G <= 64 (a selection's q
    rows fill ``head_slot(H/G)`` rows of a 64-row tile: H/G = 6 computes 8 rows, 25 % spare), D = Dv
    in {64, 128} (the spent q tile stages the o rows; fp32 accumulators in registers), block 64 or 128.
    """
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not bf16 / f16"
    h, d = q_shape[2], q_shape[3]
    g = kv_shape[2]
    if g <= 0 or h % g or h // g > 64:
        return f"heads per group {h}/{g}: need an integer <= 64"
    if d != v_dim or d not in (64, 128):
        return f"head dims D={d}, Dv={v_dim}: need D = Dv in (64, 128)"
    if block_size not in (64, 128):
        return f"block size {block_size} not in (64, 128)"
    return None


class WorkTables:
    """A program's slice [lo, hi) of its group's sorted work list (``worklist``: flat token-slot, window start,
    run end), copied into SMEM once by the memory warpgroup and read there by every warpgroup instead of as
    scalar global loads per tile (BENCHMARKS.md, MSA forward schedule probe). ``per``: selections per tile."""

    def __init__(self, lo, hi, chunk, per):
        self.lo, self.hi, self.chunk, self.per, self.smem = lo, hi, chunk, per, None

    @staticmethod
    def barrier(chunk):
        """The barrier ``load``'s copies arrive on (one arrival per TMA copy of <= 256 entries)."""
        return plgpu.Barrier(num_arrivals=3 * -(-chunk // _TAB_PIECE), num_barriers=1)

    def load(self, tab_smem, refs, b, g, ready, issue):
        """Bind ``tab_smem`` (int32 [3, chunk]); where ``issue`` (the memory warpgroup), TMA the slice of
        ``refs`` (flat, key, rend: int32 [B, G, N]) into it; every warpgroup then waits on ``ready``."""
        self.smem = tab_smem

        @pl.when(issue)
        def _():
            for n, ref in enumerate(refs):
                for c0 in range(0, self.chunk, _TAB_PIECE):     # a TMA copies <= 256 elements per dimension
                    w = min(_TAB_PIECE, self.chunk - c0)
                    plgpu.copy_gmem_to_smem(ref.at[b, g, pl.ds(pl.multiple_of(self.lo + c0, 8), w)],
                                            tab_smem.at[n, pl.ds(c0, w)], ready.at[0])
        plgpu.barrier_wait(ready.at[0])

    def entry(self, name, idx):
        """Work-list entry ``idx`` (absolute, in [lo, lo + chunk)) of table flat / key / rend, from SMEM."""
        return self.smem[("flat", "key", "rend").index(name), idx - self.lo]

    def walk(self, per_run):
        """The slice's runs in order: per_run(a, end, run index, tiles before it, its tiles, w0);
        returns (end, runs, tiles)."""
        def step(c):
            a, ri, ct = c
            end = jnp.minimum(self.entry("rend", a), self.hi)
            nt = lax.div(end - a + self.per - 1, self.per)
            per_run(a, end, ri, ct, nt, self.entry("key", a))
            return end, ri + 1, ct + nt
        return lax.while_loop(lambda c: c[0] < self.hi, step, (self.lo, jnp.int32(0), jnp.int32(0)))


def _intervals(ids, flat, key, qpos, base, j0, j1, blk, hg, pad):
    """Visible columns [lo, hi] of every sorted entry's loaded window (rows from 8 * floor(start / 8)),
    repeated per head: int32 [B,G,2,(N+pad)*hg]."""
    bsz, g, t, topk = ids.shape
    tk = flat // topk
    n = jnp.take_along_axis(ids.reshape(bsz, g, t * topk), flat, axis=2)
    gat = lambda x: jax.vmap(lambda xb, tb: xb[tb])(x, tk.reshape(bsz, -1)).reshape(tk.shape)
    p, bs, a, z = gat(qpos), gat(base), gat(j0), gat(j1)
    ok = (n >= 0) & (key != jnp.iinfo(jnp.int32).max)
    w0 = jnp.where(ok, key - key % 8, 0)                             # the loaded window's first row
    lo = jnp.maximum(bs + n * blk, a) - w0
    hi = jnp.minimum(bs + jnp.minimum(n * blk + blk - 1, p), z) - w0
    lo = jnp.where(ok, jnp.clip(lo, 0, blk + _WIDE), blk + _WIDE)
    hi = jnp.where(ok, jnp.clip(hi, -1, blk + _WIDE - 1), -1)
    lims = jnp.stack([lo, hi], axis=2)                               # [B,G,2,N]
    lims = jnp.pad(lims, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=-1)
    return jnp.repeat(lims, hg, axis=3).astype(jnp.int32)


def _body(flat_ref, key_ref, rend_ref, nval_ref, qoff_ref, lims_ref, q_ref, k_ref, v_ref, op_ref, lp_ref, *,
          blk, topk, sr, per, chunk, kv_slots, scale, p_in_smem, widths):
    """One CTA (sr: the head slot, ``head_slot(H/G)``; q, op and lp carry G * sr head rows; q holds every
    query token, the pass's tokens from ``qoff_ref[0]`` on, so no pass copies its q rows). The slice's
    work-list entries (flat, window start, run end) are copied into SMEM once (``tab_smem``) and read from
    there, not as scalar global loads per tile (BENCHMARKS.md, MSA forward schedule probe)."""
    i, g, b = lax.axis_index("i"), lax.axis_index("g"), lax.axis_index("b")
    lo = i * chunk
    hi = jnp.minimum(lo + chunk, nval_ref[b, g])
    dtype = q_ref.dtype
    d, dv = q_ref.shape[-1], v_ref.shape[-1]
    heads = pl.ds(g * sr, sr)
    nrows = max(widths)

    def choices(w0):
        """(window width, predicate) per variant: the B-row window for aligned runs where there are two."""
        if len(widths) == 1:
            return ((widths[0], True),)
        aligned = lax.rem(w0, 8) == 0
        return ((widths[0], aligned), (widths[1], ~aligned))

    tables = WorkTables(lo, hi, chunk, per)
    entry, walk = tables.entry, tables.walk

    def stage(cc):
        """q ring stage of the CTA's tile cc: tiles alternate between the compute warpgroups."""
        return lax.rem(cc, 2) * 2 + lax.rem(lax.div(cc, 2), 2)

    def scope(k_smem, v_smem, q_smem, lim_smem, l_smem, tab_smem, kv_ready, kv_free, q_ready, q_free, tab_ready,
              p_smem=None):
        wg = lax.axis_index("wg")
        tables.load(tab_smem, (flat_ref, key_ref, rend_ref), b, g, tab_ready, wg == 2)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            qoff = qoff_ref[0]

            def per_run(a, end, ri, ct, nt, w0):
                slot = lax.rem(ri, kv_slots)

                @pl.when(ri >= kv_slots)
                def _():
                    plgpu.barrier_wait(kv_free.at[slot])
                off = lax.rem(w0, 8)
                # TMA row offsets into 8-row tiled SMEM are multiples of 8: an unaligned window start
                # loads _WIDE more rows from the aligned row below it.
                for n_rows, pred in choices(w0):
                    @pl.when(pred)
                    def _(n_rows=n_rows):
                        rows = pl.ds(pl.multiple_of(w0 - off, 8), n_rows)
                        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, g], k_smem.at[slot, pl.ds(0, n_rows)],
                                                kv_ready.at[slot])
                        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, g], v_smem.at[slot, pl.ds(0, n_rows)],
                                                kv_ready.at[slot])

                def tile(si, carry):
                    cc = ct + si
                    qs = stage(cc)

                    @pl.when(cc >= 4)
                    def _():
                        plgpu.barrier_wait(q_free.at[qs])
                    e0 = a + si * per
                    for j in range(per):
                        t = lax.div(entry("flat", jnp.minimum(e0 + j, end - 1)), topk)
                        plgpu.copy_gmem_to_smem(q_ref.at[b, qoff + t, heads], q_smem.at[qs, pl.ds(j * sr, sr)],
                                                q_ready.at[qs])
                    plgpu.copy_gmem_to_smem(lims_ref.at[b, g, :, pl.ds(pl.multiple_of(e0 * sr, 8), ROWS)],
                                            lim_smem.at[qs], q_ready.at[qs])
                    return carry
                lax.fori_loop(0, nt, tile, None)

            _, nr, ntiles = walk(per_run)

            def drain_kv(r, carry):     # observe the last releases before the barriers go away
                plgpu.barrier_wait(kv_free.at[lax.rem(r, kv_slots)])
                return carry
            lax.fori_loop(jnp.maximum(nr - kv_slots, 0), nr, drain_kv, None)

            def drain_q(cc, carry):
                plgpu.barrier_wait(q_free.at[stage(cc)])
                return carry
            lax.fori_loop(jnp.maximum(ntiles - 4, 0), ntiles, drain_q, None)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qk_scale = scale * _LOG2E

            def release(cc):
                """The stage of this warpgroup's tile cc, once the TMA stores of its o / lse read it."""
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(q_free.at[stage(cc)])

            def tile(a, end, ct, slot, ncols, cc):
                qs = stage(cc)
                e0 = a + (cc - ct) * per
                # the selections' (token, slot) first: their loads' latency hides behind the wgmmas
                flats = [entry("flat", jnp.minimum(e0 + j, end - 1)) for j in range(per)]
                plgpu.barrier_wait(q_ready.at[qs])
                c_lo = mosaic_load_rows(lim_smem.at[qs, 0])
                c_hi = mosaic_load_rows(lim_smem.at[qs, 1])
                k_win = k_smem.at[slot, pl.ds(0, ncols)]
                v_win = v_smem.at[slot, pl.ds(0, ncols)]

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem.at[qs], k_win.transpose((1, 0)))
                    return acc_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((ROWS, ncols), jnp.float32))
                col = plgpu.broadcasted_iota(jnp.int32, (ROWS, ncols), 1, layout=plgpu.Layout.WGMMA)
                vis = ((col >= lax.broadcast_in_dim(c_lo, (ROWS, ncols), [0]))
                       & (col <= lax.broadcast_in_dim(c_hi, (ROWS, ncols), [0])))
                s = jnp.where(vis, s * qk_scale, -jnp.inf)
                m = jnp.max(s, axis=1)
                m_safe = jnp.where(m == -jnp.inf, 0.0, m)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, (ROWS, ncols), [0]))
                l = jnp.sum(p, axis=1)
                p16 = p.astype(dtype)
                if p_smem is not None:          # P through SMEM (the interpreter's wgmma reads SMEM only)
                    p_ref = p_smem[ncols].at[wg]
                    p_ref[...] = p16
                    plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16 if p_smem is None else p_ref, v_win)
                    return acc_ref[...]
                o = pl.run_scoped(pv, plgpu.ACC((ROWS, dv), jnp.float32))
                l_safe = jnp.where(l == 0.0, 1.0, l)
                o = o * lax.broadcast_in_dim(1.0 / l_safe, (ROWS, dv), [0])
                lse = jnp.where(l == 0.0, -jnp.inf, m_safe * _LN2 + jnp.log(l_safe))

                @pl.when(cc >= 2)
                def _():
                    release(cc - 2)             # this warpgroup's previous tile
                o_ref = q_smem.at[qs]           # the q tile is spent: it stages the o rows
                o_ref[...] = o.astype(dtype)
                l_smem.at[wg][...] = lse
                plgpu.commit_smem()
                for j, f in enumerate(flats):
                    @pl.when(e0 + j < end)
                    def _(f=f):
                        t = lax.div(f, topk)
                        sk = f - t * topk
                        plgpu.copy_smem_to_gmem(o_ref.at[pl.ds(j * sr, sr)], op_ref.at[b, t, sk, heads])
                        plgpu.copy_smem_to_gmem(l_smem.at[wg, pl.ds(j * sr, sr)], lp_ref.at[b, t, sk, heads])

            def per_run(a, end, ri, ct, nt, w0):
                slot = lax.rem(ri, kv_slots)
                plgpu.barrier_wait(kv_ready.at[slot])
                first = ct + lax.rem(wg - lax.rem(ct, 2) + 2, 2)       # this warpgroup's first tile
                mine = jnp.maximum(lax.div(ct + nt - first + 1, 2), 0)
                for ncols, pred in choices(w0):
                    @pl.when(pred)
                    def _(ncols=ncols):
                        def step(u, carry):
                            tile(a, end, ct, slot, ncols, first + 2 * u)
                            return carry
                        lax.fori_loop(0, mine, step, None)
                plgpu.barrier_arrive(kv_free.at[slot])

            _, _, ntiles = walk(per_run)
            last = ntiles - 1 - lax.rem(ntiles - 1 - wg + 2, 2)          # this warpgroup's last tile

            @pl.when(last >= 0)
            def _():
                release(last)
            plgpu.wait_smem_to_gmem(0)

    itemsize = jnp.dtype(dtype).itemsize
    extra = {}
    if p_in_smem:
        extra["p_smem"] = {n: plgpu.SMEM((2, ROWS, n), dtype, transforms=mosaic_smem_transforms(n, itemsize))
                           for n in widths}
    pl.run_scoped(
        scope,
        k_smem=plgpu.SMEM((kv_slots, nrows, d), dtype, transforms=mosaic_smem_transforms(d, itemsize)),
        v_smem=plgpu.SMEM((kv_slots, nrows, dv), dtype, transforms=mosaic_smem_transforms(dv, itemsize)),
        q_smem=plgpu.SMEM((4, ROWS, d), dtype, transforms=mosaic_smem_transforms(d, itemsize)),
        lim_smem=plgpu.SMEM((4, 2, ROWS), jnp.int32),
        l_smem=plgpu.SMEM((2, ROWS), jnp.float32),
        tab_smem=plgpu.SMEM((3, chunk), jnp.int32),
        kv_ready=plgpu.Barrier(num_arrivals=2, num_barriers=kv_slots),
        kv_free=plgpu.Barrier(num_arrivals=2, num_barriers=kv_slots),
        q_ready=plgpu.Barrier(num_arrivals=per + 1, num_barriers=4),
        q_free=plgpu.Barrier(num_arrivals=1, num_barriers=4),
        tab_ready=WorkTables.barrier(chunk),
        **extra,
        collective_axes="wg",
    )


def _partials(q, q_off, k_pad, v_pad, ids, starts, qpos, base, j0, j1, *, hg, blk, chunk, interpret, p_in_smem):
    """Per-(token, slot) partials (o [B,T,K,H,Dv] q.dtype, lse [B,T,K,H] f32) of the T = ids.shape[2] query
    tokens from ``q_off`` (int32 [1]) on; q [B,Tq,G*sr,D] already in head slots (``to_head_slots``).
    Unused pairs undefined."""
    bsz, _, _, d = q.shape
    t = ids.shape[2]
    g = k_pad.shape[2]
    dv = v_pad.shape[-1]
    topk = ids.shape[-1]
    sr = head_slot(hg)
    per = ROWS // sr
    n_items = -(-t * topk // chunk)
    flat, key, run_end, n_valid = worklist(ids, starts)
    lims = _intervals(ids, flat, key, qpos, base, j0, j1, blk, sr, per)
    # every slice's table copy in bounds (the padding entries are never read)
    flat, key, run_end = (jnp.pad(x, ((0, 0), (0, 0), (0, n_items * chunk - t * topk))) for x in (flat, key, run_end))
    p_in_smem = bool(interpret or p_in_smem)
    params = mosaic_interpret_params("sparse_fwd_wgmma") if interpret else None

    def call(wide_runs):
        widths, kv_slots = _windows(blk, d, dv, q.dtype.itemsize, p_in_smem, wide_runs, interpret, chunk)
        body = functools.partial(_body, blk=blk, topk=topk, sr=sr, per=per, chunk=chunk, scale=1.0 / math.sqrt(d),
                                 p_in_smem=p_in_smem, widths=widths, kv_slots=kv_slots)
        kernel = plgpu.kernel(
            body,
            out_type=[typed_out_struct((bsz, t, topk, g * sr, dv), q.dtype, q),
                      typed_out_struct((bsz, t, topk, g * sr), jnp.float32, q)],
            grid=(n_items, g, bsz), grid_names=("i", "g", "b"),
            num_threads=3, thread_name="wg", kernel_name="msa_sparse_fwd_wgmma",
            interpret=params,
        )
        return lambda *a: tuple(kernel(*a))
    # Every window 8-row aligned (positions from 0 in every stored run, blocks of 64 / 128: the common
    # case): windows of exactly B rows, two K/V slots. Otherwise the kernel that also loads wide windows.
    aligned = jnp.all((key % 8 == 0) | (key == jnp.iinfo(jnp.int32).max))
    # the spare rows of the head slots (q was padded by the caller) dropped from the partials
    args = (flat, key, run_end, n_valid, q_off, lims, q, k_pad, v_pad)
    op, lp = lax.cond(aligned, call(False), call(True), *args)
    return from_head_slots(op, g, hg, 3), from_head_slots(lp, g, hg, 3)


def sparse_fwd_wgmma(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, *,
                     block_size, interpret=False, num_warps=None, num_stages=None, chunk=128, rows=None,
                     query_chunk=None, p_in_smem=False):
    """KV-outer MSA forward on Hopper: (o [B,T,H,Dv] q.dtype, lse [B,T,H] f32 natural log, -inf: no key).

    Arguments and outputs as ``gpu_sparse_fwd.sparse_fwd_kv_outer`` (``num_warps`` / ``num_stages`` /
    ``rows`` are Triton knobs, accepted and ignored: tiles are 64 rows; ``chunk`` must be a multiple of
    32). ``interpret``: the Mosaic GPU interpreter (jax >= 0.11). ``p_in_smem``: feed P to the second
    ``wgmma`` from SMEM instead of registers (always so in the interpreter, whose ``wgmma`` reads SMEM
    operands only). Raises ValueError for shapes ``wgmma_supported`` refuses and for launch arguments
    ``gpu_sparse_fwd.check_launch`` refuses. Unlike the Triton kernel, windows are not re-checked key by
    key: the storage-layout contract (layout.py) is a precondition.
    """
    del num_warps, num_stages, rows
    # each TMA copy of the SMEM work-list tables moves a multiple of 128 bytes (32 int32 entries)
    check_launch(chunk=chunk, query_chunk=query_chunk, chunk_multiple=32)
    layout.check_shapes(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    why = wgmma_supported(q.shape, k.shape, v.shape[-1], q.dtype, block_size)
    if why is not None:
        raise ValueError(f"sparse_fwd_wgmma: {why}")
    if not k.dtype == v.dtype == q.dtype:
        raise ValueError(f"sparse_fwd_wgmma: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    bsz, t, h, _ = q.shape
    topk = block_ids.shape[-1]
    prep = layout.prepare(k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_size)
    ids = layout.dedupe_ids(block_ids)
    starts = layout.window_starts(ids, prep.base, block_size, prep.s_pad)
    qpos = q_positions.astype(jnp.int32)
    j0, j1 = jax.vmap(layout.segment_runs)(prep.kv_seg, prep.q_seg)
    # _WIDE zero rows past the keys: a wide window of the last block stays inside the array
    k_pad, v_pad = (jnp.pad(x, ((0, 0), (0, _WIDE), (0, 0), (0, 0))) for x in (prep.k, prep.v))
    if query_chunk is None:
        # the partials hold G padded head slots per (token, slot)
        query_chunk = default_query_chunk(bsz, k.shape[2] * head_slot(h // k.shape[2]), v.shape[-1], topk,
                                          q.dtype.itemsize)
    hg = h // k.shape[2]

    # q in head slots once; every pass reads its tokens' rows from it at an offset (no per-pass q copy)
    q_slots = to_head_slots(q, k.shape[2], head_slot(hg), 2)

    def run(q_off, ids, starts, qpos, base, j0, j1):      # q_seg is folded into j0 / j1
        op, lp = _partials(q_slots, q_off, k_pad, v_pad, ids, starts, qpos, base, j0, j1, hg=hg, blk=block_size,
                           chunk=chunk, interpret=interpret, p_in_smem=p_in_smem)
        return _combine(op, lp, ids, hg)

    args = (ids, starts, qpos, prep.base, j0, j1)
    axes = (2, 2, 1, 1, 1, 1)
    if t <= query_chunk:
        return run(jnp.zeros((1,), jnp.int32), *args)
    # One compiled loop over query chunks (as gpu_sparse_fwd.sparse_fwd_kv_outer): the last chunk is
    # clamped to end at T and recomputes a few tokens identically.
    n_c = -(-t // query_chunk)

    def body(c, carry):
        a = jnp.minimum(c * query_chunk, t - query_chunk)
        oc, lc = run(a.reshape(1).astype(jnp.int32),
                     *(lax.dynamic_slice_in_dim(x, a, query_chunk, ax) for x, ax in zip(args, axes)))
        return (lax.dynamic_update_slice_in_dim(carry[0], oc, a, 1),
                lax.dynamic_update_slice_in_dim(carry[1], lc, a, 1))

    init = (jnp.zeros((bsz, t, h, v.shape[-1]), q.dtype), jnp.zeros((bsz, t, h), jnp.float32))
    return lax.fori_loop(0, n_c, body, init)
