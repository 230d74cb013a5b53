"""Causal GQA self-attention over prefix-tree rows on GPU, forward and backward (Pallas, Triton lowering).

Problem: prefix-tree rows (``minimax_jax.data.prefix_tree``) lay shared prefixes out once; key slot
``j`` is visible to query slot ``i`` only when ``j <= i < subtree_end[j]`` (j is i or an ancestor of
i), besides the usual rule (same segment, segment >= 0, ``kv_pos <= q_pos``). Neither cuDNN nor the
library flash kernels take such a mask, and the XLA reference computes every (query, key) pair.
Here every program walks only the key tiles that can hold a visible key, so a query costs what its
own trajectory costs, as in the unmerged batch.

Math: FlashAttention-2 (Dao, 2023). Scale ``1/sqrt(D)``; online softmax in the exp2 domain with
float32 statistics and accumulators; probabilities (and ``ds``) cast to the value dtype before
their matmuls; output in ``q.dtype``. Backward: with ``p = exp(scale * q.k - lse)`` and
``delta = rowsum(o * do)``: ``dv = p^T do``, ``ds = p * (do.v - delta)``, ``dk = scale * ds^T q``,
``dq = scale * ds k``. A query with no visible key returns zeros (and gets zero gradients).

Schedule: as ``pallas_kernels.prefill.gpu_attention``, the rows of a program are (token, head) pairs
of one kv group, token-major (``rows`` per query tile), and keys come in tiles of ``block_k`` slots.
``tile_lists`` (XLA, O(query tiles x key tiles) integers) marks key tile ``c`` as reachable from
query tile ``r`` when its first slot is at most the tile's last token and the largest
``subtree_end`` in it exceeds the tile's first token (conservative: the per-element mask is exact),
and as FULL when every (row, key) pair of the two tiles is visible (a shared prefix's tiles seen from
its descendants); the forward and ``dq`` programs walk their query tile's full tiles without a mask,
then the partial ones masked, the ``dk`` / ``dv`` programs the transposed lists. On a DFS layout a query
tile reaches its own trajectory's tiles plus the neighbourhood of its branch, not the sibling subtrees.

``masked_attention_gpu``: the same kernels without a tree, for queries that are any subset of the keys
(T != S allowed; e.g. a context-parallel shard's queries against the gathered keys): visibility is
segments and positions only, and ``position_tile_lists`` marks key tile ``c`` reachable from query tile
``r`` when their segment ranges overlap and the tile's smallest key position is at most the query tile's
largest position (FULL: one segment >= 0 on both sides and every key position <= the smallest query
position), so a causal layout walks about half the tiles whatever the storage order of the queries.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import gqa_triton_reason

__all__ = ["tree_attention_gpu", "masked_attention_gpu", "tile_lists", "position_tile_lists", "unsupported_reason",
           "default_config"]
_LOG2E = math.log2(math.e)


def _dot(a, b, trans_b=False):
    """2-D matmul with fp32 accumulation; lowers to a Triton tensor-core dot (tl.dot)."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _pow2(x: int) -> bool:
    return x >= 16 and not (x & (x - 1))


def unsupported_reason(q, k, v, self_attention: bool = True) -> str | None:
    """None when ``tree_attention_gpu`` (``self_attention``) or ``masked_attention_gpu`` serves these shapes /
    dtypes, else why not (one line).

    Args: q ``[B, T, H, D]``, k / v ``[B, S, G, D]`` (arrays or ShapeDtypeStructs; S == T for the tree).
    """
    if self_attention and k.ndim == 4 and q.ndim == 4 and k.shape[1] != q.shape[1]:
        return f"self-attention only: q {q.shape} and k {k.shape} must have the same T"
    return gqa_triton_reason(q, k, v)


