"""MSA indexer KL loss on GPU (Pallas, Triton lowering), sparse support, KV-outer on the attention's
schedule; forward and backward (the dense warm-up's support: gpu_kl_dense.py).

Math (MSA_SPEC.md section 4; minimax_jax.ops.msa.kl is the reference): for query i and group r the
support U is the visible keys of the selected blocks block_ids[b, r, i, :].
  teacher t_j = mean over the group's H/G heads of softmax_U(q_h . k_j / sqrt(D))   (no gradient)
  student p_j = softmax_U(qi_r . ki_j / sqrt(Di))
  KL(t || p) = sum_j t_j (log t_j - log p_j);  d KL / d x_j = p_j - t_j  (x = student logits).
Returns (sum of KL over (b, i, r), number of rows with a non-empty support); with per-query weights w_i
(prefix-tree rows: a merged query stands for w_i unmerged ones) the weighted sum and count, and the
gradients of the weighted sum (d x scaled by w_i in the kernel).

Schedule (gpu_sparse_fwd.py): selections sorted by block window, fixed slices of C entries per
program, runs of one window walked in row tiles of tokens x heads. Per query chunk:
1. ``msa_kl_lse_gpu``: per (token, slot) the block log-sum-exp of every head's teacher logits and
   of the student logits; XLA merges the K slots (the support's log-sum-exps). Given the teacher's
   LSE (``teacher_lse``: the attention forward computed it over the same support), only the
   student's (``msa_kl_student_lse_gpu``: no main-branch logits).
2. ``msa_kl_gpu`` on tiles of tokens: per (token, slot) the teacher (the exact f32 mean of the group's
   heads' probabilities, one head's product per loop step), the KL terms and, with gradients,
   d x = p - t: d qi partials per slot (summed in XLA) and d ki accumulated per window piece (per
   group, added with the attention backward's
   ownership-masked writes and merge; XLA sums the groups). The gradients are those of a unit
   cotangent, kept as residuals and scaled in the backward: no atomics, bitwise repeatable.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.msa import layout
from pallas_kernels.msa.gpu_sparse_bwd import add_owned, default_bwd_chunk, merge_pieces, owned, slice_bounds
from pallas_kernels.msa.gpu_sparse_fwd import (PARTIALS_BUDGET, Window, mask_logits, schedule,
                                              tile_loops, tile_rows)

__all__ = ["indexer_kl_gpu"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _dot(a, b, trans_a=False, trans_b=False):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _row_lse2(s):
    """Log2-sum-exp2 of each row of s (-inf rows: -inf)."""
    m = jnp.max(s, axis=1)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    l = jnp.sum(jnp.exp2(s - m_safe[:, None]), axis=1)
    return jnp.where(l == 0.0, -jnp.inf, m_safe + jnp.log2(jnp.where(l == 0.0, 1.0, l)))


class _Tile:
    """The rows (token, head) and the tokens of row tile ``si`` of the run starting at entry a."""

    def __init__(self, refs, b, g, a, si, end, *, hg, per, per_pad, topk, rows):
        flat_ref, ids_ref, qpos_ref, qseg_ref = refs
        self.it = jax.lax.broadcasted_iota(jnp.int32, (per_pad,), 0)
        e_tok = a + si * per + self.it
        self.ok_tok = (self.it < per) & (e_tok < end)
        self.t_tok, self.slot_tok, self.n_tok, self.qp_tok, self.qs_tok = tile_rows(
            flat_ref, ids_ref, qpos_ref, qseg_ref, b, g, e_tok, self.ok_tok, topk, a)
        if hg == 1 and per_pad == rows:       # token tiles: the rows are the tokens (no second table read)
            self.j, self.head = self.it, jnp.full_like(self.it, g)
            self.ok, self.t, self.slot, self.n, self.qp, self.qs = (
                self.ok_tok, self.t_tok, self.slot_tok, self.n_tok, self.qp_tok, self.qs_tok)
            return
        r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
        self.j = r // hg
        self.head = g * hg + (r - self.j * hg)
        e = a + si * per + self.j
        self.ok = (self.j < per) & (e < end)
        self.t, self.slot, self.n, self.qp, self.qs = tile_rows(
            flat_ref, ids_ref, qpos_ref, qseg_ref, b, g, e, self.ok, topk, a)


def _student_logits(qi_ref, win, kib, tl, b, g, iscale, masked):
    """Masked student logits of the tokens [P, B] (log2) and their index queries [P, Di]."""
    qi = qi_ref[b, tl.t_tok, g, :]                                   # [P, Di]
    x = mask_logits(_dot(qi, kib, trans_b=True) * (iscale * _LOG2E), win, tl.ok_tok, tl.n_tok,
                    tl.qp_tok, tl.qs_tok, masked=masked)
    return x, qi


def _logits(q_ref, qi_ref, win, kib, tl, b, g, scale, iscale, masked):
    """Masked teacher logits of the rows [R, B] and student logits of the tokens [P, B] (log2);
    ``masked=False``: a mask-free tile (``tile_loops``), only the rows not ``ok`` blanked."""
    q = q_ref[b, tl.t, tl.head, :]                                   # [R, D] gathered rows
    s = mask_logits(_dot(q, win.k, trans_b=True) * (scale * _LOG2E), win, tl.ok, tl.n, tl.qp, tl.qs,
                    masked=masked)
    x, qi = _student_logits(qi_ref, win, kib, tl, b, g, iscale, masked)
    return s, x, qi


def _probs(s, lse):
    """Each row's probabilities from its log2 logits s [R, B] and natural-log LSE [R] (-inf: an empty row)."""
    lse2 = lse * _LOG2E
    return jnp.exp2(s - jnp.where(lse2 == -jnp.inf, 0.0, lse2)[:, None])


