"""MSA indexer on GPU (Pallas, Triton lowering): token scores, causal block max-pool and a running
top-k, fused, so neither [T,S] scores nor [T,NB] block scores ever reach memory.

Math (MSA_SPEC.md sections 1-2): s[r,i,j] = <qi[i,r], ki[j]> / sqrt(Di) for visible keys j;
block score M[r,i,n] = max of s over the visible keys of block n; rows rank the blocks
init <= n <= local - L (local = q_pos // B) and keep the best K - init - L (ties: lower id), then the
forced blocks are appended (select.py).

Kernel layout: the Hi index heads share the single index key, so rows = (token, head) pairs of a
query tile are stacked as the M dimension ([TQ*Hi, Di] @ [Di, B] per key tile). One program per
(query-row tile, batch row) walks the storage key tiles in increasing order. Inside a tile the keys
of a row's segment may belong to two blocks (packed segments need not start on a tile boundary):
the kernel keeps both partial maxima and completes block n0 = floor((tile*B - base)/B) from the
previous tile's second part and this tile's first part, then offers it to the row's running top
list (replace the worst entry - lowest score, ties highest id - if strictly better). The walk is two
loops: the leading key tiles that every row of the tile sees whole, one block each (computed in XLA
by ``fast_tile_ends``; all tiles below the diagonal of an unpacked prefill), take a mask-free body
with no per-tile reductions over keys or branches; the rest take the masked body.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.msa import layout, select

__all__ = ["msa_select_blocks_gpu", "block_topk_gpu"]


def _dot(a, b, trans_a=False, trans_b=False):
    """2-D matmul with fp32 accumulation; lowers to a Triton tensor-core dot (tl.dot)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

_BIG = 1 << 30


def _insert(top_v, top_i, x, n):
    """Offer (x [R], id n [R]) to the running lists [R, W]; keeps the best W (ties: lower id)."""
    mn = jnp.min(top_v, axis=1)
    is_min = top_v == mn[:, None]
    worst_id = jnp.max(jnp.where(is_min, top_i, -_BIG), axis=1)
    repl = (x > mn)[:, None] & is_min & (top_i == worst_id[:, None])
    return jnp.where(repl, x[:, None], top_v), jnp.where(repl, n[:, None], top_i)


def _kernel(qi_ref, ki_ref, qpos_ref, qseg_ref, base_ref, kvpos_ref, kvseg_ref, fast_end_ref,
            tv_ref, ti_ref, lok_ref, *, blk, rows, n_rank, width, init, local_blocks, scale,
            n_tiles):
    rt = pl.program_id(0)
    b = pl.program_id(1)
    rs = pl.ds(rt * rows, rows)
    qi = qi_ref[b, rs, :]                              # [R, Di]
    qpos = qpos_ref[b, rs]
    qseg = qseg_ref[b, rs]
    base = base_ref[b, rs]
    qidx = base + qpos                                 # storage index of each row's query
    local = jax.lax.div(qpos, blk)
    hi_rank = local - local_blocks                     # last rankable block id
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
    top_v = jnp.where(col < n_rank, -jnp.inf, jnp.inf).astype(jnp.float32)
    top_i = -1 - col
    t_lo = jax.lax.div(jnp.maximum(jnp.min(base), 0), blk)
    t_hi = jnp.minimum(jax.lax.div(jnp.maximum(jnp.max(qidx), 0), blk) + 1, n_tiles)
    fast_end = jnp.clip(fast_end_ref[b, rt], t_lo, t_hi)

    def offer(tile, top_v, top_i, prev1, p0):
        n0 = jax.lax.div(tile * blk - base + n_tiles * blk, blk) - n_tiles
        val = jnp.maximum(prev1, p0)
        ok = (n0 >= init) & (n0 <= hi_rank)
        return _insert(top_v, top_i, jnp.where(ok, val, -jnp.inf), n0), n0

    def fast_body(tile, carry):
        # Tiles in [t_lo, fast_end) are wholly visible to every row and are exactly one block
        # (fast_tile_ends): no per-element masks, no split maxima.
        top_v, top_i, lok = carry
        s = _dot(qi, ki_ref[b, pl.ds(tile * blk, blk), :], trans_b=True)   # [R, B] unscaled
        (top_v, top_i), n0 = offer(tile, top_v, top_i, jnp.full((rows,), -jnp.inf, jnp.float32),
                                   jnp.max(s, axis=1))
        return top_v, top_i, jnp.maximum(lok, (n0 == local).astype(jnp.int32))

    def slow_body(tile, carry):
        top_v, top_i, prev1, lok = carry
        sl = pl.ds(tile * blk, blk)
        kvp = kvpos_ref[b, sl]
        kvs = kvseg_ref[b, sl]
        s = _dot(qi, ki_ref[b, sl, :], trans_b=True)
        n0 = jax.lax.div(tile * blk - base + n_tiles * blk, blk) - n_tiles
        kblk = jax.lax.div(kvp, blk)
        vis = ((kvs[None, :] == qseg[:, None]) & (kvs[None, :] >= 0)
               & (kvp[None, :] <= qpos[:, None]))
        in0 = kblk[None, :] == n0[:, None]
        p0 = jnp.max(jnp.where(vis & in0, s, -jnp.inf), axis=1)
        p1 = jnp.max(jnp.where(vis & jnp.logical_not(in0), s, -jnp.inf), axis=1)
        in_local = vis & (kblk[None, :] == local[:, None])
        (top_v, top_i), _ = offer(tile, top_v, top_i, prev1, p0)
        return top_v, top_i, p1, jnp.maximum(lok, jnp.max(in_local.astype(jnp.int32), axis=1))

    lok = jnp.zeros((rows,), jnp.int32)
    top_v, top_i, lok = jax.lax.fori_loop(t_lo, fast_end, fast_body, (top_v, top_i, lok))
    prev1 = jnp.full((rows,), -jnp.inf, jnp.float32)
    top_v, top_i, _, lok = jax.lax.fori_loop(fast_end, t_hi, slow_body, (top_v, top_i, prev1, lok))
    tv_ref[b, rs, :] = top_v * scale
    ti_ref[b, rs, :] = top_i
    lok_ref[b, rs] = lok


