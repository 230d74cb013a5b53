"""MSA sparse attention backward on GPU, KV-outer, on the forward's schedule (Pallas, Triton lowering).

Math (MSA_SPEC.md section 3; FlashAttention-2 backward restricted to the selected blocks): with
p = exp(scale * q.k - lse) over a row's visible keys and delta = rowsum(o * do),
dv = sum p^T do, ds = p * (do.v - delta), dk = scale * sum ds^T q, dq = scale * sum_slots ds k.

Schedule (gpu_sparse_fwd.py): the valid (token, slot) selections of each kv group are sorted by
the storage start of their block window; program (i, g, b) takes the fixed slice [i*C, (i+1)*C)
and walks each run of one window in row tiles of tokens x heads (gathered q, do, lse, delta). One
fused kernel computes all five matmuls of a tile:
- dq: per-(token, slot) partials (f32, or q.dtype with ``dq_partial_bits=16``; [B, Tc, K, H, D]) summed over
  the K slots in XLA in f32;
- dk / dv: accumulated in registers over the run piece. A run that lies inside one program is
  added straight into the f32 dk / dv totals; a run split over programs leaves its pieces (at most
  the first and the last piece of each program) in a small buffer that a second kernel sums in
  program order and adds. Writes touch only the keys a window owns (below), so no two programs of
  a pass write one key: no atomics, bitwise-repeatable results.
Window ownership: key x (position p, storage index x) belongs to the window starting at
clamp(x - p mod B, 0, Sp - B), the only window any query reaches it through (layout.py).
Queries go in chunks (``query_chunk``, from a partials budget) in one compiled loop; dk / dv are
carried across chunks in f32 and cast once at the end.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.msa import layout
from pallas_kernels.msa.gpu_sparse_fwd import (PARTIALS_BUDGET, Window, check_launch, mask_logits, schedule,
                                              tile_loops, tile_rows)

__all__ = ["sparse_bwd_kv_outer", "default_bwd_chunk", "default_bwd_query_chunk", "slice_bounds", "owner_start", "owned", "add_owned",
           "follow_counts", "merge_pieces", "sum_dq_partials", "over_query_chunks", "bwd_inputs"]

_LOG2E = math.log2(math.e)


def _dot(a, b, trans_a=False, trans_b=False):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def slice_bounds(key_ref, nval_ref, b, g, i, chunk):
    """Program i's slice [lo, hi) and whether its first / last run continues from / into a neighbour."""
    n = key_ref.shape[-1]
    nval = nval_ref[b, g]
    lo = i * chunk
    hi = jnp.minimum(lo + chunk, nval)
    cont_in = (lo > 0) & (lo < hi) & (key_ref[b, g, jnp.maximum(lo - 1, 0)]
                                      == key_ref[b, g, jnp.minimum(lo, n - 1)])
    cont_out = (hi < nval) & (lo < hi) & (key_ref[b, g, jnp.minimum(hi, n - 1)]
                                          == key_ref[b, g, jnp.maximum(hi - 1, 0)])
    return lo, hi, cont_in, cont_out


def owner_start(x, kvp, blk, s_pad):
    """Storage start of the window that owns key x (module docstring): clamp(x - kv_pos mod B, 0, Sp - B); x and
    kvp int32 of one shape (in a kernel or in XLA)."""
    return jnp.clip(x - jax.lax.rem(jnp.maximum(kvp, 0), blk), 0, s_pad - blk)


def owned(kvp, kvs, w0, blk, s_pad):
    """Keys of the window at storage w0 that belong to it (module docstring): bool [B]."""
    x = w0 + jax.lax.broadcasted_iota(jnp.int32, kvp.shape, 0)
    return (owner_start(x, kvp, blk, s_pad) == w0) & (kvs >= 0)


def add_owned(ref, b, w0, g, val, own):
    """ref[b, w0:w0+B, g, :] += val on the owned rows only (read-modify-write, masked store)."""
    view = ref.at[b, pl.ds(w0, val.shape[0]), g, :]
    pltriton.store(view, view[...] + val, mask=own[:, None])