def _teacher_loop(q_ref, lse_ref, win, tl, b, g, heads, scale, masked, shape):
    """The teacher of each token row of a token tile [P, B] (rows are tokens): the f32 mean over the group's
    ``heads`` of each head's probabilities, one head's [P, D] x [D, B] product per loop step."""
    def body(hh, acc):
        head = jnp.full_like(tl.t_tok, g * heads + hh)
        q = q_ref[b, tl.t_tok, head, :]                               # [P, D]
        s = mask_logits(_dot(q, win.k, trans_b=True) * (scale * _LOG2E), win, tl.ok_tok, tl.n_tok, tl.qp_tok,
                        tl.qs_tok, masked=masked)
        return acc + _probs(s, lse_ref[b, tl.t_tok, head])
    return jax.lax.fori_loop(0, heads, body, jnp.zeros(shape, jnp.float32)) * (1.0 / heads)


def _spare(ok, t, ref):
    """Token index for a masked store: rows not ``ok`` point at the spare row T (gpu_sparse_fwd.py)."""
    return jnp.where(ok, t, ref.shape[1] - 1)


def _lse_kernel(flat_ref, key_ref, rend_ref, nval_ref, mend_ref, q_ref, k_ref, qi_ref, ki_ref,
                ids_ref, qpos_ref, qseg_ref, kvpos_ref, kvseg_ref, *out_refs, blk, topk, scale,
                iscale, hg, per, per_pad, chunk, rows, teacher):
    lp_ref, lxp_ref = out_refs if teacher else (None, out_refs[0])
    i = pl.program_id(0)
    g = pl.program_id(1)
    b = pl.program_id(2)
    lo, hi, _, _ = slice_bounds(key_ref, nval_ref, b, g, i, chunk)
    refs = (flat_ref, ids_ref, qpos_ref, qseg_ref)

    def run(a):
        end = jnp.minimum(rend_ref[b, g, a], hi)
        win = Window(k_ref if teacher else None, None, kvpos_ref, kvseg_ref, b, g, key_ref[b, g, a], blk)
        kib = ki_ref[b, pl.ds(key_ref[b, g, a], blk), 0, :]          # [B, Di]

        def tile(si, carry, masked):
            tl = _Tile(refs, b, g, a, si, end, hg=hg, per=per, per_pad=per_pad, topk=topk, rows=rows)
            if teacher:
                s, x, _ = _logits(q_ref, qi_ref, win, kib, tl, b, g, scale, iscale, masked)
                pltriton.store(lp_ref.at[b, _spare(tl.ok, tl.t, lp_ref), tl.slot, tl.head],
                               _row_lse2(s) * _LN2, mask=tl.ok)
            else:                         # the teacher's LSE is given (the attention forward's)
                x, _ = _student_logits(qi_ref, win, kib, tl, b, g, iscale, masked)
            gcol = jnp.full_like(tl.slot_tok, g)
            pltriton.store(lxp_ref.at[b, _spare(tl.ok_tok, tl.t_tok, lxp_ref), tl.slot_tok, gcol],
                           _row_lse2(x) * _LN2, mask=tl.ok_tok)
            return carry

        tile_loops(tile, mend_ref, b, g, a, end, per, 0)
        return end

    jax.lax.while_loop(lambda a: a < hi, run, lo)