def fast_tile_ends(qpos, qseg, base, kv_pos, kv_seg, *, blk, rows_per_tile):
    """Per (batch row, row tile): end of the run of key tiles, from the tile's first, that every
    query of the row tile sees whole and that hold exactly one of its blocks. int32 [B, n_rt].

    Such a tile needs no masks in the kernel. Exact: a tile qualifies iff the row tile is one
    segment (>= 0) with one block-aligned base, every key of the key tile is in that segment with
    block ``tile - base / B`` and position <= the row tile's smallest query position. O(n_rt * n_tiles)
    int ops in one XLA reduction (no [T, S] array). Inputs: the padded per-token arrays of the
    kernel ([B, Tp] with Tp a multiple of rows_per_tile tokens) and the padded keys [B, Sp].
    """
    bsz, sp = kv_pos.shape
    n_tiles = sp // blk
    tile_r = lambda x: x.reshape(bsz, -1, rows_per_tile)
    seg_lo, seg_hi = tile_r(qseg).min(-1), tile_r(qseg).max(-1)
    base_lo, base_hi = tile_r(base).min(-1), tile_r(base).max(-1)
    qpos_lo = tile_r(qpos).min(-1)
    t_lo = jnp.maximum(base_lo, 0) // blk
    uniform = (seg_lo == seg_hi) & (seg_lo >= 0) & (base_lo == base_hi) & (base_lo % blk == 0)
    ks, kp = kv_seg.reshape(bsz, n_tiles, blk), kv_pos.reshape(bsz, n_tiles, blk)
    kb = jax.lax.div(kp, blk)
    one_seg = (ks.min(-1) == ks.max(-1)) & (kb.min(-1) == kb.max(-1))
    tseg = jnp.where(one_seg, ks[..., 0], -3)          # -3: never a query segment
    tblk, tmax = kb[..., 0], kp.max(-1)
    tile = jnp.arange(n_tiles, dtype=jnp.int32)
    exp_blk = jax.lax.div(tile[None, None, :] * blk - base_lo[:, :, None], blk)
    fast = (uniform[:, :, None] & (tseg[:, None, :] == seg_lo[:, :, None])
            & (tmax[:, None, :] <= qpos_lo[:, :, None]) & (tblk[:, None, :] == exp_blk))
    fail = (tile[None, None, :] >= t_lo[:, :, None]) & ~fast
    return jnp.min(jnp.where(fail, tile[None, None, :], n_tiles), axis=-1).astype(jnp.int32)


