"""MSA indexer on TPU (Pallas Mosaic): fused token scores, causal block max-pool and running top-k.

Math: MSA_SPEC.md sections 1-2 (same algorithm as gpu_indexer.py: rows = (token, index head)
pairs share the single index key; storage key tiles are walked in increasing order; a block split
over two tiles by an unaligned packed segment is completed from both; each completed block is
offered to the row's running top list, which keeps the best K - init - L, ties to the lower id).

TPU layout: grid (row tile, key tile) over a chunk of row tiles of one batch row; the last axis is
sequential ("arbitrary"). A scalar-prefetched table gives each row tile its causal range of key
tiles [lo, hi); the key BlockSpec index map clamps into that range (so skipped steps re-use the
resident block and copy nothing) and ``pl.when`` skips their compute. One pallas_call inside one
``lax.fori_loop`` at any T: each call takes tpu_common.TABLE_WORDS // 2 row tiles (SMEM tables
<= 240 KiB of int32 per call) and writes its rows of the full-size outputs in place (aliased).
The running lists live in VMEM scratch, 128 lanes wide (unused lanes hold +inf so they are never
evicted). Blocks keep their last two dims full or (8, 128) multiples
(tests/kernels/msa/test_msa_tpu_lowering.py checks the Mosaic lowering on CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.msa import layout, select, tpu_common

__all__ = ["msa_select_blocks_tpu", "block_topk_tpu"]

_BIG = 1 << 30
_LANES = 128


def _kernel(scal_ref, lo_ref, hi_ref, qi_ref, ki_ref, kvp_ref, kvs_ref, qpos_ref, qseg_ref,
            base_ref, tv_alias, ti_alias, lok_alias, tv_ref, ti_ref, lok_ref,
            tv_sc, ti_sc, prev_sc, lok_sc, *, blk, n_rank, init, local_blocks, scale, n_tiles):
    del scal_ref, tv_alias, ti_alias, lok_alias
    r, j = pl.program_id(0), pl.program_id(1)
    rows, width = tv_sc.shape

    @pl.when(j == 0)
    def _init():
        col = jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
        tv_sc[...] = jnp.where(col < n_rank, -jnp.inf, jnp.inf).astype(jnp.float32)
        ti_sc[...] = -1 - col
        prev_sc[...] = jnp.full(prev_sc.shape, -jnp.inf, jnp.float32)
        lok_sc[...] = jnp.zeros(lok_sc.shape, jnp.int32)

    @pl.when((j >= lo_ref[r]) & (j < hi_ref[r]))
    def _step():
        s = jax.lax.dot_general(qi_ref[...], ki_ref[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)       # [R, B]
        kvp = kvp_ref[...]                                                # [1, B]
        kvs = kvs_ref[...]
        qpos = qpos_ref[...]                                              # [R, 1]
        qseg = qseg_ref[...]
        vis = (kvs == qseg) & (kvs >= 0) & (kvp <= qpos)
        n0 = jax.lax.div(j * blk - base_ref[...] + n_tiles * blk, blk) - n_tiles   # [R, 1]
        kblk = jax.lax.div(kvp, blk)
        in0 = kblk == n0
        p0 = jnp.max(jnp.where(vis & in0, s, -jnp.inf), axis=1, keepdims=True)
        p1 = jnp.max(jnp.where(vis & jnp.logical_not(in0), s, -jnp.inf), axis=1, keepdims=True)
        local = jax.lax.div(qpos, blk)
        in_local = (vis & (kblk == local)).astype(jnp.int32)
        lok_sc[...] = jnp.maximum(lok_sc[...], jnp.max(in_local, axis=1, keepdims=True))
        val = jnp.maximum(prev_sc[...], p0)
        ok = (n0 >= init) & (n0 <= local - local_blocks)
        x = jnp.where(ok, val, -jnp.inf)
        tv = tv_sc[...]
        ti = ti_sc[...]
        mn = jnp.min(tv, axis=1, keepdims=True)
        is_min = tv == mn
        worst = jnp.max(jnp.where(is_min, ti, -_BIG), axis=1, keepdims=True)
        repl = (x > mn) & is_min & (ti == worst)
        tv_sc[...] = jnp.where(repl, x, tv)
        ti_sc[...] = jnp.where(repl, n0, ti)
        prev_sc[...] = p1

    @pl.when(j == pl.num_programs(1) - 1)
    def _fin():
        tv_ref[...] = tv_sc[...] * scale
        ti_ref[...] = ti_sc[...]
        lok_ref[...] = lok_sc[...]


def block_topk_tpu(qi, ki, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                   block_size, topk, init_blocks=0, local_blocks=1, rows=128, interpret=False):
    """Fused indexer on TPU. Args as msa_select_blocks_tpu.

    Returns: (top_v f32 [B,T,Hi,W], top_i int32 [B,T,Hi,W], local_ok bool [B,T,Hi]),
      W = K - init - L ranked slots, unordered; -inf / negative ids mark empty slots.
    """
    bsz, t, hi, di = qi.shape
    n_rank = select.rank_width(topk, init_blocks, local_blocks)
    if n_rank > _LANES:
        raise ValueError(f"at most {_LANES} ranked slots supported, got {n_rank}")
    assert rows % hi == 0 and rows % 8 == 0, f"rows={rows} must be a multiple of 8 and of the index heads {hi}"
    tq = rows // hi
    prep = layout.prepare(ki[:, :, None, :], None, q_positions, kv_positions, q_segment_ids,
                          kv_segment_ids, block_size)
    kip = prep.k[:, :, 0, :]
    nt = prep.s_pad // block_size
    qi, qpos, qseg, base, tp = layout.pad_query_rows(qi, q_positions, prep, tq)
    nr = tp // tq
    # causal key-tile range of each row tile (storage index of a row's query = base + q_pos)
    qidx = (base + qpos).reshape(bsz, nr, tq)
    lo = (jnp.maximum(jnp.min(base.reshape(bsz, nr, tq), axis=-1), 0) // block_size)
    lo = jnp.minimum(lo, nt - 1).astype(jnp.int32)
    hi_t = jnp.clip(jnp.max(qidx, axis=-1) // block_size + 1, 0, nt).astype(jnp.int32)
    rep = lambda x: jnp.repeat(x, hi, axis=1)[..., None]           # [B,Tp] -> [B,Tp*Hi,1]
    kernel = functools.partial(_kernel, blk=block_size, n_rank=n_rank, init=init_blocks,
                               local_blocks=local_blocks, scale=1.0 / math.sqrt(di), n_tiles=nt)
    rc = min(nr, (tpu_common.TABLE_WORDS - 2) // 2)                # row tiles per call
    n_chunks = -(-nr // rc)
    row_map = lambda r, j, sc, *_: (sc[0], sc[1] + r, 0)  # noqa: E731
    clamp = lambda r, j, lo_, hi_: jnp.minimum(jnp.maximum(j, lo_[r]),  # noqa: E731
                                               jnp.maximum(hi_[r] - 1, lo_[r]))
    key_map = lambda r, j, sc, lo_, hi_: (sc[0], clamp(r, j, lo_, hi_), 0)  # noqa: E731
    pos_map = lambda r, j, sc, lo_, hi_: (sc[0], clamp(r, j, lo_, hi_), 0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(rc, nt),
        in_specs=[pl.BlockSpec((None, rows, di), row_map),
                  pl.BlockSpec((None, block_size, di), key_map),
                  pl.BlockSpec((None, None, 1, block_size), pos_map),
                  pl.BlockSpec((None, None, 1, block_size), pos_map),
                  pl.BlockSpec((None, rows, 1), row_map),
                  pl.BlockSpec((None, rows, 1), row_map),
                  pl.BlockSpec((None, rows, 1), row_map)] + [tpu_common.aliased()] * 3,
        out_specs=[pl.BlockSpec((None, rows, _LANES), row_map),
                   pl.BlockSpec((None, rows, _LANES), row_map),
                   pl.BlockSpec((None, rows, 1), row_map)],
        scratch_shapes=[pltpu.VMEM((rows, _LANES), jnp.float32),
                        pltpu.VMEM((rows, _LANES), jnp.int32),
                        pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, 1), jnp.int32)],
    )
    call = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((bsz, tp * hi, _LANES), jnp.float32),
                   jax.ShapeDtypeStruct((bsz, tp * hi, _LANES), jnp.int32),
                   jax.ShapeDtypeStruct((bsz, tp * hi, 1), jnp.int32)],
        input_output_aliases={10: 0, 11: 1, 12: 2},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="msa_indexer_tpu",
    )
    ins = (qi.reshape(bsz, tp * hi, di), kip, prep.kv_pos.reshape(bsz, nt, 1, block_size),
           prep.kv_seg.reshape(bsz, nt, 1, block_size), rep(qpos), rep(qseg), rep(base))

    def body(i, outs):
        b, r0 = tpu_common.chunk_origin(i, n_chunks, rc, nr)
        part = lambda x: jax.lax.dynamic_slice(x, (b, r0), (1, rc)).reshape(rc)  # noqa: E731
        return tuple(call(jnp.stack([b, r0]), part(lo), part(hi_t), *ins, *outs))
    outs = (jnp.zeros((bsz, tp * hi, _LANES), jnp.float32),
            jnp.zeros((bsz, tp * hi, _LANES), jnp.int32), jnp.zeros((bsz, tp * hi, 1), jnp.int32))
    tv, ti, lok = jax.lax.fori_loop(0, bsz * n_chunks, body, outs)
    tv = tv.reshape(bsz, tp, hi, _LANES)[:, :t, :, :n_rank]
    ti = ti.reshape(bsz, tp, hi, _LANES)[:, :t, :, :n_rank]
    lok = lok.reshape(bsz, tp, hi)[:, :t] > 0
    return tv, ti, lok


def msa_select_blocks_tpu(qi, ki, *, q_positions, kv_positions, q_segment_ids=None,
                          kv_segment_ids=None, block_size, topk, init_blocks=0, local_blocks=1,
                          rows=128, interpret=False):
    """MSA block selection with the fused Pallas Mosaic TPU indexer kernel.

    Args:
      qi [B,T,Hi,Di] index queries, ki [B,S,Di] the single index key head (bf16/f32);
      positions / segment ids (layout.py conventions); block_size B (multiple of 128 on TPU);
      topk K; init_blocks; local_blocks L; rows: (token x head) rows per tile (multiple of 8 and
      of Hi); interpret: False (Mosaic), True (plain interpreter) or ``pltpu.InterpretParams``.
    Returns: int32 [B,Hi,T,K] in the reference order (select.assemble_ids), -1 padded.
    Raises: ValueError when K - init - L exceeds 128 ranked slots; other preconditions (shapes,
      knobs) are asserted. Math: MSA_SPEC.md sections 1-2.
    """
    assert qi.ndim == 4 and ki.ndim == 3 and ki.shape[0] == qi.shape[0] and ki.shape[2] == qi.shape[3], \
        f"qi must be [B,T,Hi,Di] and ki [B,S,Di], got {qi.shape}, {ki.shape}"
    tv, ti, lok = block_topk_tpu(qi, ki, q_positions=q_positions, kv_positions=kv_positions,
                                 q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                 block_size=block_size, topk=topk, init_blocks=init_blocks,
                                 local_blocks=local_blocks, rows=rows, interpret=interpret)
    qpos = jnp.broadcast_to(q_positions.astype(jnp.int32)[:, :, None], tv.shape[:3])
    ids = select.assemble_ids(tv, ti, qpos, lok, block_size=block_size, topk=topk,
                              init_blocks=init_blocks, local_blocks=local_blocks)
    return jnp.transpose(ids, (0, 2, 1, 3))