def _kl_kernel(flat_ref, key_ref, rend_ref, nval_ref, mend_ref, q_ref, k_ref, qi_ref, ki_ref,
               ids_ref, qpos_ref, qseg_ref, kvpos_ref, kvseg_ref, lse_ref, lsex_ref, *refs, blk, topk,
               scale, iscale, hg, per, per_pad, chunk, rows, s_pad, grads, weighted, heads):
    if weighted:                                         # per-token weights [B, T+1] (spare row 0)
        qw_ref, refs = refs[0], refs[1:]
    if grads:
        _, klp_ref, dqip_ref, bdki_ref, dki_ref = refs       # refs[0]: the aliased d ki input
    else:
        (klp_ref,) = refs
    i = pl.program_id(0)
    g = pl.program_id(1)
    b = pl.program_id(2)
    lo, hi, cont_in, cont_out = slice_bounds(key_ref, nval_ref, b, g, i, chunk)
    trefs = (flat_ref, ids_ref, qpos_ref, qseg_ref)
    di = qi_ref.shape[-1]

    def run(a):
        end = jnp.minimum(rend_ref[b, g, a], hi)
        w0 = key_ref[b, g, a]
        win = Window(k_ref, None, kvpos_ref, kvseg_ref, b, g, w0, blk)
        kib = ki_ref[b, pl.ds(w0, blk), 0, :]                        # [B, Di]

        def tile(si, dki, masked):
            tl = _Tile(trefs, b, g, a, si, end, hg=hg, per=per, per_pad=per_pad, topk=topk, rows=rows)
            x, qi = _student_logits(qi_ref, win, kib, tl, b, g, iscale, masked)     # token tiles (hg = 1 here)
            tch = _teacher_loop(q_ref, lse_ref, win, tl, b, g, heads, scale, masked, x.shape)
            lx2 = lsex_ref[b, tl.t_tok, g] * _LOG2E
            lx2 = jnp.where(lx2 == -jnp.inf, 0.0, lx2)
            log_p = x - lx2[:, None]                                    # log2 student prob
            pos = tch > 0.0
            term = jnp.where(pos, tch * (jnp.log2(jnp.where(pos, tch, 1.0)) - log_p), 0.0)
            t_st = _spare(tl.ok_tok, tl.t_tok, klp_ref)
            gcol = jnp.full_like(tl.slot_tok, g)
            pltriton.store(klp_ref.at[b, t_st, tl.slot_tok, gcol], jnp.sum(term, axis=1) * _LN2,
                           mask=tl.ok_tok)
            if not grads:
                return dki
            dx = jnp.exp2(log_p) - tch                                  # [P, B]; 0 off the support
            if weighted:                                                # a weighted row's gradient
                dx = dx * qw_ref[b, t_st][:, None]
            dx = dx.astype(qi.dtype)
            dqi = _dot(dx, kib) * iscale                                # [P, Di]
            dcol = jax.lax.broadcasted_iota(jnp.int32, (1, di), 1)
            pltriton.store(dqip_ref.at[b, t_st[:, None], tl.slot_tok[:, None], gcol[:, None], dcol],
                           dqi, mask=tl.ok_tok[:, None])
            return dki + _dot(dx, qi, trans_a=True) * iscale            # [B, Di]

        dki = tile_loops(tile, mend_ref, b, g, a, end, per, jnp.zeros((blk, di), jnp.float32))
        if grads:
            is_head = (a == lo) & cont_in
            is_tail = (end == hi) & cont_out & jnp.logical_not(is_head)

            @pl.when(is_head)
            def _():
                bdki_ref[b, g, i, 0] = dki

            @pl.when(is_tail)
            def _():
                bdki_ref[b, g, i, 1] = dki

            @pl.when(jnp.logical_not(is_head | is_tail))
            def _():
                add_owned(dki_ref, b, w0, g, dki, owned(win.kvp, win.kvs, w0, blk, s_pad))
        return end

    jax.lax.while_loop(lambda a: a < hi, run, lo)