def _kernel(flat_ref, key_ref, rend_ref, nval_ref, mend_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
            delta_ref, ids_ref, qpos_ref, qseg_ref, kvpos_ref, kvseg_ref, dk_in_ref, dv_in_ref,
            dqp_ref, bdk_ref, bdv_ref, dk_ref, dv_ref, *, blk, topk, scale, hg, per, chunk, rows,
            s_pad):
    del dk_in_ref, dv_in_ref                    # aliased with dk_ref / dv_ref
    i = pl.program_id(0)
    g = pl.program_id(1)
    b = pl.program_id(2)
    lo, hi, cont_in, cont_out = slice_bounds(key_ref, nval_ref, b, g, i, chunk)
    r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    j = r // hg
    head = g * hg + (r - j * hg)
    row_in = j < per
    qk_scale = scale * _LOG2E
    d = q_ref.shape[-1]
    dv_dim = v_ref.shape[-1]

    def run(a):
        end = jnp.minimum(rend_ref[b, g, a], hi)
        w0 = key_ref[b, g, a]
        win = Window(k_ref, v_ref, kvpos_ref, kvseg_ref, b, g, w0, blk)
        kb, vb = win.k, win.v

        def tile(si, carry, masked):
            dk, dv = carry
            e = a + si * per + j
            ok = row_in & (e < end)
            t, slot, n, qp, qs = tile_rows(flat_ref, ids_ref, qpos_ref, qseg_ref, b, g, e, ok, topk, a)
            q = q_ref[b, t, head, :]                          # [R, D] gathered rows
            do = do_ref[b, t, head, :]                        # [R, Dv]
            lse2 = lse_ref[b, t, head] * _LOG2E
            delta = delta_ref[b, t, head]
            s = _dot(q, kb, trans_b=True) * qk_scale           # [R, B] log2 domain
            s = mask_logits(s, win, ok, n, qp, qs, masked=masked)
            # a row that sees no key at all has lse = -inf; its s is all -inf here, so p = 0
            p = jnp.exp2(s - jnp.where(lse2 == -jnp.inf, 0.0, lse2)[:, None])
            dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)          # [B, Dv]
            dp = _dot(do, vb, trans_b=True)                               # [R, B]
            ds = (p * (dp - delta[:, None])).astype(q.dtype)
            dk = dk + _dot(ds, q, trans_a=True)                           # [B, D]
            dq = _dot(ds, kb) * scale                                     # [R, D]
            # masked rows point at the spare token row T (see gpu_sparse_fwd.py)
            t_st = jnp.where(ok, t, dqp_ref.shape[1] - 1)[:, None]
            dcol = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)
            pltriton.store(dqp_ref.at[b, t_st, slot[:, None], head[:, None], dcol], dq.astype(dqp_ref.dtype),
                           mask=ok[:, None])
            return dk, dv

        dk, dv = tile_loops(tile, mend_ref, b, g, a, end, per,
                            (jnp.zeros((blk, d), jnp.float32), jnp.zeros((blk, dv_dim), jnp.float32)))
        dk = dk * scale
        is_head = (a == lo) & cont_in
        is_tail = (end == hi) & cont_out & jnp.logical_not(is_head)

        @pl.when(is_head)
        def _():
            bdk_ref[b, g, i, 0] = dk
            bdv_ref[b, g, i, 0] = dv

        @pl.when(is_tail)
        def _():
            bdk_ref[b, g, i, 1] = dk
            bdv_ref[b, g, i, 1] = dv

        @pl.when(jnp.logical_not(is_head | is_tail))
        def _():
            own = owned(win.kvp, win.kvs, w0, blk, s_pad)
            add_owned(dk_ref, b, w0, g, dk, own)
            add_owned(dv_ref, b, w0, g, dv, own)

        return end

    jax.lax.while_loop(lambda a: a < hi, run, lo)