def block_topk_gpu(qi, ki, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                   block_size, topk, init_blocks=0, local_blocks=1, rows=128, interpret=False,
                   num_warps=8, num_stages=3):
    """Fused index scores + block max-pool + running top list (unordered), Pallas/Triton GPU.

    Args: as msa_select_blocks_gpu; rows = query rows (token x index head) per program.
    Returns: (top_v f32 [B,T,Hi,W], top_i int32 [B,T,Hi,W], local_ok bool [B,T,Hi]) with
      W = K - init - L ranked slots (-inf / negative ids mark empty slots; scores are
      s = <qi, ki> / sqrt(Di) in fp32); local_ok: the row sees a key of its local block.
    """
    bsz, t, hi, di = qi.shape
    n_rank = select.rank_width(topk, init_blocks, local_blocks)
    width = max(1, layout.next_pow2(max(n_rank, 1)))
    assert rows % hi == 0, f"rows={rows} must be a multiple of the index heads {hi}"
    tq = rows // hi
    prep = layout.prepare(ki[:, :, None, :], None, q_positions, kv_positions, q_segment_ids,
                          kv_segment_ids, block_size)
    kip = prep.k[:, :, 0, :]
    qi, qpos, qseg, base, tp = layout.pad_query_rows(qi, q_positions, prep, tq)
    rep = lambda x: jnp.repeat(x, hi, axis=1)          # [B, Tp] -> [B, Tp*Hi] (token-major rows)
    n_tiles = prep.s_pad // block_size
    kernel = functools.partial(_kernel, blk=block_size, rows=rows, n_rank=n_rank, width=width,
                               init=init_blocks, local_blocks=local_blocks,
                               scale=1.0 / math.sqrt(di), n_tiles=n_tiles)
    fast_end = fast_tile_ends(qpos, qseg, base, prep.kv_pos, prep.kv_seg, blk=block_size,
                              rows_per_tile=tq)
    tv, ti, lok = pl.pallas_call(
        kernel,
        grid=(tp * hi // rows, bsz),
        out_shape=[jax.ShapeDtypeStruct((bsz, tp * hi, width), jnp.float32),
                   jax.ShapeDtypeStruct((bsz, tp * hi, width), jnp.int32),
                   jax.ShapeDtypeStruct((bsz, tp * hi), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="msa_indexer_gpu",
    )(qi.reshape(bsz, tp * hi, di), kip, rep(qpos), rep(qseg), rep(base), prep.kv_pos,
      prep.kv_seg, fast_end)
    tv = tv.reshape(bsz, tp, hi, width)[:, :t, :, :n_rank]
    ti = ti.reshape(bsz, tp, hi, width)[:, :t, :, :n_rank]
    lok = lok.reshape(bsz, tp, hi)[:, :t] > 0
    return tv, ti, lok


def msa_select_blocks_gpu(qi, ki, *, q_positions, kv_positions, q_segment_ids=None,
                          kv_segment_ids=None, block_size, topk, init_blocks=0, local_blocks=1,
                          rows=128, interpret=False, num_warps=8, num_stages=3):
    """MSA block selection with the fused Pallas/Triton GPU indexer kernel.

    Args:
      qi: [B,T,Hi,Di] index queries (bf16/f32); ki: [B,S,Di] the single index key head.
      q_positions [B,T], kv_positions [B,S] int; segment ids or None (layout.py conventions).
      block_size B (power of two >= 16), topk K, init_blocks (sink blocks kept), local_blocks L.
      rows: query rows (token x head) per program (power of two, multiple of Hi, >= 16).
      interpret: run the kernel in Pallas interpret mode (CPU tests).
    Returns:
      block_ids int32 [B,Hi,T,K]: ranked blocks (score desc, ties lower id), then forced blocks,
      -1 padded (the reference order of MSA_SPEC section 2 for init=0, L=1).
    Preconditions (shapes, block size, knobs) are asserted; the ops layer checks them for its callers.
    """
    assert qi.ndim == 4 and ki.ndim == 3 and ki.shape[0] == qi.shape[0] and ki.shape[2] == qi.shape[3], \
        f"qi must be [B,T,Hi,Di] and ki [B,S,Di], got {qi.shape}, {ki.shape}"
    assert block_size >= 16 and not block_size & (block_size - 1), \
        f"block_size must be a power of two >= 16, got {block_size}"
    tv, ti, lok = block_topk_gpu(qi, ki, q_positions=q_positions, kv_positions=kv_positions,
                            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                            block_size=block_size, topk=topk, init_blocks=init_blocks,
                            local_blocks=local_blocks, rows=rows, interpret=interpret,
                            num_warps=num_warps, num_stages=num_stages)
    qpos = jnp.broadcast_to(q_positions.astype(jnp.int32)[:, :, None], tv.shape[:3])
    ids = select.assemble_ids(tv, ti, qpos, lok, block_size=block_size, topk=topk,
                              init_blocks=init_blocks, local_blocks=local_blocks)
    return jnp.transpose(ids, (0, 2, 1, 3))