def _logsumexp_slots(parts, valid):
    """Merge per-slot log-sum-exps [B,T,K,X] over the valid slots -> [B,T,X] (-inf: none)."""
    parts = jnp.where(valid, parts, -jnp.inf)
    m = jnp.max(parts, axis=2)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    total = jnp.sum(jnp.exp(parts - m_safe[:, :, None]), axis=2)
    return jnp.where(total == 0.0, -jnp.inf, m_safe + jnp.log(jnp.where(total == 0.0, 1.0, total)))


def _chunk(q, qi, ids, starts, qpos, qseg, fresh, dki, teacher_lse, qw, *, kp, kip, kvpos, kvseg, blk, chunk, rows,
           grads, interpret, num_warps):
    """One query chunk: (kl_sum, count, dqi [B,Tc,G,Di] f32 or None, dki totals [B,Sp,G,Di] f32);
    ``teacher_lse`` ``[B,Tc,H]`` (natural log) or None (computed here, pass 1); ``qw`` ``[B,Tc]`` f32 query
    weights or None (then ``count`` is int32, else the weighted float32 count)."""
    bsz, t, h, d = q.shape
    g, di = kp.shape[2], qi.shape[-1]
    topk = ids.shape[-1]
    hg, per, n_items, lists = schedule(ids, starts, qpos, qseg, kvpos, kvseg, h=h, rows=rows,
                                       chunk=chunk, blk=blk)
    _, key, run_end, n_valid, _ = lists
    per_pad = max(16, layout.next_pow2(per))
    sp = kp.shape[1]
    consts = dict(blk=blk, topk=topk, scale=1.0 / math.sqrt(d), iscale=1.0 / math.sqrt(di), hg=hg,
                  per=per, per_pad=per_pad, chunk=chunk, rows=rows)
    params = dict(compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
                  interpret=interpret)
    head = (*lists, q, kp, qi, kip, ids, qpos, qseg, kvpos, kvseg)
    grid = (n_items, g, bsz)
    teacher = teacher_lse is None
    # Pass 2's tiles, and pass 1's given the teacher's LSE, hold `rows` tokens (not rows // (H/G)): pass 2 runs
    # the teacher's heads in a loop inside the tile (measured 1.6-1.9x faster than (token, head) row tiles at
    # 128K: BENCHMARKS.md, MSA indexer KL probe).
    tok_consts = dict(consts, hg=1, per=rows, per_pad=max(16, layout.next_pow2(rows)))
    lse_consts = consts if teacher else tok_consts
    kl_consts = dict(tok_consts, heads=hg)
    parts = pl.pallas_call(
        functools.partial(_lse_kernel, teacher=teacher, **lse_consts), grid=grid,
        out_shape=[jax.ShapeDtypeStruct((bsz, t + 1, topk, h), jnp.float32)] * teacher     # + spare row
        + [jax.ShapeDtypeStruct((bsz, t + 1, topk, g), jnp.float32)],
        name="msa_kl_lse_gpu" if teacher else "msa_kl_student_lse_gpu", **params,
    )(*head)
    valid = jnp.transpose(ids >= 0, (0, 2, 3, 1))                              # [B,T,K,G]
    lse = (_logsumexp_slots(parts[0][:, :t], jnp.repeat(valid, hg, axis=-1)) if teacher
           else teacher_lse.astype(jnp.float32))                                # [B,T,H]
    lsex = _logsumexp_slots(parts[-1][:, :t], valid)                            # [B,T,G]
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    outs = [f32(bsz, t + 1, topk, g)]
    args = list(head) + [lse, lsex]
    if qw is not None:
        args.append(jnp.pad(qw.astype(jnp.float32), ((0, 0), (0, 1))))          # + spare row
    if grads:
        outs += [f32(bsz, t + 1, topk, g, di), f32(bsz, g, n_items, 2, blk, di), f32(*dki.shape)]
        args.append(dki)
    res = pl.pallas_call(
        functools.partial(_kl_kernel, s_pad=sp, grads=grads, weighted=qw is not None, **kl_consts), grid=grid,
        out_shape=outs,
        input_output_aliases={len(args) - 1: 3} if grads else {},
        name="msa_kl_gpu", **params,
    )(*args)
    klp = res[0][:, :t]
    rows_ok = jnp.isfinite(lsex) & fresh[None, :, None]
    if qw is None:
        kl = jnp.sum(jnp.where(valid & rows_ok[:, :, None, :], klp, 0.0))
        count = jnp.sum(rows_ok.astype(jnp.int32))
    else:
        w = qw.astype(jnp.float32)[:, :, None]                                   # [B,T,1]
        kl = jnp.sum(jnp.sum(jnp.where(valid & rows_ok[:, :, None, :], klp, 0.0), axis=2) * w)
        count = jnp.sum(jnp.where(rows_ok, w, 0.0))
    if not grads:
        return kl, count, None, dki
    (dki,) = merge_pieces(key, run_end, n_valid, kvpos, kvseg, [res[2]], [res[3]], blk=blk,
                          chunk=chunk, interpret=interpret)
    dqi = jnp.sum(layout.keep(res[1][:, :t], valid[..., None]), axis=2)          # [B,T,G,Di]
    return kl, count, dqi, dki