def _merge_kernel(follow_ref, key_ref, nval_ref, kvpos_ref, kvseg_ref, *refs, n, blk, chunk, s_pad):
    """Sum the pieces of every run split over programs, in program order, into the totals.

    refs: n piece buffers [B,G,n_items,2,B,X], n aliased totals (unused), n totals [B,Sp,G,X].
    Program i owns the run whose first piece is its slot 1 when ``follow[i] > 0``: the run's other
    pieces are the slot-0 pieces of programs i+1 .. i+follow[i] (``follow_counts``).
    """
    pieces, totals = refs[:n], refs[2 * n:]
    i = pl.program_id(0)
    g = pl.program_id(1)
    b = pl.program_id(2)
    nf = follow_ref[b, g, i]

    def body(m, acc):
        return tuple(a + pc[b, g, i + 1 + m, 0] for a, pc in zip(acc, pieces))

    acc = jax.lax.fori_loop(0, nf, body, tuple(pc[b, g, i, 1] for pc in pieces))
    hi = jnp.minimum(i * chunk + chunk, nval_ref[b, g])
    w0 = jnp.where(nf > 0, key_ref[b, g, jnp.maximum(hi - 1, 0)], 0)
    sl = pl.ds(w0, blk)
    own = owned(kvpos_ref[b, sl], kvseg_ref[b, sl], w0, blk, s_pad) & (nf > 0)
    for a, tot in zip(acc, totals):
        add_owned(tot, b, w0, g, a, own)


def merge_pieces(key, run_end, n_valid, kvpos, kvseg, pieces, totals, *, blk, chunk, interpret):
    """Add the pieces of the runs split over programs to ``totals`` (list of [B,Sp,G,X] f32)."""
    n = len(pieces)
    n_items = pieces[0].shape[2]
    follow = follow_counts(key, run_end, n_valid, chunk, n_items)
    kernel = functools.partial(_merge_kernel, n=n, blk=blk, chunk=chunk, s_pad=totals[0].shape[1])
    return pl.pallas_call(
        kernel,
        grid=(n_items,) + tuple(pieces[0].shape[1::-1]),
        out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in totals],
        input_output_aliases={5 + n + j: j for j in range(n)},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="msa_bwd_merge_gpu",
    )(follow, key, n_valid, kvpos, kvseg, *pieces, *totals)


def follow_counts(key, run_end, n_valid, chunk, n_items):
    """Per program: how many following programs hold pieces of the run it owns (0: owns none).

    A program owns a run when its last piece continues into the next program and is not itself a
    continuation spanning the whole program; the run then covers the next program, and every
    further one made of that run alone. int32 [B, G, n_items]. (Computed in XLA: a data-dependent
    loop in the merge kernel crashes the Triton compiler.)
    """
    n = key.shape[-1]
    i = jnp.arange(n_items, dtype=jnp.int32)
    lo = jnp.broadcast_to(i * chunk, key.shape[:2] + (n_items,))
    hi = jnp.minimum(lo + chunk, n_valid[..., None])                       # [B, G, n_items]
    at = lambda x, idx: jnp.take_along_axis(x, jnp.clip(idx, 0, n - 1), axis=-1)
    cont_in = (lo > 0) & (lo < hi) & (at(key, lo - 1) == at(key, lo))
    cont_out = (hi < n_valid[..., None]) & (lo < hi) & (at(key, hi) == at(key, hi - 1))
    single = at(run_end, lo) >= hi
    owner = cont_out & jnp.logical_not(single & cont_in)
    through = single & cont_out                                   # a program the run crosses whole
    nxt = jax.lax.cummin(jnp.where(through, n_items, i), axis=2, reverse=True)   # first non-crossed
    nxt_after = jnp.concatenate([nxt[..., 1:], jnp.full(nxt.shape[:-1] + (1,), n_items, jnp.int32)],
                                axis=-1)
    return jnp.where(owner, nxt_after - i, 0).astype(jnp.int32)


