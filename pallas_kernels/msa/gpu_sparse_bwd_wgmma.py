"""MSA sparse attention backward on Hopper, KV-outer: the work list, slices, run pieces and merge of
``gpu_sparse_bwd`` with a warp-specialised Pallas Mosaic GPU kernel (TMA + ``wgmma``) per program.

Math (MSA_SPEC.md section 3; FlashAttention-2 backward on the selected blocks, as gpu_sparse_bwd.py): with
p = exp(scale q.k - lse) over a row's visible keys and delta = rowsum(o * do): dv = sum p^T do,
ds = p (do.v - delta), dk = scale sum ds^T q, dq = scale sum_slots ds k.

Schedule: ``gpu_sparse_fwd.worklist`` (program i takes the fixed slice [i*C, (i+1)*C) of its group's
sorted selections; a run = one K/V window), per CTA (slice i, group g, batch row b) three warpgroups:
- memory warpgroup: the slice's work-list entries into SMEM once; per run, TMA of the K / V window
  [B, D] and of its keys' owning-window starts (``owner_starts``); per 64-row tile (64 / sr selections x
  sr head rows, sr = ``head_slot(H/G)``) one TMA per selection of its q and dO rows into a 2-stage ring,
  plus the tile's per-row visible column intervals and (lse log2, delta) from XLA tables;
- two compute warpgroups split the window's 128 keys (64 each) and both take every tile, in keys-major
  orientation: S^T = K_half Q^T, P^T = exp2(S^T - lse) on the visible columns (the LSE is known: no
  row max), dV += P^T dO, dP^T = V_half dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q (dK / dV: four
  [64, 64] f32 accumulators per warpgroup across the run); dS^T goes to SMEM, and after a barrier
  between the two warpgroups each computes dQ[:, its 64 columns] = dS K[:, its columns] (dS^T from SMEM as
  a transposed ``wgmma`` operand) and TMA-stores its rows as per-(token, slot) partials (f32 or q.dtype)
  that XLA sums over the slots (``gpu_sparse_bwd.sum_dq_partials``);
- end of a run: a run continued from / into a neighbouring program leaves its piece in the buffers of
  ``gpu_sparse_bwd.merge_pieces``; a whole run stores the rows its window owns (gpu_sparse_bwd.py: key x
  belongs to the window at clamp(x - kv_pos mod B)) into a per-pass buffer, which XLA adds to the totals
  on the keys whose owning window had a whole run in the pass (``_whole_keys``).

Restrictions (``wgmma_bwd_supported``): bf16 / f16, H/G <= 64 (head slots as the forward), D = Dv = 128,
B = 128, and every window 8-row aligned (TMA row offsets into tiled SMEM): a pass with an unaligned window
(packed documents whose starts are not multiples of 8) runs ``gpu_sparse_bwd``'s Triton kernel instead
(``lax.cond`` on the data; ``sparse_bwd_wgmma`` documents it, the ops layer records it).
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
from pallas_kernels.msa.gpu_sparse_bwd import (_chunk_bwd, bwd_inputs, default_bwd_chunk, default_bwd_query_chunk,
                                               merge_pieces, over_query_chunks, owner_start, slice_bounds,
                                               sum_dq_partials)
from pallas_kernels.msa.gpu_sparse_fwd import check_launch, worklist
from pallas_kernels.msa.gpu_sparse_fwd_wgmma import (DTYPES, ROWS, WorkTables, _intervals, from_head_slots, head_slot,
                                                     to_head_slots)

__all__ = ["sparse_bwd_wgmma", "wgmma_bwd_supported"]

_HALF = 64                     # keys per compute warpgroup; dK / dV / dQ column blocks
_LOG2E = math.log2(math.e)


def wgmma_bwd_supported(q_shape, kv_shape, v_dim, dtype, block_size) -> str | None:
    """None when ``sparse_bwd_wgmma`` serves these shapes, else the reason (a short sentence).
    q_shape [B,T,H,D], kv_shape [B,S,G,D]: bf16 / f16, H/G <= 64, D = Dv = 128, block 128."""
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not bf16 / f16"
    h, d, g = q_shape[2], q_shape[3], kv_shape[2]
    if g <= 0 or h % g or h // g > 64:
        return f"heads per group {h}/{g}: need an integer <= 64"
    if d != 128 or v_dim != 128:
        return f"head dims D={d}, Dv={v_dim}: the wgmma backward needs D = Dv = 128"
    if block_size != 128:
        return f"block size {block_size}: the wgmma backward needs 128"
    return None


def owner_starts(kvpos, kvseg, blk, s_pad):
    """Per key: the storage start of the window that owns it (``gpu_sparse_bwd.owner_start``), -1 for empty
    slots. kvpos / kvseg [B, Sp] (``layout.prepare``); int32 [B, Sp]."""
    x = jnp.broadcast_to(jnp.arange(kvpos.shape[1], dtype=jnp.int32), kvpos.shape)
    return jnp.where(kvseg >= 0, owner_start(x, kvpos.astype(jnp.int32), blk, s_pad), -1).astype(jnp.int32)


def _whole_keys(key, run_end, n_valid, own, chunk):
    """Keys written by whole runs (a run inside one program's slice) in this pass: bool [B, Sp, G, 1].
    key / run_end [B,G,N] (``worklist``), own [B,Sp] (``owner_starts``)."""
    bsz, g, n = key.shape
    e = jnp.arange(n, dtype=jnp.int32)
    first = jnp.concatenate([jnp.ones((bsz, g, 1), bool), key[..., 1:] != key[..., :-1]], axis=-1)
    whole = first & (e < n_valid[..., None]) & (e // chunk == (run_end - 1) // chunk)
    sp = own.shape[1]
    tgt = jnp.where(whole, key, sp)                                         # sp: dropped
    mark = jnp.zeros((bsz, g, sp), bool).at[jnp.arange(bsz)[:, None, None], jnp.arange(g)[None, :, None],
                                            tgt].set(True, mode="drop")
    hit = jnp.take_along_axis(mark, jnp.broadcast_to(jnp.maximum(own, 0)[:, None], mark.shape), axis=2)
    return jnp.transpose(hit & (own >= 0)[:, None], (0, 2, 1))[..., None]


def _row_stats(lse, delta, flat, topk, g, hg, sr, pad):
    """(lse * log2 e, delta) of every sorted entry's sr head rows: f32 [B,G,2,(N+pad)*sr]. Spare head
    slots and rows that see no key get lse = +inf (p = 0) and delta 0."""
    bsz, t, _ = lse.shape
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * _LOG2E).reshape(bsz, t, g, hg)
    dl = delta.reshape(bsz, t, g, hg)
    if sr != hg:
        lse2 = jnp.pad(lse2, ((0, 0),) * 3 + ((0, sr - hg),), constant_values=jnp.inf)
        dl = jnp.pad(dl, ((0, 0),) * 3 + ((0, sr - hg),))
    st = jnp.stack([lse2, dl], axis=3)                                      # [B,T,G,2,sr]
    tk = flat // topk                                                        # [B,G,N]
    gat = jax.vmap(jax.vmap(lambda x, idx: x[idx], in_axes=(1, 0)))         # over b, then g
    rows = gat(st, tk)                                                       # [B,G,N,2,sr]
    rows = jnp.transpose(rows, (0, 1, 3, 2, 4)).reshape(bsz, g, 2, -1)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, 0), (0, pad * sr))).astype(jnp.float32)   # pad rows: never visible


def _body(flat_ref, key_ref, rend_ref, nval_ref, lims_ref, stats_ref, own_ref, q_ref, do_ref, k_ref, v_ref,
          dqp_ref, wdk_ref, wdv_ref, bdk_ref, bdv_ref, *, blk, topk, sr, per, chunk, scale, p_in_smem):
    """One CTA. q / do / dqp carry G * sr head rows (head slots); wdk / wdv [B,Sp,G,D] f32 whole runs' rows;
    bdk / bdv [B,G,n_items,2,B,D] f32 run pieces (slot 0: continued from the previous program, 1: into the
    next)."""
    i, g, b = lax.axis_index("i"), lax.axis_index("g"), lax.axis_index("b")
    lo, hi, cont_in, cont_out = slice_bounds(key_ref, nval_ref, b, g, i, chunk)
    dtype = q_ref.dtype
    heads = pl.ds(g * sr, sr)
    tables = WorkTables(lo, hi, chunk, per)
    entry, walk = tables.entry, tables.walk

    def scope(k_smem, v_smem, own_smem, q_smem, do_smem, lim_smem, st_smem, ds_smem, stg_smem, tab_smem,
              kv_ready, kv_free, q_ready, q_free, ds_ready, tab_ready, p_smem=None, dq_smem=None):
        wg = lax.axis_index("wg")
        tables.load(tab_smem, (flat_ref, key_ref, rend_ref), b, g, tab_ready, wg == 2)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def per_run(a, end, ri, ct, nt, w0):
                @pl.when(ri >= 1)
                def _():
                    plgpu.barrier_wait(kv_free.at[0])
                rows = pl.ds(pl.multiple_of(w0, 8), blk)        # aligned windows only (the caller's lax.cond)
                plgpu.copy_gmem_to_smem(k_ref.at[b, rows, g], k_smem, kv_ready.at[0])
                plgpu.copy_gmem_to_smem(v_ref.at[b, rows, g], v_smem, kv_ready.at[0])
                plgpu.copy_gmem_to_smem(own_ref.at[b, rows], own_smem.at[lax.rem(ri, 2)], kv_ready.at[0])

                def tile(si, carry):
                    cc = ct + si
                    st = lax.rem(cc, 2)

                    @pl.when(cc >= 2)
                    def _():
                        plgpu.barrier_wait(q_free.at[st])
                    e0 = a + si * per
                    for j in range(per):
                        t = lax.div(entry("flat", jnp.minimum(e0 + j, end - 1)), topk)
                        plgpu.copy_gmem_to_smem(q_ref.at[b, t, heads], q_smem.at[st, pl.ds(j * sr, sr)],
                                                q_ready.at[st])
                        plgpu.copy_gmem_to_smem(do_ref.at[b, t, heads], do_smem.at[st, pl.ds(j * sr, sr)],
                                                q_ready.at[st])
                    tab_rows = pl.ds(pl.multiple_of(e0 * sr, 8), ROWS)
                    plgpu.copy_gmem_to_smem(lims_ref.at[b, g, :, tab_rows], lim_smem.at[st], q_ready.at[st])
                    plgpu.copy_gmem_to_smem(stats_ref.at[b, g, :, tab_rows], st_smem.at[st], q_ready.at[st])
                    return carry
                lax.fori_loop(0, nt, tile, None)

            _, nr, ntiles = walk(per_run)

            @pl.when(nr > 0)            # observe the last releases before the barriers go away
            def _():
                plgpu.barrier_wait(kv_free.at[0])

            def drain_q(cc, carry):
                plgpu.barrier_wait(q_free.at[lax.rem(cc, 2)])
                return carry
            lax.fori_loop(jnp.maximum(ntiles - 2, 0), ntiles, drain_q, None)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qk_scale = scale * _LOG2E
            half = pl.ds(pl.multiple_of(wg * _HALF, _HALF), _HALF)
            k_half, v_half = k_smem.at[half], v_smem.at[half]
            cols = (pl.ds(0, _HALF), pl.ds(_HALF, _HALF))
            stg = stg_smem.at[wg]
            dq_stg = stg if dq_smem is None else dq_smem.at[wg]
            shape = (_HALF, ROWS)                               # [keys, rows]
            col_of = lambda ref: lax.broadcast_in_dim(mosaic_load_rows(ref, axis=0), shape, [1])

            def tile(a, end, ct, si, accs):
                dk0, dk1, dv0, dv1 = accs
                cc = ct + si
                st = lax.rem(cc, 2)
                e0 = a + si * per
                # the selections' (token, slot) first: their loads' latency hides behind the wgmmas
                flats = [entry("flat", jnp.minimum(e0 + j, end - 1)) for j in range(per)]
                plgpu.barrier_wait(q_ready.at[st])

                def s_t(acc_ref):
                    plgpu.wgmma(acc_ref, k_half, q_smem.at[st].transpose((1, 0)))
                    return acc_ref[...]
                s = pl.run_scoped(s_t, plgpu.ACC(shape, jnp.float32))
                # 1-D iotas and bounds, broadcast once (fewer live registers than 2-D masks)
                key = wg * _HALF + plgpu.broadcasted_iota(jnp.int32, (_HALF,), 0,
                                                          layout=plgpu.Layout.WGMMA.reduce(1))
                key = lax.broadcast_in_dim(key, shape, [0])
                row = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=plgpu.Layout.WGMMA.reduce(0))
                # rows past the run's end hold the next entries' tables: they see nothing here
                c_hi = jnp.where(row < (end - e0) * sr, mosaic_load_rows(lim_smem.at[st, 1], axis=0), -1)
                vis = (key >= col_of(lim_smem.at[st, 0])) & (key <= lax.broadcast_in_dim(c_hi, shape, [1]))
                # only P^T in q.dtype stays live across the next wgmma (registers: dK / dV hold 128 of them)
                p16 = jnp.where(vis, jnp.exp2(s * qk_scale - col_of(st_smem.at[st, 0])), 0.0).astype(dtype)
                if p_smem is not None:          # P^T through SMEM (the interpreter's wgmma reads SMEM only)
                    p_ref = p_smem.at[wg]
                    p_ref[...] = p16
                    plgpu.commit_smem()

                def dp_t(acc_ref):
                    a_op = p16 if p_smem is None else p_ref
                    plgpu.wgmma(dv0, a_op, do_smem.at[st, :, cols[0]])
                    plgpu.wgmma(dv1, a_op, do_smem.at[st, :, cols[1]])
                    plgpu.wgmma(acc_ref, v_half, do_smem.at[st].transpose((1, 0)))
                    return acc_ref[...]
                dp = pl.run_scoped(dp_t, plgpu.ACC(shape, jnp.float32))
                ds = p16.astype(jnp.float32) * (dp - col_of(st_smem.at[st, 1]))
                ds_mine = ds_smem.at[st, half]
                ds_mine[...] = ds.astype(dtype)
                plgpu.commit_smem()
                plgpu.wgmma(dk0, ds_mine, q_smem.at[st, :, cols[0]])
                plgpu.wgmma(dk1, ds_mine, q_smem.at[st, :, cols[1]])
                plgpu.barrier_arrive(ds_ready.at[st])           # both dS^T halves in SMEM
                plgpu.barrier_wait(ds_ready.at[st])

                def dq_cols(acc_ref):
                    plgpu.wgmma(acc_ref, ds_smem.at[st].transpose((1, 0)), k_smem.at[:, half])
                    return acc_ref[...]
                dq = pl.run_scoped(dq_cols, plgpu.ACC((ROWS, _HALF), jnp.float32))
                plgpu.barrier_arrive(q_free.at[st])             # every wgmma reading the stage is done
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                dq_stg[...] = (dq * scale).astype(dq_stg.dtype)
                plgpu.commit_smem()
                for j, f in enumerate(flats):
                    @pl.when(e0 + j < end)
                    def _(f=f, j=j):
                        t = lax.div(f, topk)
                        plgpu.copy_smem_to_gmem(dq_stg.at[pl.ds(j * sr, sr)],
                                                dqp_ref.at[b, t, f - t * topk, heads, half])

            def store(val, piece_ref, whole_ref, c, w0, mode, full, own):
                """Stage one [64 keys, 64 columns] f32 block and write it: a run piece (mode 0 / 1) or the
                owned rows of a whole run (mode 2; one copy when all 64 rows are owned)."""
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                stg[...] = val
                plgpu.commit_smem()
                for m in (0, 1):
                    @pl.when(mode == m)
                    def _(m=m):
                        plgpu.copy_smem_to_gmem(stg, piece_ref.at[b, g, i, m, half, cols[c]])
                x0 = w0 + wg * _HALF

                @pl.when((mode == 2) & (full == 1))
                def _():
                    plgpu.copy_smem_to_gmem(stg, whole_ref.at[b, pl.ds(x0, _HALF), g, cols[c]])

                @pl.when((mode == 2) & (full == 0))
                def _():
                    def one(r, carry):
                        @pl.when(own[wg * _HALF + r] == w0)
                        def _():
                            plgpu.copy_smem_to_gmem(stg.at[pl.ds(r, 1)], whole_ref.at[b, pl.ds(x0 + r, 1), g, cols[c]])
                        return carry
                    lax.fori_loop(0, _HALF, one, None)

            def per_run(a, end, ri, ct, nt, w0):
                plgpu.barrier_wait(kv_ready.at[0])

                def run_accs(dk0, dk1, dv0, dv1):
                    def step(si, carry):
                        tile(a, end, ct, si, (dk0, dk1, dv0, dv1))
                        return carry
                    lax.fori_loop(0, nt, step, None)
                    return dk0[...], dk1[...], dv0[...], dv1[...]
                acc = plgpu.ACC((_HALF, _HALF), jnp.float32)
                dk0, dk1, dv0, dv1 = pl.run_scoped(run_accs, acc, acc, acc, acc)
                # K / V no longer read: the next window loads during the stores (own_smem has two slots)
                plgpu.barrier_arrive(kv_free.at[0])
                own = own_smem.at[lax.rem(ri, 2)]
                head = (a == lo) & cont_in
                tail = (end == hi) & cont_out
                mode = jnp.where(head, 0, jnp.where(tail, 1, 2))
                base = wg * _HALF
                full = jnp.where((own[base] == w0) & (own[base + _HALF - 1] == w0), 1, 0)
                for c, (val, piece_ref, whole_ref) in enumerate(((dk0 * scale, bdk_ref, wdk_ref),
                                                                 (dk1 * scale, bdk_ref, wdk_ref),
                                                                 (dv0, bdv_ref, wdv_ref), (dv1, bdv_ref, wdv_ref))):
                    store(val, piece_ref, whole_ref, c % 2, w0, mode, full, own)

            walk(per_run)
            plgpu.wait_smem_to_gmem(0)

    itemsize = jnp.dtype(dtype).itemsize
    d = q_ref.shape[-1]
    tr = mosaic_smem_transforms(d, itemsize)
    tr_half = mosaic_smem_transforms(_HALF, itemsize)
    extra = {}
    if p_in_smem:
        extra["p_smem"] = plgpu.SMEM((2, _HALF, ROWS), dtype, transforms=tr_half)
    if dqp_ref.dtype != jnp.float32:
        extra["dq_smem"] = plgpu.SMEM((2, ROWS, _HALF), dqp_ref.dtype)
    pl.run_scoped(
        scope,
        k_smem=plgpu.SMEM((blk, d), dtype, transforms=tr),
        v_smem=plgpu.SMEM((blk, d), dtype, transforms=tr),
        own_smem=plgpu.SMEM((2, blk), jnp.int32),
        q_smem=plgpu.SMEM((2, ROWS, d), dtype, transforms=tr),
        do_smem=plgpu.SMEM((2, ROWS, d), dtype, transforms=tr),
        lim_smem=plgpu.SMEM((2, 2, ROWS), jnp.int32),
        st_smem=plgpu.SMEM((2, 2, ROWS), jnp.float32),
        ds_smem=plgpu.SMEM((2, blk, ROWS), dtype, transforms=tr_half),
        stg_smem=plgpu.SMEM((2, _HALF, _HALF), jnp.float32),
        tab_smem=plgpu.SMEM((3, chunk), jnp.int32),
        kv_ready=plgpu.Barrier(num_arrivals=3, num_barriers=1),
        kv_free=plgpu.Barrier(num_arrivals=2, num_barriers=1),
        q_ready=plgpu.Barrier(num_arrivals=2 * per + 2, num_barriers=2),
        q_free=plgpu.Barrier(num_arrivals=2, num_barriers=2),
        ds_ready=plgpu.Barrier(num_arrivals=2, num_barriers=2),
        tab_ready=WorkTables.barrier(chunk),
        **extra,
        collective_axes="wg",
    )


def _chunk_bwd_wgmma(tok, ids, starts, dk, dv, *, prep_k, prep_v, own, kvpos, kvseg, blk, chunk, interpret, p_in_smem,
                     dq_partial_dtype):
    """One query pass: (dq [B,Tc,H,D] q.dtype, dk, dv [B,Sp,G,D] f32 totals with this pass added).
    tok = (q, do [B,Tc,G*sr,D] in head slots, lse, delta [B,Tc,H] f32, qpos, base, j0, j1 [B,Tc])."""
    q, do, lse, delta, qpos, base, j0, j1 = tok
    bsz, t, gs, d = q.shape
    sp, g = prep_k.shape[1], prep_k.shape[2]
    sr = gs // g
    h = lse.shape[2]
    hg = h // g
    topk = ids.shape[-1]
    per = ROWS // sr
    n_items = -(-t * topk // chunk)
    flat, key, run_end, n_valid = worklist(ids, starts)
    lims = _intervals(ids, flat, key, qpos, base, j0, j1, blk, sr, per)
    stats = _row_stats(lse, delta, flat, topk, g, hg, sr, per)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, n_items * chunk - t * topk)))   # table copies in bounds
    params = mosaic_interpret_params("sparse_bwd_wgmma") if interpret else None
    body = functools.partial(_body, blk=blk, topk=topk, sr=sr, per=per, chunk=chunk, scale=1.0 / math.sqrt(d),
                             p_in_smem=bool(interpret or p_in_smem))
    f32 = jnp.float32
    kernel = plgpu.kernel(
        body,
        out_type=[typed_out_struct((bsz, t, topk, gs, d), dq_partial_dtype, q),
                  typed_out_struct((bsz, sp, g, d), f32, q), typed_out_struct((bsz, sp, g, d), f32, q),
                  typed_out_struct((bsz, g, n_items, 2, blk, d), f32, q),
                  typed_out_struct((bsz, g, n_items, 2, blk, d), f32, q)],
        grid=(n_items, g, bsz), grid_names=("i", "g", "b"),
        num_threads=3, thread_name="wg", kernel_name="msa_sparse_bwd_wgmma",
        interpret=params,
    )
    dqp, wdk, wdv, bdk, bdv = kernel(pad(flat), pad(key), pad(run_end), n_valid, lims, stats, own, q, do,
                                     prep_k, prep_v)
    whole = _whole_keys(key, run_end, n_valid, own, chunk)
    dk = dk + layout.keep(wdk, whole)
    dv = dv + layout.keep(wdv, whole)
    dk, dv = merge_pieces(key, run_end, n_valid, kvpos, kvseg, [bdk, bdv], [dk, dv], blk=blk, chunk=chunk,
                          interpret=interpret)
    return sum_dq_partials(from_head_slots(dqp, g, hg, 3), ids, hg, q.dtype), dk, dv


def sparse_bwd_wgmma(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, o, lse, do,
                     *, block_size, interpret=False, num_warps=8, num_stages=2, chunk=None, rows=None,
                     query_chunk=None, dq_partial_bits=None, p_in_smem=False):
    """KV-outer MSA backward on Hopper: (dq [B,T,H,D] q.dtype, dk [B,S,G,D] k.dtype, dv [B,S,G,Dv] v.dtype).

    Arguments and outputs as ``gpu_sparse_bwd.sparse_bwd_kv_outer`` (``chunk``: sorted selections per program,
    a multiple of 32, None: ``default_bwd_chunk``; ``num_warps`` / ``num_stages`` / ``rows`` are the Triton
    fallback's knobs; ``dq_partial_bits``: None = 16 for bf16 inputs (bf16 keeps f32's exponent range; the
    partials are summed in f32), 32 for f16). ``interpret``: the Mosaic GPU interpreter (jax >= 0.11).
    ``p_in_smem``: feed P^T to the dV ``wgmma`` from SMEM (always so in the interpreter). Raises ValueError
    for shapes ``wgmma_bwd_supported`` refuses and for launch arguments ``gpu_sparse_fwd.check_launch``
    refuses. A query pass with any window off an 8-row boundary runs the Triton kernel of
    ``gpu_sparse_bwd`` (same results up to rounding), decided on the data inside the compiled loop.
    """
    # each TMA copy of the SMEM work-list tables moves a multiple of 128 bytes (32 int32 entries)
    check_launch(chunk=chunk, query_chunk=query_chunk, dq_partial_bits=dq_partial_bits, chunk_multiple=32)
    if dq_partial_bits is None:
        dq_partial_bits = 16 if q.dtype == jnp.bfloat16 else 32
    layout.check_shapes(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    why = wgmma_bwd_supported(q.shape, k.shape, v.shape[-1], q.dtype, block_size)
    if why is not None:
        raise ValueError(f"sparse_bwd_wgmma: {why}")
    if not k.dtype == v.dtype == q.dtype:
        raise ValueError(f"sparse_bwd_wgmma: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    dq_partial_dtype = jnp.float32 if dq_partial_bits == 32 else q.dtype
    bsz, t, h, d = q.shape
    s, g = k.shape[1], k.shape[2]
    hg = h // g
    sr = head_slot(hg)
    topk = block_ids.shape[-1]
    prep, ids, starts, delta, do, lse, qpos = bwd_inputs(q, k, v, block_ids, q_positions, kv_positions,
                                                         q_segment_ids, kv_segment_ids, o, lse, do, block_size)
    j0, j1 = jax.vmap(layout.segment_runs)(prep.kv_seg, prep.q_seg)
    own = owner_starts(prep.kv_pos, prep.kv_seg, block_size, prep.s_pad)
    if query_chunk is None:
        query_chunk = default_bwd_query_chunk(bsz, g * sr, g, d, d, topk, block_size, chunk or 128,
                                              dq_bytes=jnp.dtype(dq_partial_dtype).itemsize)
    if chunk is None:
        chunk = default_bwd_chunk(bsz * min(t, query_chunk) * topk * g)
    wg_run = functools.partial(_chunk_bwd_wgmma, prep_k=prep.k, prep_v=prep.v, own=own, kvpos=prep.kv_pos,
                               kvseg=prep.kv_seg, blk=block_size,
                               chunk=chunk, interpret=interpret, p_in_smem=p_in_smem,
                               dq_partial_dtype=dq_partial_dtype)
    tr_run = functools.partial(_chunk_bwd, prep_k=prep.k, prep_v=prep.v, kvpos=prep.kv_pos, kvseg=prep.kv_seg,
                               blk=block_size, chunk=chunk, rows=rows or max(32, layout.next_pow2(hg)),
                               interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                               dq_partial_dtype=dq_partial_dtype)

    def run(tok, ids, starts, dk, dv):
        q, do, lse, delta, qpos, qseg, base, j0, j1 = tok
        aligned = jnp.all((starts % 8 == 0) | (ids < 0))
        return lax.cond(aligned,
                        lambda: wg_run((to_head_slots(q, g, sr, 2), to_head_slots(do, g, sr, 2), lse, delta, qpos, base, j0,
                                         j1), ids, starts, dk, dv),
                        lambda: tr_run(q, do, lse, delta, ids, starts, qpos, qseg, dk, dv))

    dk = jnp.zeros(prep.k.shape, jnp.float32)
    dv = jnp.zeros(prep.v.shape, jnp.float32)
    dq, dk, dv = over_query_chunks(run, (q, do, lse, delta, qpos, prep.q_seg, prep.base, j0, j1), ids, starts,
                                   dk, dv, query_chunk, q.dtype)
    return dq, dk[:, :s].astype(k.dtype), dv[:, :s].astype(v.dtype)