def _query_chunk(bsz, h, g, di, topk, blk, chunk, budget_bytes=PARTIALS_BUDGET):
    """Query tokens per pass so the per-slot partials (lse, KL, d qi) and the d ki pieces of split
    runs fit the budget (a power of two)."""
    per_token = bsz * topk * 4 * (h + g * (2 + di) + g * 2 * blk * di / chunk)
    c = max(1, int(budget_bytes // per_token))
    return 1 << (c.bit_length() - 1)


def _run(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk, interpret, grads,
         teacher_lse=None, q_weights=None, rows=32, chunk=None, query_chunk=None, num_warps=8):
    """(kl_sum, count, dqi, dki) for a unit cotangent (dqi / dki None without ``grads``). ``chunk``: sorted
    selections per program (None: ``default_bwd_chunk`` of a pass, as the attention backward); ``rows``,
    ``num_warps``: the tiling (``indexer_kl_gpu``)."""
    bsz, t, h, _ = q.shape
    g, di = k.shape[2], qi.shape[-1]
    prep = layout.prepare(k, ki[:, :, None, :], q_positions, kv_positions, q_seg, kv_seg, blk)
    ids = layout.dedupe_ids(block_ids)
    starts = layout.window_starts(ids, prep.base, blk, prep.s_pad)
    qpos = q_positions.astype(jnp.int32)
    rows = max(rows, layout.next_pow2(h // g))
    qc = query_chunk or _query_chunk(bsz, h, g, di, ids.shape[-1], blk, chunk or 128)   # sized for the most pieces
    if chunk is None:
        chunk = default_bwd_chunk(bsz * min(t, qc) * ids.shape[-1] * g)
    run = functools.partial(_chunk, kp=prep.k, kip=prep.v, kvpos=prep.kv_pos, kvseg=prep.kv_seg,
                            blk=blk, chunk=chunk, rows=rows, grads=grads, interpret=interpret, num_warps=num_warps)
    dki = jnp.zeros((bsz, prep.s_pad, g, di), jnp.float32)
    if t <= qc:
        kl, count, dqi, dki = run(q, qi, ids, starts, qpos, prep.q_seg, jnp.ones((t,), bool), dki, teacher_lse,
                                  q_weights)
    else:
        # One compiled loop over query chunks; the last one is clamped to end at T and its tokens
        # already done get no slot (nothing counted twice) and keep their d qi.
        n_c = -(-t // qc)
        dsl = jax.lax.dynamic_slice_in_dim

        def body(c, carry):
            kl, count, dqi, dki = carry
            a = jnp.minimum(c * qc, t - qc)
            fresh = (a + jnp.arange(qc)) >= c * qc
            ids_c = jnp.where(fresh[None, None, :, None], dsl(ids, a, qc, 2), -1)
            sl = lambda x, ax=1: dsl(x, a, qc, ax)
            kl_c, cnt_c, dqi_c, dki = run(sl(q), sl(qi), ids_c, sl(starts, 2), sl(qpos),
                                          sl(prep.q_seg), fresh, dki, None if teacher_lse is None else sl(teacher_lse),
                                          None if q_weights is None else sl(q_weights))
            if grads:
                dqi_c = jnp.where(fresh[None, :, None, None], dqi_c, sl(dqi))
                dqi = jax.lax.dynamic_update_slice_in_dim(dqi, dqi_c, a, 1)
            return kl + kl_c, count + cnt_c, dqi, dki

        dqi0 = jnp.zeros(qi.shape, jnp.float32) if grads else None
        count0 = jnp.int32(0) if q_weights is None else jnp.float32(0.0)
        kl, count, dqi, dki = jax.lax.fori_loop(0, n_c, body, (jnp.float32(0.0), count0, dqi0, dki))
    if not grads:
        return kl, count, None, None
    return kl, count, dqi, jnp.sum(dki[:, :ki.shape[1]], axis=2)


def _f0(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(11, 12, 13))
def _kl(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, teacher_lse, q_weights, blk, interpret,
        tiling):
    kl, count, _, _ = _run(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, blk,
                           interpret, grads=False, teacher_lse=teacher_lse, q_weights=q_weights, **dict(tiling))
    return kl, count


def _kl_fwd(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg, teacher_lse, q_weights, blk,
            interpret, tiling):
    kl, count, dqi, dki = _run(q, k, qi, ki, block_ids, q_positions, kv_positions, q_seg, kv_seg,
                               blk, interpret, grads=True, teacher_lse=teacher_lse, q_weights=q_weights,
                               **dict(tiling))
    dtypes = (jnp.zeros((0,), qi.dtype), jnp.zeros((0,), ki.dtype))     # the cotangents' dtypes
    res = (q, k, block_ids, q_positions, kv_positions, q_seg, kv_seg, teacher_lse, q_weights, dqi, dki, dtypes)
    return (kl, count), res


def _kl_bwd(blk, interpret, tiling, res, cot):
    q, k, block_ids, q_positions, kv_positions, q_seg, kv_seg, teacher_lse, q_weights, dqi, dki, dts = res
    qi_dt, ki_dt = dts
    ct = cot[0].astype(jnp.float32)
    zeros = lambda x: None if x is None else jnp.zeros_like(x)              # noqa: E731  (no gradient)
    return (jnp.zeros_like(q), jnp.zeros_like(k), (dqi * ct).astype(qi_dt.dtype),
            (dki * ct).astype(ki_dt.dtype),
            _f0(block_ids), _f0(q_positions), _f0(kv_positions), _f0(q_seg), _f0(kv_seg),
            zeros(teacher_lse), zeros(q_weights))


_kl.defvjp(_kl_fwd, _kl_bwd)


def indexer_kl_gpu(q, k, qi, ki, block_ids, *, q_positions, kv_positions, q_segment_ids=None,
                   kv_segment_ids=None, block_size=None, teacher_lse=None, q_weights=None, interpret=False,
                   chunk=None, rows=32, num_warps=8):
    """Indexer KL(teacher || student) on the selected support, Pallas/Triton GPU kernels.

    Args:
      q [B,T,H,D], k [B,S,G,D]: main branch (no gradient reaches them; D a power of two >= 16).
      qi [B,T,G,Di], ki [B,S,Di]: index branch (gradients flow here; Di a power of two >= 16).
      block_ids int [B,G,T,K] (-1 = empty); positions / segment ids (layout.py conventions);
      block_size B (power of two >= 16); interpret: Pallas interpret mode (CPU tests).
      teacher_lse: None, or float32 [B,T,H] natural-log LSE of every head's scaled logits over the
        same support (``msa_attention``'s second output for these block ids; no gradient): pass 1
        then computes only the student's LSE (no main-branch logits: ~H/G times less work).
      q_weights: None, or float [B,T]: query i's rows count ``q_weights[b, i]`` times in the sum, the
        count and the gradients (no gradient; prefix-tree rows, minimax_jax.data.prefix_tree).
      chunk: sorted selections per program (a power of two >= 16; None: ``default_bwd_chunk`` per pass).
      rows: tokens per tile of the KL pass (and of the student-LSE pass; (token, head) rows when pass 1 computes
        the teacher's LSE too): a power of two >= 32, raised to H/G's; num_warps: Triton warps
        (the defaults measured fastest at M3 128K: BENCHMARKS.md, MSA indexer KL probe).
    Returns: (kl_sum f32 [], count int32 [], or float32 with q_weights) as minimax_jax.ops.msa.indexer_kl.
    Raises: ValueError for block_ids=None (the dense warm-up: ``gpu_kl_dense.indexer_kl_dense_gpu``) and for
      rows / num_warps outside the ranges above. Other preconditions (tile sizes, head counts) are asserted; the
      ops layer checks them for its callers.
    """
    if block_ids is None:
        raise ValueError("indexer_kl_gpu covers the sparse support only; the dense warm-up "
                         "(block_ids=None) is gpu_kl_dense.indexer_kl_dense_gpu")
    for name, x in (("block_size", block_size), ("head dim", q.shape[-1]), ("index dim", qi.shape[-1])):
        assert x is not None and x >= 16 and not x & (x - 1), f"{name} must be a power of two >= 16, got {x}"
    assert qi.shape[2] == k.shape[2], f"index heads {qi.shape[2]} must equal kv heads {k.shape[2]}"
    if teacher_lse is not None:
        assert teacher_lse.shape == q.shape[:3], f"teacher_lse must be [B,T,H] = {q.shape[:3]}, got {teacher_lse.shape}"
        teacher_lse = jax.lax.stop_gradient(teacher_lse)
    if q_weights is not None:
        assert q_weights.shape == q.shape[:2], f"q_weights must be [B,T] = {q.shape[:2]}, got {q_weights.shape}"
        q_weights = jax.lax.stop_gradient(q_weights.astype(jnp.float32))
    is_int = lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)
    if not (is_int(rows) and is_int(num_warps)) \
            or rows < 32 or rows & (rows - 1) or num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"indexer_kl_gpu: rows={rows!r} (a power of two >= 32), num_warps={num_warps!r} (1-16, a "
                         "power of two)")
    tiling = (("chunk", chunk), ("rows", rows), ("num_warps", num_warps))
    return _kl(q, k, qi, ki, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, teacher_lse,
               q_weights, block_size, interpret, tiling)
