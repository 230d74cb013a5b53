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
``subtree_end`` in it exceeds the tile's first token (conservative: the per-element mask is exact);
the forward and ``dq`` programs walk their query tile's reachable key tiles in ascending order, the
``dk`` / ``dv`` programs the transposed lists. On a DFS layout a query tile reaches its own
trajectory's tiles plus the neighbourhood of its branch, not the sibling subtrees.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["tree_attention_gpu", "tile_lists", "unsupported_reason", "BLOCK_K"]

#: Keys per tile (rows are padded to a multiple of it).
BLOCK_K = 64
_LOG2E = math.log2(math.e)
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _dot(a, b, trans_b=False):
    """2-D matmul with fp32 accumulation; lowers to a Triton tensor-core dot (tl.dot)."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _pow2(x: int) -> bool:
    return x >= 16 and not (x & (x - 1))


def unsupported_reason(q, k, v) -> str | None:
    """None when ``tree_attention_gpu`` serves these shapes / dtypes, else why not (one line).

    Args: q ``[B, T, H, D]``, k / v ``[B, T, G, D]`` (arrays or ShapeDtypeStructs).
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return f"q, k, v must be rank 4, got {q.shape}, {k.shape}, {v.shape}"
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != d:
        return f"k {k.shape} / v {v.shape} do not match q {q.shape} as [B, T, G, D] (self-attention)"
    if k.shape[2] < 1 or h % k.shape[2]:
        return f"{h} query heads are not a multiple of {k.shape[2]} kv heads"
    if not _pow2(d) or d > 256:
        return f"head_dim must be a power of two in [16, 256] (Triton tiles), got {d}"
    if not (q.dtype == k.dtype == v.dtype) or not any(q.dtype == x for x in _DTYPES):
        return f"q/k/v must share one dtype of float32/bfloat16/float16, got {q.dtype}/{k.dtype}/{v.dtype}"
    return None