def _chunk_bwd(q, do, lse, delta, ids, starts, qpos, qseg, dk, dv, *, prep_k, prep_v, kvpos, kvseg,
               blk, chunk, rows, interpret, num_warps, num_stages, dq_partial_dtype):
    """One query chunk: (dq [B,Tc,H,D] q.dtype, dk, dv [B,Sp,G,D] f32 totals with this chunk added)."""
    bsz, t, h, d = q.shape
    sp, g = prep_k.shape[1], prep_k.shape[2]
    dvd = prep_v.shape[-1]
    topk = ids.shape[-1]
    hg, per, n_items, lists = schedule(ids, starts, qpos, qseg, kvpos, kvseg, h=h, rows=rows,
                                       chunk=chunk, blk=blk)
    _, key, run_end, n_valid, _ = lists
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    kernel = functools.partial(_kernel, blk=blk, topk=topk, scale=1.0 / math.sqrt(d), hg=hg,
                               per=per, chunk=chunk, rows=rows, s_pad=sp)
    tot = [jax.ShapeDtypeStruct(dk.shape, jnp.float32), jax.ShapeDtypeStruct(dv.shape, jnp.float32)]
    dqp, bdk, bdv, dk, dv = pl.pallas_call(
        kernel,
        grid=(n_items, g, bsz),
        out_shape=[jax.ShapeDtypeStruct((bsz, t + 1, topk, h, d), dq_partial_dtype),   # + spare row
                   jax.ShapeDtypeStruct((bsz, g, n_items, 2, blk, d), jnp.float32),
                   jax.ShapeDtypeStruct((bsz, g, n_items, 2, blk, dvd), jnp.float32)] + tot,
        input_output_aliases={16: 3, 17: 4},
        compiler_params=params,
        interpret=interpret,
        name="msa_bwd_gpu",
    )(*lists, q, prep_k, prep_v, do, lse, delta, ids, qpos, qseg, kvpos, kvseg,
      dk, dv)
    dk, dv = merge_pieces(key, run_end, n_valid, kvpos, kvseg, [bdk, bdv], [dk, dv], blk=blk,
                          chunk=chunk, interpret=interpret)
    return sum_dq_partials(dqp[:, :t], ids, hg, q.dtype), dk, dv


def sum_dq_partials(dqp, ids, hg, dtype):
    """dq [B,T,H,D] ``dtype``: the per-(token, slot) partials dqp [B,T,K,H,D] summed over the valid slots of
    ids [B,G,T,K] in f32 (unused slots are bit-masked: their partials may be undefined)."""
    valid = jnp.repeat(jnp.transpose(ids >= 0, (0, 2, 3, 1)), hg, axis=-1)[..., None]   # [B,T,K,H,1]
    return jnp.sum(layout.keep(dqp.astype(jnp.float32), valid), axis=2).astype(dtype)


