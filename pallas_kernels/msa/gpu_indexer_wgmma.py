"""MSA indexer on Hopper (Pallas Mosaic GPU: TMA + ``wgmma``): index scores, block max-pool and the
running top-(K - init - L), fused; neither [T, S] scores nor [T, NB] block scores reach memory.

Math: MSA_SPEC.md sections 1-2, as ``gpu_indexer.block_topk_gpu`` (same arguments, same outputs):
s[r,i,j] = <qi[i,r], ki[j]> / sqrt(Di); block score = max of s over the visible keys of the block;
each row (token, index head) ranks its complete blocks init <= n <= local - L and keeps the best
(ties: lower id); the forced blocks are added by ``select.assemble_ids``.

Kernel (one CTA per row tile of 128 rows = 128 / Hi tokens x Hi heads, per batch row; the longest
row tiles are launched first). Rows are the (token, head) pairs, so all Hi heads share the single
index key tile: one GEMM [128, Di] x [Di, B] per key tile. Three warpgroups:
- memory: TMA of the CTA's q rows and per-row tables once, then the key tiles of the walk into a
  ring of SMEM stages;
- two compute warpgroups of 64 rows each: S = Q K^T (``wgmma``, fp32), the row max (the block
  score: a key tile is one block when segments start on block boundaries), and an insertion network
  over the sorted top list held in registers (W value and id vectors in the accumulator's row
  layout): slot k keeps the larger of (its entry, the carried candidate) and passes the other on;
  ties keep the entry already there, which has the lower block id because tiles are walked in
  increasing order. No per-row branches, no data-dependent indexing.
The walk per row tile is [t_lo, fast_end) mask-free (``gpu_indexer.fast_tile_ends``: tiles every row
sees whole, one block each) then [fast_end, t_hi) masked: under the storage-layout contract (layout.py)
a row sees the storage interval [j0, min(j1, base + q_pos)] of its segment, and a tile's columns split
into the end of block n0 (columns < c_split, completed with the previous tile's tail) and the start of
block n0 + 1 (carried to the next tile); both are per-row constants computed in XLA, so the kernel
does no division. t_hi stops at the last key of the last rankable block (the local block is never
ranked; whether a row sees its local block, ``local_ok``, is computed in XLA from the same interval).

Restrictions (``wgmma_indexer_supported``): bf16 / f16 / float8_e4m3fn (FP8 ``wgmma``), Hi dividing 64,
Di a multiple of 64 up to 256, B in {64, 128, 256}, two key tiles beside the q rows in shared memory
(the registry's ``auto`` takes the Triton kernel otherwise). Windows are not
re-checked key by key: the storage-layout contract is a precondition (as for the Triton kernels,
checked by the ops layer when the positions are concrete).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (mosaic_interpret_params, mosaic_load_rows, mosaic_smem_transforms,
                                   typed_out_struct)
from pallas_kernels.msa import layout, select
from pallas_kernels.msa.gpu_indexer import fast_tile_ends

__all__ = ["block_topk_wgmma", "msa_select_blocks_wgmma", "wgmma_indexer_supported", "quantize_index_fp8", "ROWS"]

ROWS = 64                       # rows per compute warpgroup (one wgmma M)
CTA_ROWS = 2 * ROWS             # rows per CTA
_SMEM_BYTES = 227 * 1024
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float8_e4m3fn))
_N_TAB = 8                      # per-row table rows (6 used), 8 for aligned TMA boxes


def wgmma_indexer_supported(qi_shape, ki_shape, dtype, block_size) -> str | None:
    """None when ``block_topk_wgmma`` serves these shapes, else the reason (a short sentence).

    qi_shape [B,T,Hi,Di], ki_shape [B,S,Di]. Needs bf16 / f16 / float8_e4m3fn, Hi dividing 64 (a
    compute warpgroup's 64 rows hold whole tokens), Di a multiple of 64 up to 256, B in {64, 128, 256}.
    """
    if jnp.dtype(dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not bf16 / f16 / float8_e4m3fn"
    hi, di = qi_shape[2], qi_shape[3]
    if ROWS % hi:
        return f"index heads {hi} do not divide {ROWS}"
    if di % 64 or di > 256:
        return f"index dim {di} is not a multiple of 64 up to 256"
    if block_size not in (64, 128, 256):
        return f"block size {block_size} not in (64, 128, 256)"
    try:
        _stages(block_size, di, jnp.dtype(dtype).itemsize)
    except ValueError as e:
        return str(e)
    return None


def _stages(blk, di, itemsize):
    """Key-tile ring depth: as many stages (2..4) as fit beside the q rows."""
    q = CTA_ROWS * di * itemsize + 2 * _N_TAB * ROWS * 4
    tile = blk * (di * itemsize + 4)
    for n in (4, 3, 2):
        if q + n * tile + 1024 <= _SMEM_BYTES:
            return n
    raise ValueError(f"wgmma indexer: key tiles [{blk}, {di}] do not fit shared memory")


def _body(tiles_ref, tab_ref, q_ref, k_ref, ks_ref, tv_ref, ti_ref, *, blk, width, stages, n_rt, scale, fp8):
    r = n_rt - 1 - lax.axis_index("r")           # longest (latest) row tiles first
    b = lax.axis_index("b")
    t_lo = tiles_ref[b, r, 0]
    fast_end = tiles_ref[b, r, 1]
    t_hi = tiles_ref[b, r, 2]

    def scope(q_smem, k_smem, ks_smem, tab_smem, out_v, out_i, q_ready, k_ready, k_free):
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            for w in range(2):
                rows = pl.ds(r * CTA_ROWS + w * ROWS, ROWS)
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows], q_smem.at[w], q_ready.at[w])
                plgpu.copy_gmem_to_smem(tab_ref.at[b, :, rows], tab_smem.at[w], q_ready.at[w])

            def load(tile, carry):
                i = tile - t_lo
                slot = lax.rem(i, stages)

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])
                keys = pl.ds(pl.multiple_of(tile * blk, 8), blk)
                plgpu.copy_gmem_to_smem(k_ref.at[b, keys], k_smem.at[slot], k_ready.at[slot])
                if fp8:
                    plgpu.copy_gmem_to_smem(ks_ref.at[b, keys], ks_smem.at[slot], k_ready.at[slot])
                return carry
            lax.fori_loop(t_lo, t_hi, load, None)

            def drain(tile, carry):      # observe the last releases before the barriers go away
                plgpu.barrier_wait(k_free.at[lax.rem(tile - t_lo, stages)])
                return carry
            lax.fori_loop(jnp.maximum(t_hi - stages, t_lo), t_hi, drain, None)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(q_ready.at[wg])
            cb, c_split, vlo, vhi, lo_t, hi_t = (mosaic_load_rows(tab_smem.at[wg, i]) for i in range(6))
            bcast = lambda x: lax.broadcast_in_dim(x, (ROWS, blk), [0])
            row = lambda v, dt: plgpu.layout_cast(jnp.full((ROWS,), v, dt), plgpu.Layout.WGMMA.reduce(1))
            neg = row(-jnp.inf, jnp.float32)

            slot_of = lambda tile: lax.rem(tile - t_lo, stages)

            def scores(tile):
                """S = Q K^T of ``tile`` (f32 [ROWS, blk]; fp8: key scales applied); frees its stage."""
                slot = slot_of(tile)
                plgpu.barrier_wait(k_ready.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((ROWS, blk), jnp.float32))
                if fp8:                  # per-key dequantisation scale, one per column
                    ks = mosaic_load_rows(ks_smem.at[slot], axis=0)
                    s = s * lax.broadcast_in_dim(ks, (ROWS, blk), [1])
                plgpu.barrier_arrive(k_free.at[slot])
                return s

            def offer(tile, tv, ti, val):
                """Insert (val, block tile - cb) into the sorted lists where the block is rankable."""
                x = jnp.where((tile >= lo_t) & (tile <= hi_t), val, -jnp.inf)
                xi = tile - cb
                tv, ti = list(tv), list(ti)
                for k in range(width):
                    gt = x > tv[k]
                    tv[k], x = jnp.where(gt, x, tv[k]), jnp.where(gt, tv[k], x)
                    ti[k], xi = jnp.where(gt, xi, ti[k]), jnp.where(gt, ti[k], xi)
                return tuple(tv), tuple(ti)

            def fast(tile, carry):
                tv, ti = carry
                return offer(tile, tv, ti, jnp.max(scores(tile), axis=1))

            def masked(tile, carry):
                tv, ti, prev1 = carry
                s = scores(tile)
                col = plgpu.broadcasted_iota(jnp.int32, (ROWS, blk), 1, layout=plgpu.Layout.WGMMA)
                off = tile * blk
                vis = (col >= bcast(vlo - off)) & (col <= bcast(vhi - off))
                split = bcast(c_split)          # (logical_not of a mask does not lower: compare twice)
                p0 = jnp.max(jnp.where(vis & (col < split), s, -jnp.inf), axis=1)
                p1 = jnp.max(jnp.where(vis & (col >= split), s, -jnp.inf), axis=1)
                tv, ti = offer(tile, tv, ti, jnp.maximum(prev1, p0))
                return tv, ti, p1

            init = (tuple(neg for _ in range(width)), tuple(row(-1, jnp.int32) for _ in range(width)))
            tv, ti = lax.fori_loop(t_lo, fast_end, fast, init)
            tv, ti, _ = lax.fori_loop(fast_end, t_hi, masked, (tv, ti, neg))
            for k in range(width):
                out_v.at[wg, k][...] = tv[k] * scale
                out_i.at[wg, k][...] = ti[k]
            plgpu.commit_smem()
            rows = pl.ds(r * CTA_ROWS + wg * ROWS, ROWS)
            plgpu.copy_smem_to_gmem(out_v.at[wg], tv_ref.at[b, :, rows])
            plgpu.copy_smem_to_gmem(out_i.at[wg], ti_ref.at[b, :, rows])
            plgpu.wait_smem_to_gmem(0)

    dtype, di = q_ref.dtype, q_ref.shape[-1]
    itemsize = jnp.dtype(dtype).itemsize
    pl.run_scoped(
        scope,
        q_smem=plgpu.SMEM((2, ROWS, di), dtype, transforms=mosaic_smem_transforms(di, itemsize)),
        k_smem=plgpu.SMEM((stages, blk, di), dtype, transforms=mosaic_smem_transforms(di, itemsize)),
        ks_smem=plgpu.SMEM((stages, blk), jnp.float32) if fp8 else None,
        tab_smem=plgpu.SMEM((2, _N_TAB, ROWS), jnp.int32),
        out_v=plgpu.SMEM((2, width, ROWS), jnp.float32),
        out_i=plgpu.SMEM((2, width, ROWS), jnp.int32),
        q_ready=plgpu.Barrier(num_arrivals=2, num_barriers=2),
        k_ready=plgpu.Barrier(num_arrivals=2 if fp8 else 1, num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        collective_axes="wg",
    )


def _row_tables(qpos, qseg, base, j0, j1, *, blk, init_blocks, local_blocks, n_tiles, tq, fast_end):
    """Per-token tables of the kernel and the per-row-tile walk.

    Returns (tab int32 [B, 8, Tp] rows: cb = ceil(base / B) (block id = tile - cb), c_split, the visible
    storage interval [vlo, vhi], the rankable tile range [lo_t, hi_t]; tiles int32 [B, n_rt, 4]:
    t_lo, fast_end, t_hi, 0; local_ok bool [B, Tp]).
    """
    cb = -((-base) // blk)
    c_split = base - cb * blk + blk
    vhi = jnp.minimum(j1, base + qpos)
    vlo = j0
    local = qpos // blk
    hi_rank = local - local_blocks
    lo_t, hi_t = init_blocks + cb, hi_rank + cb
    local_ok = (vhi >= vlo) & (jnp.maximum(vlo, base + local * blk) <= vhi)
    # keys a row walks: its visible interval cut to its rankable blocks
    first = jnp.maximum(vlo, base + init_blocks * blk)
    last = jnp.minimum(vhi, base + (hi_rank + 1) * blk - 1)
    live = last >= first
    bsz = qpos.shape[0]
    per_tile = lambda x: x.reshape(bsz, -1, tq)
    big = jnp.iinfo(jnp.int32).max
    t_lo = per_tile(jnp.where(live, first, big)).min(-1) // blk
    t_hi = per_tile(jnp.where(live, last, -1)).max(-1) // blk + 1
    any_live = per_tile(live).any(-1)
    t_hi = jnp.where(any_live, jnp.minimum(t_hi, n_tiles), 0)
    t_lo = jnp.where(any_live, jnp.clip(t_lo, 0, t_hi), 0)
    fast_end = jnp.clip(fast_end, t_lo, t_hi)
    tiles = jnp.stack([t_lo, fast_end, t_hi, jnp.zeros_like(t_lo)], axis=-1).astype(jnp.int32)
    zero = jnp.zeros_like(cb)
    tab = jnp.stack([cb, c_split, vlo, vhi, lo_t, hi_t, zero, zero], axis=1).astype(jnp.int32)
    return tab, tiles, local_ok


_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_FP8_MAX = 448.0                # largest finite e4m3 value


def quantize_index_fp8(qi, ki):
    """Index queries and keys as float8_e4m3fn with a scale per vector (``x ~= float(x_q) * scale``,
    ``scale = max|x| / 448``, 1 for an all-zero vector; the decode cache's convention).

    qi [B,T,Hi,Di], ki [B,S,Di] -> (qi_q, qi_scale f32 [B,T,Hi], ki_q, ki_scale f32 [B,S]). A row's scores
    are its qi scale times the ki-scaled products: the qi scale does not change its ranking."""
    def q(x):
        xf = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(xf), axis=-1)
        scale = jnp.where(amax > 0, amax / _FP8_MAX, 1.0)
        return (xf / scale[..., None]).astype(_FP8), scale
    return (*q(qi), *q(ki))


def block_topk_wgmma(qi, ki, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                     block_size, topk, init_blocks=0, local_blocks=1, qi_scale=None, ki_scale=None,
                     interpret=False):
    """Fused index scores + block max-pool + top list on Hopper; outputs as ``gpu_indexer.block_topk_gpu``.

    Args: qi [B,T,Hi,Di], ki [B,S,Di] (one dtype of ``wgmma_indexer_supported``), positions / segment ids
      as ``msa_select_blocks_gpu``. float8_e4m3fn inputs need ``qi_scale`` f32 [B,T,Hi] and ``ki_scale`` f32
      [B,S] (``quantize_index_fp8``): the kernel scales each key's column, XLA each row's kept scores.
      ``interpret``: the Mosaic GPU interpreter (jax >= 0.11).
    Returns: (top_v f32 [B,T,Hi,W] scores s = <qi, ki> / sqrt(Di) (-inf: empty slot), top_i int32
      [B,T,Hi,W] (negative: empty), local_ok bool [B,T,Hi]) with W = K - init - L, unordered sets.
    Raises: AssertionError for unsupported shapes (``wgmma_indexer_supported``) or missing fp8 scales;
      NotImplementedError for ``interpret=True`` on a jax without the Mosaic GPU interpreter.
    """
    bsz, t, hi, di = qi.shape
    assert ki.dtype == qi.dtype, (qi.dtype, ki.dtype)
    why = wgmma_indexer_supported(qi.shape, ki.shape, qi.dtype, block_size)
    assert why is None, why
    fp8 = jnp.dtype(qi.dtype) == _FP8
    assert not fp8 or (qi_scale is not None and ki_scale is not None), "float8 index inputs need qi_scale, ki_scale"
    width = select.rank_width(topk, init_blocks, local_blocks)
    tq = CTA_ROWS // hi
    prep = layout.prepare(ki[:, :, None, :], None, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                          block_size)
    kip = prep.k[:, :, 0, :]
    ks = None
    if fp8:
        ks = jnp.pad(ki_scale.astype(jnp.float32), ((0, 0), (0, prep.s_pad - ki.shape[1])), constant_values=1.0)
    qi, qpos, qseg, base, tp = layout.pad_query_rows(qi, q_positions, prep, tq)
    j0, j1 = jax.vmap(layout.segment_runs)(prep.kv_seg, qseg)
    n_tiles = prep.s_pad // block_size
    n_rt = tp // tq
    fe = fast_tile_ends(qpos, qseg, base, prep.kv_pos, prep.kv_seg, blk=block_size, rows_per_tile=tq)
    tab, tiles, lok = _row_tables(qpos, qseg, base, j0, j1, blk=block_size, init_blocks=init_blocks,
                                  local_blocks=local_blocks, n_tiles=n_tiles, tq=tq, fast_end=fe)
    tv = jnp.full((bsz, tp, hi, width), -jnp.inf, jnp.float32)
    ti = jnp.full((bsz, tp, hi, width), -1, jnp.int32)
    if width:
        kernel = plgpu.kernel(
            functools.partial(_body, blk=block_size, width=width, n_rt=n_rt, scale=1.0 / math.sqrt(di), fp8=fp8,
                              stages=_stages(block_size, di, jnp.dtype(qi.dtype).itemsize)),
            out_type=[typed_out_struct((bsz, width, tp * hi), jnp.float32, qi),
                      typed_out_struct((bsz, width, tp * hi), jnp.int32, qi)],
            grid=(n_rt, bsz), grid_names=("r", "b"),
            num_threads=3, thread_name="wg", kernel_name="msa_indexer_wgmma",
            interpret=mosaic_interpret_params("block_topk_wgmma") if interpret else None,
        )
        rep = lambda x: jnp.repeat(x, hi, axis=-1)             # per token -> per (token, head) row
        tv, ti = kernel(tiles, rep(tab), qi.reshape(bsz, tp * hi, di), kip,
                        ks if fp8 else jnp.zeros((bsz, 8), jnp.float32))
        tv = jnp.swapaxes(tv, 1, 2).reshape(bsz, tp, hi, width)
        ti = jnp.swapaxes(ti, 1, 2).reshape(bsz, tp, hi, width)
    tv, ti = tv[:, :t], ti[:, :t]
    if fp8:
        tv = tv * qi_scale.astype(jnp.float32)[..., None]
    lok = jnp.broadcast_to(lok[:, :t, None], (bsz, t, hi))
    return tv, ti, lok


def msa_select_blocks_wgmma(qi, ki, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                            block_size, topk, init_blocks=0, local_blocks=1, index_dtype=None, interpret=False):
    """MSA block selection with the Hopper indexer kernel: int32 [B,Hi,T,K] block ids in the order of
    ``gpu_indexer.msa_select_blocks_gpu`` (ranked by score descending, ties lower id, then the forced
    blocks, -1 padded). Arguments as ``block_topk_wgmma``; ``index_dtype="float8_e4m3fn"`` quantises
    bf16 / f16 inputs first (``quantize_index_fp8``: FP8 ``wgmma``, approximate selection)."""
    scales = {}
    if index_dtype is not None and jnp.dtype(index_dtype) == _FP8 and jnp.dtype(qi.dtype) != _FP8:
        qi, qs, ki, ks = quantize_index_fp8(qi, ki)
        scales = dict(qi_scale=qs, ki_scale=ks)
    tv, ti, lok = block_topk_wgmma(qi, ki, q_positions=q_positions, kv_positions=kv_positions,
                                   q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                   block_size=block_size, topk=topk, init_blocks=init_blocks,
                                   local_blocks=local_blocks, interpret=interpret, **scales)
    qpos = jnp.broadcast_to(q_positions.astype(jnp.int32)[:, :, None], tv.shape[:3])
    ids = select.assemble_ids(tv, ti, qpos, lok, block_size=block_size, topk=topk,
                              init_blocks=init_blocks, local_blocks=local_blocks)
    return jnp.transpose(ids, (0, 2, 1, 3))