def tile_lists(subtree_end, num_tokens: int, rep: int, rows: int, block_k: int):
    """Reachable key tiles per query tile and its transpose (module docstring).

    Args:
      subtree_end: ``[B, Tp]`` int32 (``Tp`` a multiple of ``block_k``; padding keys 0).
      num_tokens: T (real tokens per row); rep: query heads per kv group; rows: query rows per tile.
    Returns: ``(fwd_ids [B, NQ, NK], fwd_cnt [B, NQ], bwd_ids [B, NK, NQ], bwd_cnt [B, NK])`` int32:
      the first ``cnt`` entries of each list are the reachable tiles, ascending.
    """
    b, tp = subtree_end.shape
    nk = tp // block_k
    nq = -(-num_tokens * rep // rows)
    r0 = jnp.arange(nq, dtype=jnp.int32) * rows
    tok_lo = r0 // rep
    tok_hi = jnp.minimum((r0 + rows - 1) // rep, num_tokens - 1)
    emax = jnp.max(subtree_end.reshape(b, nk, block_k), axis=-1)                 # [B, NK]
    j0 = jnp.arange(nk, dtype=jnp.int32) * block_k
    reach = (j0[None, None, :] <= tok_hi[None, :, None]) & (emax[:, None, :] > tok_lo[None, :, None])

    def compact(m):   # [..., N] bool -> ascending indices of the True entries first, and their count
        idx = jnp.argsort(jnp.logical_not(m), axis=-1, stable=True).astype(jnp.int32)
        return idx, jnp.sum(m, axis=-1, dtype=jnp.int32)

    fwd_ids, fwd_cnt = compact(reach)
    bwd_ids, bwd_cnt = compact(jnp.swapaxes(reach, 1, 2))
    return fwd_ids, fwd_cnt, bwd_ids, bwd_cnt


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


def _fwd_kernel(ids_ref, cnt_ref, q_ref, k_ref, v_ref, qi_ref, qs_ref, qp_ref, ke_ref, ks_ref, kp_ref,
                o_ref, lse_ref, *, rows, block_k, scale):
    qt, g, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rs = pl.ds(qt * rows, rows)
    q = q_ref[b, g, rs, :]
    qi, qs, qp = qi_ref[b, rs], qs_ref[b, rs], qp_ref[b, rs]
    qk_scale = scale * _LOG2E

    def step(n, carry):
        acc, m_prev, l_prev = carry
        kt = ids_ref[b, qt, n]
        sl = pl.ds(kt * block_k, block_k)
        kb, vb = k_ref[b, sl, g, :], v_ref[b, sl, g, :]
        vis = _visible(qi, qs, qp, kt, ke_ref[b, sl], ks_ref[b, sl], kp_ref[b, sl], block_k)
        s = jnp.where(vis, _dot(q, kb, trans_b=True) * qk_scale, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        corr = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        acc = acc * corr[:, None] + _dot(p.astype(vb.dtype), vb)
        return acc, m_next, l_prev * corr + jnp.sum(p, axis=1)

    init = (jnp.zeros((rows, v_ref.shape[-1]), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l_i = jax.lax.fori_loop(0, cnt_ref[b, qt], step, init)
    ok = l_i > 0.0
    l_safe = jnp.where(ok, l_i, 1.0)
    o_ref[b, g, rs, :] = jnp.where(ok[:, None], acc / l_safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[b, g, rs] = jnp.where(ok, m + jnp.log2(l_safe), -jnp.inf)


def _dq_kernel(ids_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qi_ref, qs_ref, qp_ref,
               ke_ref, ks_ref, kp_ref, dq_ref, *, rows, block_k, scale):
    qt, g, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rs = pl.ds(qt * rows, rows)
    q, do = q_ref[b, g, rs, :], do_ref[b, g, rs, :]
    lse, delta = lse_ref[b, g, rs], delta_ref[b, g, rs]
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)          # rows with no key: every p is masked to 0
    qi, qs, qp = qi_ref[b, rs], qs_ref[b, rs], qp_ref[b, rs]
    qk_scale = scale * _LOG2E

    def step(n, dq):
        kt = ids_ref[b, qt, n]
        sl = pl.ds(kt * block_k, block_k)
        kb, vb = k_ref[b, sl, g, :], v_ref[b, sl, g, :]
        vis = _visible(qi, qs, qp, kt, ke_ref[b, sl], ks_ref[b, sl], kp_ref[b, sl], block_k)
        p = jnp.where(vis, jnp.exp2(_dot(q, kb, trans_b=True) * qk_scale - lse[:, None]), 0.0)
        ds = p * (_dot(do, vb, trans_b=True) - delta[:, None])
        return dq + _dot(ds.astype(kb.dtype), kb)

    dq = jax.lax.fori_loop(0, cnt_ref[b, qt], step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[b, g, rs, :] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(ids_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qi_ref, qs_ref, qp_ref,
                ke_ref, ks_ref, kp_ref, dk_ref, dv_ref, *, rows, block_k, scale):
    kt, g, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    sl = pl.ds(kt * block_k, block_k)
    kb, vb = k_ref[b, sl, g, :], v_ref[b, sl, g, :]
    ke, ks, kp = ke_ref[b, sl], ks_ref[b, sl], kp_ref[b, sl]
    qk_scale = scale * _LOG2E

    def step(n, carry):
        dk, dv = carry
        qt = ids_ref[b, kt, n]
        rs = pl.ds(qt * rows, rows)
        q, do = q_ref[b, g, rs, :], do_ref[b, g, rs, :]
        lse, delta = lse_ref[b, g, rs], delta_ref[b, g, rs]
        lse = jnp.where(lse == -jnp.inf, 0.0, lse)
        vis = _visible(qi_ref[b, rs], qs_ref[b, rs], qp_ref[b, rs], kt, ke, ks, kp, block_k, transposed=True)
        pt = jnp.where(vis, jnp.exp2(_dot(kb, q, trans_b=True) * qk_scale - lse[None, :]), 0.0)   # [bk, R]
        dv = dv + _dot(pt.astype(do.dtype), do)
        dst = pt * (_dot(vb, do, trans_b=True) - delta[None, :])
        return dk + _dot(dst.astype(q.dtype), q), dv

    zeros = jnp.zeros((block_k, kb.shape[-1]), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, cnt_ref[b, kt], step, (zeros, jnp.zeros((block_k, vb.shape[-1]), jnp.float32)))
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
def _op(rows: int, block_k: int, num_warps: int, num_stages: int, interpret: bool):
    """The custom-VJP attention for one launch configuration."""
    cfg = dict(num_warps=num_warps, num_stages=num_stages, interpret=interpret)

    def prepare(q, k, q_pos, kv_pos, q_seg, kv_seg, subtree_end):
        b, t, h, d = q.shape
        g = k.shape[2]
        rep = h // g
        rp = -(-t * rep // rows) * rows
        tp = -(-t // block_k) * block_k
        slot = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        ints = (_rows_layout(slot, g, rep, rp, -1), _rows_layout(q_seg, g, rep, rp, -1),
                _rows_layout(q_pos, g, rep, rp, -1))
        kpad = ((0, 0), (0, tp - t))
        kints = (jnp.pad(subtree_end.astype(jnp.int32), kpad), jnp.pad(kv_seg.astype(jnp.int32), kpad,
                                                                          constant_values=-1),
                 jnp.pad(kv_pos.astype(jnp.int32), kpad))
        lists = tile_lists(kints[0], t, rep, rows, block_k)
        return g, rep, rp, tp, ints, kints, lists

    def pad_kv(x, tp):
        return jnp.pad(x, ((0, 0), (0, tp - x.shape[1]), (0, 0), (0, 0)))

    def forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, subtree_end):
        b, t, h, d = q.shape
        g, rep, rp, tp, ints, kints, (fids, fcnt, bids, bcnt) = prepare(q, k, q_pos, kv_pos, q_seg, kv_seg,
                                                                        subtree_end)
        qg, kp_, vp_ = _rows_layout(q, g, rep, rp), pad_kv(k, tp), pad_kv(v, tp)
        kern = functools.partial(_fwd_kernel, rows=rows, block_k=block_k, scale=1.0 / math.sqrt(d))
        og, lse = _call(kern, (rp // rows, g, b),
                        (jax.ShapeDtypeStruct((b, g, rp, v.shape[-1]), q.dtype),
                         jax.ShapeDtypeStruct((b, g, rp), jnp.float32)),
                        cfg, "tree_attention_fwd_gpu", fids, fcnt, qg, kp_, vp_, *ints, *kints)
        return _from_rows(og, t, h), (qg, kp_, vp_, og, lse, ints, kints, bids, bcnt, fids, fcnt)

    @jax.custom_vjp
    def attn(q, k, v, q_pos, kv_pos, q_seg, kv_seg, subtree_end):
        return forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, subtree_end)[0]

    def attn_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, subtree_end):
        o, res = forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, subtree_end)
        return o, (res, q.shape, k.shape[1])

    def attn_bwd(saved, do):
        (qg, kp_, vp_, og, lse, ints, kints, bids, bcnt, fids, fcnt), (b, t, h, d), _ = saved
        g, rp = qg.shape[1], qg.shape[2]
        dog = _rows_layout(do, g, h // g, rp)
        delta = jnp.sum(og.astype(jnp.float32) * dog.astype(jnp.float32), axis=-1)
        scale = 1.0 / math.sqrt(d)
        common = (qg, kp_, vp_, dog, lse, delta, *ints, *kints)
        dqg = _call(functools.partial(_dq_kernel, rows=rows, block_k=block_k, scale=scale), (rp // rows, g, b),
                    jax.ShapeDtypeStruct(qg.shape, qg.dtype), cfg, "tree_attention_dq_gpu", fids, fcnt, *common)
        dk, dv = _call(functools.partial(_dkv_kernel, rows=rows, block_k=block_k, scale=scale),
                       (kp_.shape[1] // block_k, g, b),
                       (jax.ShapeDtypeStruct(kp_.shape, kp_.dtype), jax.ShapeDtypeStruct(vp_.shape, vp_.dtype)),
                       cfg, "tree_attention_dkv_gpu", bids, bcnt, *common)
        return (_from_rows(dqg, t, h), dk[:, :t], dv[:, :t], None, None, None, None, None)

    attn.defvjp(attn_fwd, attn_bwd)
    return attn


def tree_attention_gpu(q, k, v, *, q_positions, kv_positions, q_segment_ids, kv_segment_ids, subtree_end,
                       rows: int | None = None, block_k: int = BLOCK_K, num_warps: int | None = None,
                       num_stages: int = 2, interpret: bool = False):
    """Prefix-tree causal GQA self-attention (module docstring), differentiable in q, k, v.

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, T, G, D]`` (one float dtype; head h uses kv head ``h // (H/G)``).
      q_positions, kv_positions, q_segment_ids, kv_segment_ids, subtree_end: ``[B, T]`` int; key slot j
        is visible to query slot i iff ``j <= i < subtree_end[j]``, ``kv_seg[j] == q_seg[i] >= 0`` and
        ``kv_pos[j] <= q_pos[i]`` (exactly, per element).
      rows: query rows (token x head) per program, a power of two >= 16 (default 128 for ``D <= 64``,
        else 64); block_k: keys per tile (power of two >= 16); num_warps (default 4 for ``D <= 64``,
        else 8), num_stages: Triton launch parameters; interpret: Pallas interpret mode (CPU tests).
    Returns: ``[B, T, H, D]`` in ``q.dtype``; rows with no visible key are zeros.
    Preconditions (asserted; the attention op checks them for users): ``unsupported_reason`` is None.
    """
    why = unsupported_reason(q, k, v)
    assert why is None, why
    d = q.shape[-1]
    rows = rows or (128 if d <= 64 else 64)
    assert _pow2(rows) and _pow2(block_k), f"rows ({rows}) and block_k ({block_k}) must be powers of two >= 16"
    num_warps = num_warps or (4 if d <= 64 else 8)
    return _op(rows, block_k, num_warps, num_stages, bool(interpret))(
        q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, subtree_end)