def over_query_chunks(run, tok, ids, starts, dk, dv, query_chunk, dq_dtype):
    """(dq [B,T,H,D] ``dq_dtype``, dk, dv): ``run(tok, ids, starts, dk, dv) -> (dq_c, dk, dv)`` over the query
    tokens in chunks of ``query_chunk``, one compiled loop; ``tok``: per-token arrays [B,T,...] (q first),
    ids / starts [B,G,T,K]; dk / dv f32 totals carried across chunks. The last chunk is clamped to end at T:
    its tokens already done get no slot (they add nothing to dk / dv) and keep their dq."""
    t = tok[0].shape[1]
    if t <= query_chunk:
        return run(tok, ids, starts, dk, dv)
    n_c = -(-t // query_chunk)
    dsl = jax.lax.dynamic_slice_in_dim

    def body(c, carry):
        dq, dk, dv = carry
        a = jnp.minimum(c * query_chunk, t - query_chunk)
        fresh = (a + jnp.arange(query_chunk)) >= c * query_chunk            # [Tc]
        ids_c = jnp.where(fresh[None, None, :, None], dsl(ids, a, query_chunk, 2), -1)
        sl = lambda x, ax=1: dsl(x, a, query_chunk, ax)
        dq_c, dk, dv = run(tuple(sl(x) for x in tok), ids_c, sl(starts, 2), dk, dv)
        dq_c = jnp.where(fresh[None, :, None, None], dq_c, sl(dq))
        return jax.lax.dynamic_update_slice_in_dim(dq, dq_c, a, 1), dk, dv

    return jax.lax.fori_loop(0, n_c, body, (jnp.zeros(tok[0].shape, dq_dtype), dk, dv))


def default_bwd_query_chunk(bsz, h, g, d, dv, topk, blk, chunk, budget_bytes=PARTIALS_BUDGET, dq_bytes=4):
    """Query tokens per backward chunk so the dq partials (``dq_bytes`` per element) and run-piece buffers fit
    the budget."""
    per_token = bsz * topk * (h * d * dq_bytes + 2 * g * blk * (d + dv) * 4 / chunk)
    c = max(1, int(budget_bytes // per_token))
    return 1 << (c.bit_length() - 1)


def default_bwd_chunk(selections: int, programs: int = 2048) -> int:
    """Sorted selections per backward program: the largest of 512 / 256 / 128 that still gives at least
    ``programs`` programs for ``selections`` (B x query chunk x K x G) selections per pass. Fewer, longer
    programs write fewer run pieces (less merge traffic; measured in BENCHMARKS.md, MSA backward probe);
    below ~2,048 programs the last wave of programs would leave the GPU idle."""
    for c in (512, 256):
        if selections // c >= programs:
            return c
    return 128


def bwd_inputs(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, o, lse, do,
               block_size):
    """What every KV-outer backward starts from: (prep (``layout.prepare``), ids (deduplicated), window
    starts, delta = rowsum(o * do) f32 [B,T,H], do in q.dtype, lse f32 [B,T,H], q positions int32 [B,T])."""
    prep = layout.prepare(k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_size)
    ids = layout.dedupe_ids(block_ids)
    starts = layout.window_starts(ids, prep.base, block_size, prep.s_pad)
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    return prep, ids, starts, delta, do.astype(q.dtype), lse.astype(jnp.float32), q_positions.astype(jnp.int32)


def sparse_bwd_kv_outer(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                        kv_segment_ids, o, lse, do, *, block_size, interpret=False, num_warps=8,
                        num_stages=2, chunk=None, rows=None, query_chunk=None, dq_partial_bits=32):
    """KV-outer MSA backward: (dq [B,T,H,D] q.dtype, dk [B,S,G,D] k.dtype, dv [B,S,G,Dv] v.dtype).

    Arguments as ``gpu_attention.msa_attention_gpu`` plus the forward's ``o`` [B,T,H,Dv], ``lse``
    [B,T,H] f32 (natural log) and the cotangent ``do`` [B,T,H,Dv]. ``chunk``: sorted selections
    per program (None: ``default_bwd_chunk`` of the pass); ``rows``: (token, head) rows per tile
    (None: max(32, next_pow2(H/G)));
    ``query_chunk``: query tokens per pass (None: ``default_bwd_query_chunk``). ``dq_partial_bits``: 32 keeps
    the per-(token, slot) dq partials in f32, 16 in q.dtype (half their write + read traffic; each partial
    rounded once before the f32 sum over the K slots; None: 32). Bad launch arguments raise ValueError
    (``gpu_sparse_fwd.check_launch``); shape preconditions are asserted.
    """
    check_launch(chunk=chunk, query_chunk=query_chunk, dq_partial_bits=dq_partial_bits)
    if dq_partial_bits is None:
        dq_partial_bits = 32
    dq_partial_dtype = jnp.float32 if dq_partial_bits == 32 else q.dtype
    layout.check_shapes(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    bsz, t, h, d = q.shape
    s, g = k.shape[1], k.shape[2]
    topk = block_ids.shape[-1]
    prep, ids, starts, delta, do, lse, qpos = bwd_inputs(q, k, v, block_ids, q_positions, kv_positions,
                                                         q_segment_ids, kv_segment_ids, o, lse, do, block_size)
    qseg = prep.q_seg
    if rows is None:
        rows = max(32, layout.next_pow2(h // g))
    if query_chunk is None:   # sized for chunk 128 (the most run pieces), then the chunk for it
        query_chunk = default_bwd_query_chunk(bsz, h, g, d, v.shape[-1], topk, block_size, chunk or 128,
                                              dq_bytes=jnp.dtype(dq_partial_dtype).itemsize)
    if chunk is None:
        chunk = default_bwd_chunk(bsz * min(t, query_chunk) * topk * g)
    run = functools.partial(_chunk_bwd, prep_k=prep.k, prep_v=prep.v, kvpos=prep.kv_pos,
                            kvseg=prep.kv_seg, blk=block_size, chunk=chunk, rows=rows,
                            interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                            dq_partial_dtype=dq_partial_dtype)
    dk = jnp.zeros(prep.k.shape, jnp.float32)
    dv = jnp.zeros(prep.v.shape, jnp.float32)
    dq, dk, dv = over_query_chunks(lambda tok, ids, starts, dk, dv: run(*tok[:4], ids, starts, *tok[4:], dk, dv),
                                   (q, do, lse, delta, qpos, qseg), ids, starts, dk, dv, query_chunk, q.dtype)
    return dq, dk[:, :s].astype(k.dtype), dv[:, :s].astype(v.dtype)