def tile_lists(subtree_end, kv_seg, kv_pos, row_seg, row_pos, num_tokens: int, rep: int, rows: int, block_k: int):
    """Reachable key tiles per query tile, split into full and partial ones, and the transposes.

    Args:
      subtree_end, kv_seg, kv_pos: ``[B, Tp]`` int32 keys (``Tp`` a multiple of ``block_k``; padding keys
        end 0, segment -1).
      row_seg, row_pos: ``[B, Rp]`` int32 of the query rows (token x head, token-major; padding rows
        segment and position -1; ``Rp`` a multiple of ``rows``); num_tokens: T; rep: query heads per kv
        group; rows: query rows per tile.
    Returns: ``(fwd, bwd)``, each ``(full_ids, full_cnt, part_ids, part_cnt)`` int32: per query tile
      (fwd, ``[B, NQ, NK]`` / ``[B, NQ]``) or per key tile (bwd, ``[B, NK, NQ]`` / ``[B, NK]``) the first
      ``cnt`` entries of ``ids`` are its tiles, ascending. A reachable pair is FULL when every (row, key)
      of it is visible (no mask needed: keys before the tile's first token, every subtree covering its
      last token, one segment >= 0 on both sides (so no padding row), key positions <= the smallest
      query position), else PARTIAL (masked per element).
    """
    b, tp = subtree_end.shape
    t = num_tokens
    nk, nq = tp // block_k, row_seg.shape[1] // rows
    r0 = jnp.arange(nq, dtype=jnp.int32) * rows
    tok_lo = r0 // rep
    tok_hi = jnp.minimum((r0 + rows - 1) // rep, t - 1)

    def per_key_tile(x, red):
        return red(x.reshape(b, nk, block_k), axis=-1)[:, None, :]                      # [B, 1, NK]

    def per_query_tile(x, red):
        return red(x.reshape(b, nq, rows), axis=-1)[:, :, None]                         # [B, NQ, 1]

    j0 = jnp.arange(nk, dtype=jnp.int32) * block_k
    reach = (j0[None, None, :] <= tok_hi[None, :, None]) & (per_key_tile(subtree_end, jnp.max) > tok_lo[None, :, None])
    kseg_lo, kseg_hi = per_key_tile(kv_seg, jnp.min), per_key_tile(kv_seg, jnp.max)
    qseg_lo, qseg_hi = per_query_tile(row_seg, jnp.min), per_query_tile(row_seg, jnp.max)
    full = (reach & (j0[None, None, :] + block_k - 1 <= tok_lo[None, :, None])
            & (per_key_tile(subtree_end, jnp.min) > tok_hi[None, :, None])
            & (kseg_lo == kseg_hi) & (qseg_lo == qseg_hi) & (kseg_lo == qseg_lo) & (kseg_lo >= 0)
            & (per_key_tile(kv_pos, jnp.max) <= per_query_tile(row_pos, jnp.min)))

    return _compact_lists(reach, full)


def position_tile_lists(kv_seg, kv_pos, row_seg, row_pos, rows: int, block_k: int):
    """``tile_lists`` without a tree (``masked_attention_gpu``): reachability from segments and positions.

    Args: kv_seg, kv_pos ``[B, Sp]`` int32 (``Sp`` a multiple of ``block_k``; padding keys segment -1);
      row_seg, row_pos ``[B, Rp]`` int32 query rows (padding rows segment and position -1).
    Returns: as ``tile_lists``. Key tile ``c`` is reachable from query tile ``r`` when some valid key and
      some valid row may share a segment (their segment ranges overlap) and the smallest valid key position
      is <= the largest row position (necessary for any visible pair); FULL when both tiles hold one
      segment >= 0 and every key position <= the smallest row position.
    """
    b, sp = kv_seg.shape
    nk, nq = sp // block_k, row_seg.shape[1] // rows
    big = jnp.int32(2 ** 30)
    kv_ok, row_ok = kv_seg >= 0, row_seg >= 0

    def tiles(x, n, size, red, ok, fill):
        return red(jnp.where(ok, x, fill).reshape(b, n, size), axis=-1)

    kseg_lo, kseg_hi = (tiles(kv_seg, nk, block_k, jnp.min, kv_ok, big)[:, None, :],
                        tiles(kv_seg, nk, block_k, jnp.max, kv_ok, -1)[:, None, :])
    kpos_lo, kpos_hi = (tiles(kv_pos, nk, block_k, jnp.min, kv_ok, big)[:, None, :],
                        tiles(kv_pos, nk, block_k, jnp.max, kv_ok, big)[:, None, :])
    qseg_lo, qseg_hi = (tiles(row_seg, nq, rows, jnp.min, row_ok, big)[:, :, None],
                        tiles(row_seg, nq, rows, jnp.max, row_ok, -1)[:, :, None])
    qpos_lo, qpos_hi = (tiles(row_pos, nq, rows, jnp.min, row_ok, -1)[:, :, None],
                        tiles(row_pos, nq, rows, jnp.max, row_ok, -1)[:, :, None])
    reach = (kseg_lo <= qseg_hi) & (qseg_lo <= kseg_hi) & (kpos_lo <= qpos_hi)
    every_row = jnp.all(row_ok.reshape(b, nq, rows), axis=-1)[:, :, None]
    every_key = jnp.all(kv_ok.reshape(b, nk, block_k), axis=-1)[:, None, :]
    full = (reach & every_row & every_key & (kseg_lo == kseg_hi) & (qseg_lo == qseg_hi) & (kseg_lo == qseg_lo)
            & (kpos_hi <= qpos_lo))
    return _compact_lists(reach, full)


def _compact_lists(reach, full):
    """(fwd, bwd) id / count lists of ``tile_lists`` from ``[B, NQ, NK]`` reach / full masks."""
    def compact(m):   # [..., N] bool -> ascending indices of the True entries first, and their count
        idx = jnp.argsort(jnp.logical_not(m), axis=-1, stable=True).astype(jnp.int32)
        return idx, jnp.sum(m, axis=-1, dtype=jnp.int32)

    part = reach & jnp.logical_not(full)
    fwd = (*compact(full), *compact(part))
    bwd = (*compact(jnp.swapaxes(full, 1, 2)), *compact(jnp.swapaxes(part, 1, 2)))
    return fwd, bwd


def _visible(qi, qs, qp, kt, ke, ks, kp, block_k, transposed=False):
    """Mask ``[R, block_k]`` (``[block_k, R]`` transposed) of query rows (slot qi, segment qs, position
    qp) against key tile ``kt`` (subtree ends ke, segments ks, positions kp)."""
    kj = kt * block_k + jnp.arange(block_k, dtype=jnp.int32)
    if transposed:
        qi, qs, qp = qi[None, :], qs[None, :], qp[None, :]
        kj, ke, ks, kp = kj[:, None], ke[:, None], ks[:, None], kp[:, None]
    else:
        qi, qs, qp = qi[:, None], qs[:, None], qp[:, None]
        kj, ke, ks, kp = kj[None, :], ke[None, :], ks[None, :], kp[None, :]
    return (kj <= qi) & (qi < ke) & (ks == qs) & (ks >= 0) & (kp <= qp)


def _fwd_kernel(fids_ref, fcnt_ref, pids_ref, pcnt_ref, q_ref, k_ref, v_ref, qi_ref, qs_ref, qp_ref, ke_ref,
                ks_ref, kp_ref, o_ref, lse_ref, *, rows, block_k, scale):
    qt, g, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rs = pl.ds(qt * rows, rows)
    q = q_ref[b, g, rs, :]
    qi, qs, qp = qi_ref[b, rs], qs_ref[b, rs], qp_ref[b, rs]
    qk_scale = scale * _LOG2E

    def step(n, carry, ids_ref, masked):
        acc, m_prev, l_prev = carry
        kt = ids_ref[b, qt, n]
        sl = pl.ds(kt * block_k, block_k)
        kb, vb = k_ref[b, sl, g, :], v_ref[b, sl, g, :]
        s = _dot(q, kb, trans_b=True) * qk_scale
        if masked:
            s = jnp.where(_visible(qi, qs, qp, kt, ke_ref[b, sl], ks_ref[b, sl], kp_ref[b, sl], block_k), s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        corr = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        acc = acc * corr[:, None] + _dot(p.astype(vb.dtype), vb)
        return acc, m_next, l_prev * corr + jnp.sum(p, axis=1)

    init = (jnp.zeros((rows, v_ref.shape[-1]), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    carry = jax.lax.fori_loop(0, fcnt_ref[b, qt], functools.partial(step, ids_ref=fids_ref, masked=False), init)
    acc, m, l_i = jax.lax.fori_loop(0, pcnt_ref[b, qt], functools.partial(step, ids_ref=pids_ref, masked=True), carry)
    ok = l_i > 0.0
    l_safe = jnp.where(ok, l_i, 1.0)
    o_ref[b, g, rs, :] = jnp.where(ok[:, None], acc / l_safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[b, g, rs] = jnp.where(ok, m + jnp.log2(l_safe), -jnp.inf)


def _dq_kernel(fids_ref, fcnt_ref, pids_ref, pcnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qi_ref,
               qs_ref, qp_ref, ke_ref, ks_ref, kp_ref, dq_ref, *, rows, block_k, scale):
    qt, g, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rs = pl.ds(qt * rows, rows)
    q, do = q_ref[b, g, rs, :], do_ref[b, g, rs, :]
    lse, delta = lse_ref[b, g, rs], delta_ref[b, g, rs]
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)          # rows with no key: every p is masked to 0
    qi, qs, qp = qi_ref[b, rs], qs_ref[b, rs], qp_ref[b, rs]
    qk_scale = scale * _LOG2E

    def step(n, dq, ids_ref, masked):
        kt = ids_ref[b, qt, n]
        sl = pl.ds(kt * block_k, block_k)
        kb, vb = k_ref[b, sl, g, :], v_ref[b, sl, g, :]
        p = jnp.exp2(_dot(q, kb, trans_b=True) * qk_scale - lse[:, None])
        if masked:
            p = jnp.where(_visible(qi, qs, qp, kt, ke_ref[b, sl], ks_ref[b, sl], kp_ref[b, sl], block_k), p, 0.0)
        ds = p * (_dot(do, vb, trans_b=True) - delta[:, None])
        return dq + _dot(ds.astype(kb.dtype), kb)

    dq = jax.lax.fori_loop(0, fcnt_ref[b, qt], functools.partial(step, ids_ref=fids_ref, masked=False),
                           jnp.zeros(q.shape, jnp.float32))
    dq = jax.lax.fori_loop(0, pcnt_ref[b, qt], functools.partial(step, ids_ref=pids_ref, masked=True), dq)
    dq_ref[b, g, rs, :] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(fids_ref, fcnt_ref, pids_ref, pcnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qi_ref,
                qs_ref, qp_ref, ke_ref, ks_ref, kp_ref, dk_ref, dv_ref, *, rows, block_k, scale):
    kt, g, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    sl = pl.ds(kt * block_k, block_k)
    kb, vb = k_ref[b, sl, g, :], v_ref[b, sl, g, :]
    ke, ks, kp = ke_ref[b, sl], ks_ref[b, sl], kp_ref[b, sl]
    qk_scale = scale * _LOG2E

    def step(n, carry, ids_ref, masked):
        dk, dv = carry
        qt = ids_ref[b, kt, n]
        rs = pl.ds(qt * rows, rows)
        q, do = q_ref[b, g, rs, :], do_ref[b, g, rs, :]
        lse, delta = lse_ref[b, g, rs], delta_ref[b, g, rs]
        lse = jnp.where(lse == -jnp.inf, 0.0, lse)
        pt = jnp.exp2(_dot(kb, q, trans_b=True) * qk_scale - lse[None, :])                 # [bk, R]
        if masked:
            vis = _visible(qi_ref[b, rs], qs_ref[b, rs], qp_ref[b, rs], kt, ke, ks, kp, block_k, transposed=True)
            pt = jnp.where(vis, pt, 0.0)
        dv = dv + _dot(pt.astype(do.dtype), do)
        dst = pt * (_dot(vb, do, trans_b=True) - delta[None, :])
        return dk + _dot(dst.astype(q.dtype), q), dv

    zeros = (jnp.zeros((block_k, kb.shape[-1]), jnp.float32), jnp.zeros((block_k, vb.shape[-1]), jnp.float32))
    carry = jax.lax.fori_loop(0, fcnt_ref[b, kt], functools.partial(step, ids_ref=fids_ref, masked=False), zeros)
    dk, dv = jax.lax.fori_loop(0, pcnt_ref[b, kt], functools.partial(step, ids_ref=pids_ref, masked=True), carry)
    dk_ref[b, sl, g, :] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[b, sl, g, :] = dv.astype(dv_ref.dtype)


def _call(kernel, grid, out_shape, cfg, name, *args):
    return pl.pallas_call(
        kernel, grid=grid, out_shape=out_shape, interpret=cfg["interpret"], name=name,
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
    )(*args)


def _rows_layout(x, g, rep, rp, fill=0):
    """``[B, T, H, D]`` -> ``[B, G, Rp, D]`` (rows token-major per group) and ``[B, T]`` -> ``[B, Rp]``."""
    if x.ndim == 2:
        y = jnp.repeat(x.astype(jnp.int32), rep, axis=1)
        return jnp.pad(y, ((0, 0), (0, rp - y.shape[1])), constant_values=fill)
    b, t, h, d = x.shape
    y = x.reshape(b, t, g, rep, d).transpose(0, 2, 1, 3, 4).reshape(b, g, t * rep, d)
    return jnp.pad(y, ((0, 0), (0, 0), (0, rp - t * rep), (0, 0)))


def _from_rows(y, t, h):
    b, g, _, d = y.shape
    return y[:, :, :t * (h // g)].reshape(b, g, t, h // g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


@functools.lru_cache(maxsize=None)
def _op(rows: int, block_k: int, num_warps: int, num_stages: int, interpret: bool, tree: bool = True):
    """The custom-VJP attention for one launch configuration; ``tree=False``: ``masked_attention_gpu`` (the
    slot terms of the mask made vacuous: every query at slot S, every key's subtree ending past it)."""
    cfg = dict(num_warps=num_warps, num_stages=num_stages, interpret=interpret)

    def prepare(q, k, q_pos, kv_pos, q_seg, kv_seg, subtree_end):
        b, t, h, d = q.shape
        s, g = k.shape[1], k.shape[2]
        rep = h // g
        rp = -(-t * rep // rows) * rows
        tp = -(-s // block_k) * block_k
        slot = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) if tree else jnp.int32(tp), (b, t))
        if not tree:
            subtree_end = jnp.full((b, s), tp + 1, jnp.int32)
        ints = (_rows_layout(slot, g, rep, rp, -1), _rows_layout(q_seg, g, rep, rp, -1),
                _rows_layout(q_pos, g, rep, rp, -1))
        kpad = ((0, 0), (0, tp - s))
        kints = (jnp.pad(subtree_end.astype(jnp.int32), kpad), jnp.pad(kv_seg.astype(jnp.int32), kpad,
                                                                          constant_values=-1),
                 jnp.pad(kv_pos.astype(jnp.int32), kpad))
        if tree:
            lists = tile_lists(*kints, ints[1], ints[2], t, rep, rows, block_k)
        else:
            lists = position_tile_lists(kints[1], kints[2], ints[1], ints[2], rows, block_k)
        return g, rep, rp, tp, ints, kints, lists

    def pad_kv(x, tp):
        return jnp.pad(x, ((0, 0), (0, tp - x.shape[1]), (0, 0), (0, 0)))

    def forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, subtree_end):
        b, t, h, d = q.shape
        g, rep, rp, tp, ints, kints, (fwd_lists, bwd_lists) = prepare(q, k, q_pos, kv_pos, q_seg, kv_seg,
                                                                      subtree_end)
        qg, kp_, vp_ = _rows_layout(q, g, rep, rp), pad_kv(k, tp), pad_kv(v, tp)
        kern = functools.partial(_fwd_kernel, rows=rows, block_k=block_k, scale=1.0 / math.sqrt(d))
        og, lse = _call(kern, (rp // rows, g, b),
                        (jax.ShapeDtypeStruct((b, g, rp, v.shape[-1]), q.dtype),
                         jax.ShapeDtypeStruct((b, g, rp), jnp.float32)),
                        cfg, "tree_attention_fwd_gpu", *fwd_lists, qg, kp_, vp_, *ints, *kints)
        return _from_rows(og, t, h), (qg, kp_, vp_, og, lse, ints, kints, fwd_lists, bwd_lists)

    @jax.custom_vjp
    def attn(q, k, v, q_pos, kv_pos, q_seg, kv_seg, subtree_end):
        return forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, subtree_end)[0]

    def attn_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, subtree_end):
        o, res = forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, subtree_end)
        return o, (res, q.shape, k.shape[1])

    def attn_bwd(saved, do):
        (qg, kp_, vp_, og, lse, ints, kints, fwd_lists, bwd_lists), (b, t, h, d), _ = saved
        g, rp = qg.shape[1], qg.shape[2]
        dog = _rows_layout(do, g, h // g, rp)
        delta = jnp.sum(og.astype(jnp.float32) * dog.astype(jnp.float32), axis=-1)
        scale = 1.0 / math.sqrt(d)
        common = (qg, kp_, vp_, dog, lse, delta, *ints, *kints)
        dqg = _call(functools.partial(_dq_kernel, rows=rows, block_k=block_k, scale=scale), (rp // rows, g, b),
                    jax.ShapeDtypeStruct(qg.shape, qg.dtype), cfg, "tree_attention_dq_gpu", *fwd_lists, *common)
        dk, dv = _call(functools.partial(_dkv_kernel, rows=rows, block_k=block_k, scale=scale),
                       (kp_.shape[1] // block_k, g, b),
                       (jax.ShapeDtypeStruct(kp_.shape, kp_.dtype), jax.ShapeDtypeStruct(vp_.shape, vp_.dtype)),
                       cfg, "tree_attention_dkv_gpu", *bwd_lists, *common)
        s = saved[2]
        return (_from_rows(dqg, t, h), dk[:, :s], dv[:, :s], None, None, None, None, None)

    attn.defvjp(attn_fwd, attn_bwd)
    return attn


def default_config(d: int) -> dict[str, int]:
    """Launch configuration for head dim ``d``: rows, block_k, num_warps, num_stages (D = 128's measured
    fastest by bench/tree_blocks.py, see BENCHMARKS.md)."""
    if d > 64:
        return dict(rows=128, block_k=32, num_warps=4, num_stages=3)
    return dict(rows=128, block_k=64, num_warps=4, num_stages=2)


def tree_attention_gpu(q, k, v, *, q_positions, kv_positions, q_segment_ids, kv_segment_ids, subtree_end,
                       rows: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                       num_stages: int | None = None, interpret: bool = False):
    """Prefix-tree causal GQA self-attention (module docstring), differentiable in q, k, v.

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, T, G, D]`` (one float dtype; head h uses kv head ``h // (H/G)``).
      q_positions, kv_positions, q_segment_ids, kv_segment_ids, subtree_end: ``[B, T]`` int; key slot j
        is visible to query slot i iff ``j <= i < subtree_end[j]``, ``kv_seg[j] == q_seg[i] >= 0`` and
        ``kv_pos[j] <= q_pos[i]`` (exactly, per element).
      rows: query rows (token x head) per program, a power of two >= 16; block_k: keys per tile (power of
        two >= 16); num_warps, num_stages: Triton launch parameters (None: ``default_config(D)``);
        interpret: Pallas interpret mode (CPU tests).
    Returns: ``[B, T, H, D]`` in ``q.dtype``; rows with no visible key are zeros.
    Preconditions (asserted; the attention op checks them for users): ``unsupported_reason`` is None.
    """
    why = unsupported_reason(q, k, v)
    assert why is None, why
    cfg = default_config(q.shape[-1])
    rows, block_k = rows or cfg["rows"], block_k or cfg["block_k"]
    assert _pow2(rows) and _pow2(block_k), f"rows ({rows}) and block_k ({block_k}) must be powers of two >= 16"
    num_warps, num_stages = num_warps or cfg["num_warps"], num_stages or cfg["num_stages"]
    return _op(rows, block_k, num_warps, num_stages, bool(interpret))(
        q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, subtree_end)


def masked_attention_gpu(q, k, v, *, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                         rows: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None, interpret: bool = False):
    """Causal GQA attention of any queries against any keys by positions and segments (module docstring),
    differentiable in q, k, v; walks only the key tiles ``position_tile_lists`` finds reachable.

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, S, G, D]`` (one float dtype; T and S independent).
      q_positions, q_segment_ids: ``[B, T]`` int; kv_positions, kv_segment_ids: ``[B, S]`` int; key j is
        visible to query i iff ``kv_seg[j] == q_seg[i] >= 0`` and ``kv_pos[j] <= q_pos[i]`` (per element).
      rows, block_k, num_warps, num_stages, interpret: as ``tree_attention_gpu``.
    Returns: ``[B, T, H, D]`` in ``q.dtype``; rows with no visible key are zeros.
    Memory: the tile lists are O(query tiles x key tiles) int32 (``tile_lists``; four arrays): ~8 MiB for 8K
      local queries against 64K keys at D = 128, ~2 GiB for 128K against 1M (a bound on the context-parallel
      sizes it suits).
    Preconditions (asserted; the attention op checks them): ``unsupported_reason(q, k, v, False)`` is None.
    """
    why = unsupported_reason(q, k, v, self_attention=False)
    assert why is None, why
    cfg = default_config(q.shape[-1])
    rows, block_k = rows or cfg["rows"], block_k or cfg["block_k"]
    assert _pow2(rows) and _pow2(block_k), f"rows ({rows}) and block_k ({block_k}) must be powers of two >= 16"
    num_warps, num_stages = num_warps or cfg["num_warps"], num_stages or cfg["num_stages"]
    return _op(rows, block_k, num_warps, num_stages, bool(interpret), False)(
        q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, jnp.zeros(kv_positions.shape, jnp.int32))

