"""MSA sparse attention forward on GPU, KV-outer: each selected K/V block is loaded once for all the
queries that chose it (Pallas, Triton lowering).

Math: MSA_SPEC.md section 3 (see gpu_attention.py for the contract). Schedule (the inversion of the
per-query selections into per-KV-block work used by the official MSA kernels, written here for
Triton-class GPUs):

1. Work list (XLA): every valid (token, slot) selection of a kv group is keyed by the storage start of
   its block window (layout.py: queries of one segment that chose block n share it) and the keys are
   sorted (stable: a fixed order, bitwise-repeatable results). ``run_end[e]`` is the first entry after
   e with another key.
2. Kernel: program (i, g, b) takes the fixed-size slice [i*C, (i+1)*C) of group g's sorted list. For
   each run of equal keys inside it, it loads the K/V window once and walks the run in row tiles of
   ``per`` entries x H/G heads (<= 128 rows: e.g. 8 tokens x 16 heads at M3, 21 x 6 at M2); q rows are
   gathered, the block's softmax is computed exactly (it is one block), and the normalised partial
   output (q.dtype) and its LSE (f32) are written to the (token, slot) they belong to. The tiles
   of a run up to its last selection that does not see the whole window (``needs_mask`` /
   ``mask_ends``, in XLA) take the masked body, the rest a mask-free one (``tile_loops``).
3. Combine (XLA): per (token, head), the K partials are merged by their LSE (fp32 weights).
Queries are processed in chunks of ``query_chunk`` tokens (one compiled loop writing the outputs in
place), so the partial buffers, [B, Tc, K, H, Dv] + [B, Tc, K, H] f32, stay bounded at any length.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.msa import layout

__all__ = ["sparse_fwd_kv_outer", "worklist", "check_launch", "default_query_chunk", "PARTIALS_BUDGET",
           "Window", "tile_rows", "mask_logits", "needs_mask", "mask_ends", "masked_tiles",
           "tile_loops", "schedule"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_NO_KEY = jnp.iinfo(jnp.int32).max
PARTIALS_BUDGET = 4 << 30     # bytes of partial outputs per query chunk (default_query_chunk)


def _dot(a, b, trans_b=False):
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def check_launch(*, chunk=None, query_chunk=None, dq_partial_bits=None, chunk_multiple=1):
    """Raise ValueError (one line) unless ``chunk`` (sorted selections per program) is None or a positive
    multiple of ``chunk_multiple``, ``query_chunk`` None or a positive int, ``dq_partial_bits`` None, 16 or 32."""
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)
    if chunk is not None and not (is_int(chunk) and chunk > 0 and chunk % chunk_multiple == 0):
        raise ValueError(f"chunk must be a positive multiple of {chunk_multiple}, got {chunk!r}")
    if query_chunk is not None and not (is_int(query_chunk) and query_chunk > 0):
        raise ValueError(f"query_chunk must be a positive int, got {query_chunk!r}")
    if dq_partial_bits is not None and not (is_int(dq_partial_bits) and dq_partial_bits in (16, 32)):
        raise ValueError(f"dq_partial_bits must be 16 or 32, got {dq_partial_bits!r}")


def worklist(ids, starts):
    """Selections sorted by block window, per (batch row, group).

    Args: ids [B,G,T,K] int32 (deduplicated, -1 unused), starts [B,G,T,K] int32 (window starts).
    Returns (flat [B,G,T*K] int32: t*K + slot in sorted order, key [B,G,T*K] int32: the window start
    (int32 max for unused), run_end [B,G,T*K] int32, n_valid [B,G] int32).
    """
    bsz, g, t, k = ids.shape
    n = t * k
    key = jnp.where(ids >= 0, starts, _NO_KEY).reshape(bsz, g, n)
    flat = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), key.shape)
    key, flat = jax.lax.sort((key, flat), dimension=2, num_keys=1, is_stable=True)
    idx = jnp.arange(1, n + 1, dtype=jnp.int32)
    change = jnp.concatenate([key[..., 1:] != key[..., :-1],
                              jnp.ones(key.shape[:2] + (1,), bool)], axis=-1)
    run_end = jax.lax.cummin(jnp.where(change, idx, n), axis=2, reverse=True)
    n_valid = jnp.sum(ids >= 0, axis=(2, 3), dtype=jnp.int32)
    return flat, key, run_end, n_valid


class Window:
    """The K/V window of one run (storage start w0, group g): the tiles and what the mask needs."""

    def __init__(self, k_ref, v_ref, kvpos_ref, kvseg_ref, b, g, w0, blk):
        sl = pl.ds(w0, blk)
        self.k = None if k_ref is None else k_ref[b, sl, g, :]      # [B, D]
        self.v = None if v_ref is None else v_ref[b, sl, g, :]
        self.kvp = kvpos_ref[b, sl]
        self.kvs = kvseg_ref[b, sl]
        self.blk = blk


def tile_rows(flat_ref, ids_ref, qpos_ref, qseg_ref, b, g, e, ok, topk, a):
    """The selections of a row tile: rows e (sorted entries; rows not ``ok`` read entry a)."""
    flat = flat_ref[b, g, jnp.where(ok, e, a)]
    t = flat // topk
    slot = flat - t * topk
    return t, slot, ids_ref[b, g, t, slot], qpos_ref[b, t], qseg_ref[b, t]


def mask_logits(s, win, ok, n, qp, qs, *, masked):
    """-inf where row r (block n, query position qp, segment qs) does not see a window key.

    A row sees keys with kvp in [n*B, min(n*B + B - 1, qp)] and kvs == qs (a query of segment < 0
    sees nothing; a row not ``ok`` sees nothing). ``masked=False`` (a tile after the run's masked
    tiles, ``tile_loops``: every ``ok`` row sees the whole window, one segment >= 0) only blanks
    the rows not ``ok``; its [R, B] predicate (ok & kvs >= 0, true on those rows) keeps the
    compiled softmax the same as the masked body's, so a row's result does not depend on which
    body its tile takes (bitwise: query chunks give the results of one pass).
    """
    if not masked:
        return jnp.where(ok[:, None] & (win.kvs[None, :] >= 0), s, -jnp.inf)
    lo_r = n * win.blk
    hi_r = jnp.where(ok & (qs >= 0), jnp.minimum(lo_r + win.blk - 1, qp), -1)
    vis = ((win.kvp[None, :] >= lo_r[:, None]) & (win.kvp[None, :] <= hi_r[:, None])
           & (win.kvs[None, :] == qs[:, None]))
    return jnp.where(vis, s, -jnp.inf)


def needs_mask(ids, starts, qpos, qseg, kvpos, kvseg, blk):
    """Per selection: False iff its query sees every key of its window. bool [B,G,T,K].

    Exact under the storage-layout contract (layout.py: a segment's keys are one run, positions
    +1): the window [w0, w0+B) is wholly segment s >= 0 iff kv_seg[w0] == kv_seg[w0+B-1] == s,
    its positions are then kv_pos[w0] + [0, B), and the query (block n, position qp, segment qs)
    sees them all iff qs == s, kv_pos[w0] == n*B and kv_pos[w0] + B - 1 <= qp. Unused slots
    (id < 0) are True. O(B*G*T*K) gathers.
    """
    bsz = ids.shape[0]
    at = lambda x, idx: jnp.take_along_axis(x, idx.reshape(bsz, -1), axis=1).reshape(idx.shape)
    seg0, seg1, p0 = at(kvseg, starts), at(kvseg, starts + blk - 1), at(kvpos, starts)
    qs, qp = qseg[:, None, :, None], qpos[:, None, :, None]
    full = ((ids >= 0) & (seg0 == seg1) & (seg0 >= 0) & (qs == seg0) & (p0 == ids * blk)
            & (p0 + blk - 1 <= qp))
    return jnp.logical_not(full)


def mask_ends(needs, flat):
    """Per sorted entry e: one past the last entry <= e that needs a mask (0: none), so a run
    piece [a, end) needs masks up to ``mask_ends[end - 1]`` (none when that is <= a).
    needs [B,G,T,K] bool (``needs_mask``), flat from ``worklist``; int32 [B,G,T*K]."""
    bsz, g = flat.shape[:2]
    nm = jnp.take_along_axis(needs.reshape(bsz, g, -1), flat, axis=2)          # sorted order
    idx = jnp.arange(1, flat.shape[-1] + 1, dtype=jnp.int32)
    return jax.lax.cummax(jnp.where(nm, idx, 0), axis=2)


def masked_tiles(mend, a, end, per):
    """(masked, all) row tiles of the run piece [a, end) (``per`` entries each): the masked ones
    reach its last entry that needs a mask (``mend``: ``mask_ends`` at end - 1)."""
    n_tiles = (end - a + per - 1) // per
    return jnp.minimum((jnp.maximum(mend - a, 0) + per - 1) // per, n_tiles), n_tiles


def tile_loops(tile, mend_ref, b, g, a, end, per, init):
    """Walk the row tiles of the run piece [a, end) in order: ``tile(si, carry, masked=True)`` on
    the leading tiles up to its last entry that needs a mask (``mend_ref``: ``mask_ends``), then
    ``masked=False`` on the rest (no key mask, no per-tile reduction or branch)."""
    n_mask, n_tiles = masked_tiles(mend_ref[b, g, end - 1], a, end, per)
    carry = jax.lax.fori_loop(0, n_mask, functools.partial(tile, masked=True), init)
    return jax.lax.fori_loop(n_mask, n_tiles, functools.partial(tile, masked=False), carry)


def schedule(ids, starts, qpos, qseg, kvpos, kvseg, *, h, rows, chunk, blk):
    """(H/G, tokens per row tile, programs per group, ``worklist`` arrays + ``mask_ends``)."""
    g, t, topk = ids.shape[1:]
    hg = h // g
    assert hg <= rows, f"{hg} heads per group > {rows} rows per tile"
    flat, key, run_end, n_valid = worklist(ids, starts)
    mend = mask_ends(needs_mask(ids, starts, qpos, qseg, kvpos, kvseg, blk), flat)
    return hg, max(1, rows // hg), -(-t * topk // chunk), (flat, key, run_end, n_valid, mend)


def _kernel(flat_ref, key_ref, rend_ref, nval_ref, mend_ref, q_ref, k_ref, v_ref, ids_ref, qpos_ref,
            qseg_ref, kvpos_ref, kvseg_ref, op_ref, lp_ref, *, blk, topk, scale, hg, per, chunk, rows):
    i = pl.program_id(0)
    g = pl.program_id(1)
    b = pl.program_id(2)
    lo = i * chunk
    hi = jnp.minimum(lo + chunk, nval_ref[b, g])
    r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    j = r // hg
    head = g * hg + (r - j * hg)
    row_in = j < per
    qk_scale = scale * _LOG2E

    def run(a):
        end = jnp.minimum(rend_ref[b, g, a], hi)
        win = Window(k_ref, v_ref, kvpos_ref, kvseg_ref, b, g, key_ref[b, g, a], blk)

        def tile(si, carry, masked):
            e = a + si * per + j
            ok = row_in & (e < end)
            t, slot, n, qp, qs = tile_rows(flat_ref, ids_ref, qpos_ref, qseg_ref, b, g, e, ok, topk, a)
            q = q_ref[b, t, head, :]                         # [R, D] gathered rows
            s = _dot(q, win.k, trans_b=True) * qk_scale       # [R, B] log2 domain
            s = mask_logits(s, win, ok, n, qp, qs, masked=masked)
            m = jnp.max(s, axis=1)
            m_safe = jnp.where(m == -jnp.inf, 0.0, m)
            p = jnp.exp2(s - m_safe[:, None])
            l = jnp.sum(p, axis=1)
            l_safe = jnp.where(l == 0.0, 1.0, l)
            o = _dot(p.astype(win.v.dtype), win.v) * (1.0 / l_safe)[:, None]
            lse = jnp.where(l == 0.0, -jnp.inf, (m_safe + jnp.log2(l_safe)) * _LN2)
            # Masked rows point at the spare token row (index T of the partial buffers): interpret
            # mode discharges a masked store as a scatter, where a masked row aliasing a valid one
            # could write back the old value. All-integer indexers: interpret mode stores no mixed
            # slice + gather indexers.
            t_st = jnp.where(ok, t, op_ref.shape[1] - 1)[:, None]
            dcol = jax.lax.broadcasted_iota(jnp.int32, (1, o.shape[1]), 1)
            pltriton.store(op_ref.at[b, t_st, slot[:, None], head[:, None], dcol],
                           o.astype(op_ref.dtype), mask=ok[:, None])
            pltriton.store(lp_ref.at[b, t_st[:, 0], slot, head], lse, mask=ok)
            return carry

        tile_loops(tile, mend_ref, b, g, a, end, per, 0)
        return end

    jax.lax.while_loop(lambda a: a < hi, run, lo)


def _combine(op, lp, ids, hg):
    """Merge the K partials of every (token, head) by LSE: (o [B,T,H,Dv] op.dtype, lse [B,T,H] f32)."""
    valid = jnp.repeat(jnp.transpose(ids >= 0, (0, 2, 3, 1)), hg, axis=-1)   # [B,T,K,H]
    lp = jnp.where(valid, lp, -jnp.inf)
    m = jnp.max(lp, axis=2)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lp - m_safe[:, :, None, :])                                   # 0 where unused
    total = jnp.sum(w, axis=2)
    t_safe = jnp.where(total == 0.0, 1.0, total)
    o = jnp.sum(layout.keep(op, valid[..., None]).astype(jnp.float32) * w[..., None], axis=2)
    o = (o / t_safe[..., None]).astype(op.dtype)
    lse = jnp.where(total == 0.0, -jnp.inf, m_safe + jnp.log(t_safe))
    return o, lse


def default_query_chunk(bsz, h, dv, topk, itemsize, budget_bytes=PARTIALS_BUDGET):
    """Query tokens per chunk so that the partial outputs fit ``budget_bytes`` (a power of two)."""
    per_token = bsz * topk * h * (dv * itemsize + 4)
    c = max(1, budget_bytes // per_token)
    return 1 << (c.bit_length() - 1)


def _partials(q, prep_k, prep_v, ids, starts, qpos, qseg, kvpos, kvseg, *, blk, chunk, rows,
              interpret, num_warps, num_stages):
    """The kernel's per-(token, slot) partials: (o [B,T,K,H,Dv] q.dtype, lse [B,T,K,H] f32)."""
    bsz, t, h, d = q.shape
    g = prep_k.shape[2]
    dv = prep_v.shape[-1]
    topk = ids.shape[-1]
    hg, per, n_items, lists = schedule(ids, starts, qpos, qseg, kvpos, kvseg, h=h, rows=rows,
                                       chunk=chunk, blk=blk)
    kernel = functools.partial(_kernel, blk=blk, topk=topk, scale=1.0 / math.sqrt(d), hg=hg,
                               per=per, chunk=chunk, rows=rows)
    op, lp = pl.pallas_call(
        kernel,
        grid=(n_items, g, bsz),
        out_shape=[jax.ShapeDtypeStruct((bsz, t + 1, topk, h, dv), q.dtype),   # + spare row
                   jax.ShapeDtypeStruct((bsz, t + 1, topk, h), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="msa_fwd_gpu",
    )(*lists, q, prep_k, prep_v, ids, qpos, qseg, kvpos, kvseg)
    return op[:, :t], lp[:, :t]


def _chunk_fwd(q, prep_k, prep_v, ids, starts, qpos, qseg, kvpos, kvseg, **kw):
    op, lp = _partials(q, prep_k, prep_v, ids, starts, qpos, qseg, kvpos, kvseg, **kw)
    return _combine(op, lp, ids, q.shape[2] // prep_k.shape[2])


def sparse_fwd_kv_outer(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                        kv_segment_ids, *, block_size, interpret=False, num_warps=4, num_stages=2,
                        chunk=128, rows=None, query_chunk=None):
    """KV-outer MSA forward: (o [B,T,H,Dv] q.dtype, lse [B,T,H] f32 natural log, -inf: no key).

    Arguments as ``gpu_attention.msa_attention_gpu`` (block_ids [B,G,T,K], any order, duplicates
    count once, -1 unused). ``chunk``: sorted selections per program; ``rows``: (token, head) rows
    per tile (a power of two >= H/G; None: max(64, next_pow2(H/G))); ``query_chunk``: query tokens per pass (None:
    ``default_query_chunk``). A bad chunk / query_chunk raises ValueError (``check_launch``); shape
    preconditions are asserted.
    """
    check_launch(chunk=chunk, query_chunk=query_chunk)
    layout.check_shapes(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    bsz, t, h, _ = q.shape
    topk = block_ids.shape[-1]
    prep = layout.prepare(k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_size)
    ids = layout.dedupe_ids(block_ids)
    starts = layout.window_starts(ids, prep.base, block_size, prep.s_pad)
    qpos = q_positions.astype(jnp.int32)
    qseg = prep.q_seg
    if rows is None:
        rows = max(64, layout.next_pow2(h // k.shape[2]))
    if query_chunk is None:
        query_chunk = default_query_chunk(bsz, h, v.shape[-1], topk, q.dtype.itemsize)
    run = functools.partial(_chunk_fwd, prep_k=prep.k, prep_v=prep.v, kvpos=prep.kv_pos,
                            kvseg=prep.kv_seg, blk=block_size, chunk=chunk, rows=rows, interpret=interpret,
                            num_warps=num_warps, num_stages=num_stages)
    if t <= query_chunk:
        return run(q, ids=ids, starts=starts, qpos=qpos, qseg=qseg)
    # One compiled loop over query chunks, writing into the outputs in place. The last chunk is
    # clamped to end at T (it recomputes a few tokens: a row's result does not depend on the other
    # rows of its tile, so the rewrite is identical).
    n_c = -(-t // query_chunk)
    dsl = jax.lax.dynamic_slice_in_dim

    def body(c, carry):
        o, lse = carry
        a = jnp.minimum(c * query_chunk, t - query_chunk)
        oc, lc = run(dsl(q, a, query_chunk, 1), ids=dsl(ids, a, query_chunk, 2),
                     starts=dsl(starts, a, query_chunk, 2), qpos=dsl(qpos, a, query_chunk, 1),
                     qseg=dsl(qseg, a, query_chunk, 1))
        return (jax.lax.dynamic_update_slice_in_dim(o, oc, a, 1),
                jax.lax.dynamic_update_slice_in_dim(lse, lc, a, 1))

    init = (jnp.zeros((bsz, t, h, v.shape[-1]), q.dtype), jnp.zeros((bsz, t, h), jnp.float32))
    return jax.lax.fori_loop(0, n_c, body, init)
