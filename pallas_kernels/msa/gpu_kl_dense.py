"""MSA indexer KL loss of the DENSE warm-up on GPU (Pallas, Triton lowering), flash-style; forward and backward.

Math (MSA_SPEC.md section 4; ``minimax_jax.ops.msa.kl`` with ``block_ids=None`` is the reference): for query i
and group r the support U is every key visible to i (same segment >= 0, ``kv_pos <= q_pos``, and with a prefix
tree key slot j only for query slots ``j <= i < kv_subtree_end[j]``).
  teacher t_j = mean over the group's R = H/G heads h of softmax_U(q_h . k_j / sqrt(D))   (no gradient)
  student p_j = softmax_U(qi_r . ki_j / sqrt(Di))
  KL(t || p) = sum_j t_j (log t_j - log p_j);  d KL / d x_j = p_j - t_j  (x = student logits), so
  d qi_r = sum_j (p_j - t_j) ki_j / sqrt(Di) and d ki_j = sum_{i, r} (p_j - t_j) qi_r / sqrt(Di).
Returns (sum of KL over (b, i, r), number of rows with a non-empty support); with per-query weights w_i the
weighted sum and count, and the gradients of the weighted sum (d x scaled by w_i in the kernels).

Schedule (never a [T, S] array; logits in the log2 domain, f32 statistics and accumulators, bf16 / f16 / f32
operands of the tensor-core products as given):
1. ``msa_kl_dense_lse_gpu``, one program per (query tile, head) and per (query tile, group) for the student:
   the online log-sum-exp of the head's teacher logits, and of the group's student logits, over the visible
   key tiles.
2. ``msa_kl_dense_rows_gpu``, one program per (query tile, group): the key tiles again; per tile the teacher
   (the f32 mean over the group's heads of exp2(s_h - lse_h), one head's [bq, D] x [D, bk] product per loop
   step), log p = x - lse_x, the KL terms summed per row and, with gradients, d x = p - t and d qi += d x ki.
3. ``msa_kl_dense_keys_gpu`` (gradients only), one program per (key tile, group): the query tiles that see
   it, recomputing t and p; d ki += d x^T qi. XLA sums the groups' d ki (ki is shared): no atomics, bitwise
   repeatable.
Key tiles (query tiles in pass 3) come from ``pallas_kernels.tree.gpu_attention``'s tile lists (XLA,
O(query tiles x key tiles) int32): only tiles that may hold a visible pair are walked, FULL ones (every pair
visible) without a mask, the rest masked per element, so correctness never depends on the skipping. A causal
row walks about half the tiles, packed documents only their own; passes 1 and 2 launch the last query tiles
first, pass 3 the first key tiles (causal: the longest walks first, a shorter tail). The gradients are those of
a unit cotangent, computed with the forward (three passes in all, each the teacher's H x D products over the
visible pairs) and kept as f32 residuals scaled in the backward, as ``gpu_kl.py`` does. ``teacher_lse`` (the
sparse kernel's shortcut) is not taken: the dense main-branch attention does not return its LSE.
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

from pallas_kernels.tree.gpu_attention import position_tile_lists, tile_lists

__all__ = ["indexer_kl_dense_gpu", "dense_unsupported_reason", "DEFAULT_TILING"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)

#: Default launch configuration (block_q, block_k: query / key tile sizes; Triton num_warps / num_stages).
DEFAULT_TILING = dict(block_q=64, block_k=64, num_warps=4, num_stages=2)


def _pow2(x: int) -> bool:
    return x >= 16 and not x & (x - 1)


def dense_unsupported_reason(q, k, qi, ki) -> str | None:
    """Why the dense KL kernels cannot take these arrays (one line), None when they can.

    Args: q ``[B, T, H, D]``, k ``[B, S, G, D]``, qi ``[B, T, G, Di]``, ki ``[B, S, Di]`` (arrays or
      ShapeDtypeStructs): D and Di powers of two in [16, 256] (Triton tiles), q / k and qi / ki each one dtype
      of float32 / bfloat16 / float16.
    """
    for name, dim in (("head dim D", q.shape[-1]), ("index dim Di", qi.shape[-1])):
        if not _pow2(dim) or dim > 256:
            return f"{name} must be a power of two in [16, 256] for the dense GPU KL kernels, got {dim}"
    ok = (jnp.float32, jnp.bfloat16, jnp.float16)
    for names, a, b in (("q / k", q, k), ("qi / ki", qi, ki)):
        if a.dtype != b.dtype or a.dtype not in ok:
            return f"{names} must share one dtype of float32 / bfloat16 / float16, got {a.dtype} / {b.dtype}"
    return None


def _dot(a, b, trans_a=False, trans_b=False):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


class _Rows:
    """Visibility inputs of one query tile qt: segments qs, positions qp [bq] and (tree) the query slots."""

    def __init__(self, qs_ref, qp_ref, b, qt, bq, tree):
        rs = pl.ds(qt * bq, bq)
        self.qs, self.qp = qs_ref[b, rs], qp_ref[b, rs]
        self.slot = qt * bq + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0) if tree else None


class _Keys:
    """Visibility inputs of one key tile kt: segments ks, positions kp [bk] and (tree) slots and subtree ends."""

    def __init__(self, ke_ref, ks_ref, kp_ref, b, kt, bk, tree):
        sl = pl.ds(kt * bk, bk)
        self.ks, self.kp = ks_ref[b, sl], kp_ref[b, sl]
        self.slot = kt * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0) if tree else None
        self.end = ke_ref[b, sl] if tree else None


def _visible(rows: _Rows, keys: _Keys):
    """[bq, bk] bool: ``minimax_jax.ops.msa.common.visible`` for one (query tile, key tile) pair."""
    m = ((keys.ks[None, :] == rows.qs[:, None]) & (keys.ks[None, :] >= 0)
         & (keys.kp[None, :] <= rows.qp[:, None]))
    if rows.slot is not None:
        qi = rows.slot[:, None]
        m = m & (keys.slot[None, :] <= qi) & (qi < keys.end[None, :])
    return m


def _safe(lse):
    return jnp.where(lse == -jnp.inf, 0.0, lse)


def _teacher_student(q_ref, lse_ref, b, g, rs, heads, kb, qi, kib, lx2, vis, scale2, iscale2):
    """Teacher t [bq, bk] (the f32 mean of the group's heads' probabilities) and log2 student probabilities
    [bq, bk] of one (query tile, key tile) pair; ``vis`` None: a FULL tile (every pair visible)."""
    def head(hh, acc):
        h = g * heads + hh
        s = _dot(q_ref[b, rs, h, :], kb, trans_b=True) * scale2
        return acc + jnp.exp2(s - _safe(lse_ref[b, h, rs])[:, None])

    shape = (qi.shape[0], kb.shape[0])
    t = jax.lax.fori_loop(0, heads, head, jnp.zeros(shape, jnp.float32)) * (1.0 / heads)
    x = _dot(qi, kib, trans_b=True) * iscale2
    if vis is not None:
        t = jnp.where(vis, t, 0.0)
        x = jnp.where(vis, x, -jnp.inf)
    return t, x - lx2[:, None]


def _walk(step, ids_refs, b, tile, init):
    """Run ``step(n, carry, ids_ref, masked)`` over the FULL tiles, then the partial (masked) ones."""
    fids_ref, fcnt_ref, pids_ref, pcnt_ref = ids_refs
    carry = jax.lax.fori_loop(0, fcnt_ref[b, tile], functools.partial(step, ids_ref=fids_ref, masked=False), init)
    return jax.lax.fori_loop(0, pcnt_ref[b, tile], functools.partial(step, ids_ref=pids_ref, masked=True), carry)


def _lse_kernel(fids_ref, fcnt_ref, pids_ref, pcnt_ref, x_ref, y_ref, qs_ref, qp_ref, ke_ref, ks_ref, kp_ref,
                lse_ref, *, bq, bk, nq, scale2, per_kv, tree):
    """Log2-sum-exp2 of head h's logits x_h . y_{h // per_kv} * scale2 over the visible keys -> lse [B, X, Tp]."""
    qt, h, b = nq - 1 - pl.program_id(0), pl.program_id(1), pl.program_id(2)       # causal: longest rows first
    rs = pl.ds(qt * bq, bq)
    x = x_ref[b, rs, h, :]
    rows = _Rows(qs_ref, qp_ref, b, qt, bq, tree)
    kvh = h // per_kv

    def step(n, carry, ids_ref, masked):
        m_prev, l_prev = carry
        kt = ids_ref[b, qt, n]
        s = _dot(x, y_ref[b, pl.ds(kt * bk, bk), kvh, :], trans_b=True) * scale2
        if masked:
            s = jnp.where(_visible(rows, _Keys(ke_ref, ks_ref, kp_ref, b, kt, bk, tree)), s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = _safe(m_next)
        l_next = l_prev * jnp.exp2(m_prev - m_safe) + jnp.sum(jnp.exp2(s - m_safe[:, None]), axis=1)
        return m_next, l_next

    init = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
    m, l_i = _walk(step, (fids_ref, fcnt_ref, pids_ref, pcnt_ref), b, qt, init)
    ok = l_i > 0.0
    lse_ref[b, h, rs] = jnp.where(ok, m + jnp.log2(jnp.where(ok, l_i, 1.0)), -jnp.inf)


def _rows_kernel(fids_ref, fcnt_ref, pids_ref, pcnt_ref, q_ref, k_ref, qi_ref, ki_ref, lse_ref, lsex_ref, qs_ref,
                 qp_ref, ke_ref, ks_ref, kp_ref, *refs, bq, bk, nq, scale2, iscale2, iscale, heads, tree, grads,
                 weighted):
    """Per (query tile, group): KL row sums [B, G, Tp] (natural log) and, with ``grads``, d qi [B, Tp, G, Di]."""
    if weighted:
        qw_ref, refs = refs[0], refs[1:]
    kl_ref, dqi_ref = refs if grads else (refs[0], None)
    qt, g, b = nq - 1 - pl.program_id(0), pl.program_id(1), pl.program_id(2)       # causal: longest rows first
    rs = pl.ds(qt * bq, bq)
    qi = qi_ref[b, rs, g, :]                                             # [bq, Di]
    lx2 = _safe(lsex_ref[b, g, rs])
    rows = _Rows(qs_ref, qp_ref, b, qt, bq, tree)
    w = qw_ref[b, rs] if weighted else None

    def step(n, carry, ids_ref, masked):
        kl, dqi = carry
        kt = ids_ref[b, qt, n]
        sl = pl.ds(kt * bk, bk)
        kb, kib = k_ref[b, sl, g, :], ki_ref[b, sl, :]
        vis = _visible(rows, _Keys(ke_ref, ks_ref, kp_ref, b, kt, bk, tree)) if masked else None
        t, lp = _teacher_student(q_ref, lse_ref, b, g, rs, heads, kb, qi, kib, lx2, vis, scale2, iscale2)
        pos = t > 0.0
        kl = kl + jnp.sum(jnp.where(pos, t * (jnp.log2(jnp.where(pos, t, 1.0)) - lp), 0.0), axis=1)
        if not grads:
            return kl, dqi
        dx = jnp.exp2(lp) - t                                            # [bq, bk]; 0 off the support
        if weighted:
            dx = dx * w[:, None]
        return kl, dqi + _dot(dx.astype(kib.dtype), kib)

    init = (jnp.zeros((bq,), jnp.float32), jnp.zeros(qi.shape, jnp.float32) if grads else None)
    kl, dqi = _walk(step, (fids_ref, fcnt_ref, pids_ref, pcnt_ref), b, qt, init)
    kl_ref[b, g, rs] = kl * _LN2
    if grads:
        dqi_ref[b, rs, g, :] = dqi * iscale


def _keys_kernel(fids_ref, fcnt_ref, pids_ref, pcnt_ref, q_ref, k_ref, qi_ref, ki_ref, lse_ref, lsex_ref, qs_ref,
                 qp_ref, ke_ref, ks_ref, kp_ref, *refs, bq, bk, nq, scale2, iscale2, iscale, heads, tree, weighted):
    """Per (key tile, group): d ki [B, G, Sp, Di] of the group's rows (summed over the groups in XLA); key tile 0
    (causal: the most query tiles) first."""
    del nq
    if weighted:
        qw_ref, refs = refs[0], refs[1:]
    (dki_ref,) = refs
    kt, g, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    sl = pl.ds(kt * bk, bk)
    kb, kib = k_ref[b, sl, g, :], ki_ref[b, sl, :]
    keys = _Keys(ke_ref, ks_ref, kp_ref, b, kt, bk, tree)

    def step(n, dki, ids_ref, masked):
        qt = ids_ref[b, kt, n]
        rs = pl.ds(qt * bq, bq)
        qi = qi_ref[b, rs, g, :]
        vis = _visible(_Rows(qs_ref, qp_ref, b, qt, bq, tree), keys) if masked else None
        t, lp = _teacher_student(q_ref, lse_ref, b, g, rs, heads, kb, qi, kib, _safe(lsex_ref[b, g, rs]), vis,
                                 scale2, iscale2)
        dx = jnp.exp2(lp) - t
        if weighted:
            dx = dx * qw_ref[b, rs][:, None]
        return dki + _dot(dx.astype(qi.dtype), qi, trans_a=True)         # [bk, Di]

    dki = _walk(step, (fids_ref, fcnt_ref, pids_ref, pcnt_ref), b, kt, jnp.zeros(kib.shape, jnp.float32))
    dki_ref[b, g, sl, :] = dki * iscale


def _pad(x, axis, n, fill=0):
    if x.shape[axis] == n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, widths, constant_values=fill)


def _run(q, k, qi, ki, q_pos, kv_pos, q_seg, kv_seg, subtree_end, q_weights, *, grads, block_q, block_k, num_warps,
         num_stages, interpret):
    """(kl_sum, count, dqi [B,T,G,Di] f32 or None, dki [B,S,Di] f32 or None) for a unit cotangent."""
    bq, bk = block_q, block_k
    bsz, t, h, d = q.shape
    s, g, di = k.shape[1], k.shape[2], qi.shape[-1]
    tree = subtree_end is not None
    weighted = q_weights is not None
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    i32 = lambda x: x.astype(jnp.int32)                                  # noqa: E731
    qs, qp = _pad(i32(q_seg), 1, tp, -1), _pad(i32(q_pos), 1, tp, -1)
    ks, kp = _pad(i32(kv_seg), 1, sp, -1), _pad(i32(kv_pos), 1, sp, 0)
    ke = _pad(i32(subtree_end), 1, sp, 0) if tree else jnp.zeros((bsz, sp), jnp.int32)
    if tree:
        fwd_lists, bwd_lists = tile_lists(ke, ks, kp, qs, qp, t, 1, bq, bk)
    else:
        fwd_lists, bwd_lists = position_tile_lists(ks, kp, qs, qp, bq, bk)
    qpad, qipad = _pad(q, 1, tp), _pad(qi, 1, tp)
    kpad, kipad = _pad(k, 1, sp), _pad(ki, 1, sp)
    ints = (qs, qp, ke, ks, kp)
    params = dict(compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                  interpret=interpret)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)         # noqa: E731
    scale2, iscale2 = _LOG2E / math.sqrt(d), _LOG2E / math.sqrt(di)
    nq, nk = tp // bq, sp // bk

    def lse(x, y, per_kv, scale):
        return pl.pallas_call(
            functools.partial(_lse_kernel, bq=bq, bk=bk, nq=nq, scale2=scale, per_kv=per_kv, tree=tree),
            grid=(nq, x.shape[2], bsz), out_shape=f32(bsz, x.shape[2], tp), name="msa_kl_dense_lse_gpu", **params,
        )(*fwd_lists, x, y, qs, qp, ke, ks, kp)

    lse_t = lse(qpad, kpad, h // g, scale2)                               # [B, H, Tp] log2
    lse_x = lse(qipad, kipad[:, :, None, :], g, iscale2)                  # [B, G, Tp] log2
    consts = dict(bq=bq, bk=bk, nq=nq, scale2=scale2, iscale2=iscale2, iscale=1.0 / math.sqrt(di), heads=h // g,
                  tree=tree, weighted=weighted)
    common = (qpad, kpad, qipad, kipad, lse_t, lse_x, *ints)
    wts = (_pad(q_weights.astype(jnp.float32), 1, tp),) if weighted else ()
    outs = [f32(bsz, g, tp)] + ([f32(bsz, tp, g, di)] if grads else [])
    res = pl.pallas_call(functools.partial(_rows_kernel, grads=grads, **consts), grid=(nq, g, bsz), out_shape=outs,
                         name="msa_kl_dense_rows_gpu", **params)(*fwd_lists, *common, *wts)
    rows_ok = jnp.isfinite(lse_x[:, :, :t])                               # [B, G, T]: non-empty supports
    kl_rows = res[0][:, :, :t]
    if weighted:
        w = q_weights.astype(jnp.float32)[:, None, :]
        kl, count = jnp.sum(kl_rows * w), jnp.sum(jnp.where(rows_ok, w, 0.0))
    else:
        kl, count = jnp.sum(kl_rows), jnp.sum(rows_ok.astype(jnp.int32))
    if not grads:
        return kl, count, None, None
    dki = pl.pallas_call(functools.partial(_keys_kernel, **consts), grid=(nk, g, bsz), out_shape=f32(bsz, g, sp, di),
                         name="msa_kl_dense_keys_gpu", **params)(*bwd_lists, *common, *wts)
    return kl, count, res[1][:, :t], jnp.sum(dki, axis=1)[:, :s]


def _f0(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _kl(q, k, qi, ki, q_pos, kv_pos, q_seg, kv_seg, subtree_end, q_weights, cfg):
    kl, count, _, _ = _run(q, k, qi, ki, q_pos, kv_pos, q_seg, kv_seg, subtree_end, q_weights, grads=False,
                           **dict(cfg))
    return kl, count


def _kl_fwd(q, k, qi, ki, q_pos, kv_pos, q_seg, kv_seg, subtree_end, q_weights, cfg):
    kl, count, dqi, dki = _run(q, k, qi, ki, q_pos, kv_pos, q_seg, kv_seg, subtree_end, q_weights, grads=True,
                               **dict(cfg))
    dtypes = (jnp.zeros((0,), qi.dtype), jnp.zeros((0,), ki.dtype))      # the cotangents' dtypes
    ints = (q_pos, kv_pos, q_seg, kv_seg, subtree_end)
    return (kl, count), (q, k, ints, q_weights, dqi, dki, dtypes)


def _kl_bwd(cfg, res, cot):
    q, k, ints, q_weights, dqi, dki, (qi_dt, ki_dt) = res
    ct = cot[0].astype(jnp.float32)
    return (jnp.zeros_like(q), jnp.zeros_like(k), (dqi * ct).astype(qi_dt.dtype), (dki * ct).astype(ki_dt.dtype),
            *(_f0(x) for x in ints), None if q_weights is None else jnp.zeros_like(q_weights))


_kl.defvjp(_kl_fwd, _kl_bwd)


def indexer_kl_dense_gpu(q, k, qi, ki, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                         kv_subtree_end=None, q_weights=None, block_q: int | None = None, block_k: int | None = None,
                         num_warps: int | None = None, num_stages: int | None = None, interpret: bool = False):
    """Indexer KL(teacher || student) of the dense warm-up (support: every visible key), Pallas/Triton GPU kernels.

    Args:
      q [B,T,H,D], k [B,S,G,D]: main branch (no gradient reaches them: zeros).
      qi [B,T,G,Di], ki [B,S,Di]: index branch (gradients flow here). ``dense_unsupported_reason`` must be None.
      q_positions, q_segment_ids [B,T] int; kv_positions, kv_segment_ids [B,S] int (segment ids both or neither:
        one segment); visibility exactly ``minimax_jax.ops.msa.common.visible``, any storage order, any T and S.
      kv_subtree_end: None, or [B,S] int prefix-tree visibility (needs T == S; query slot i sees key slot j only
        when ``j <= i < kv_subtree_end[j]``).
      q_weights: None, or float [B,T]: query i's rows count ``q_weights[b, i]`` times in the sum, the count and
        the gradients (no gradient).
      block_q, block_k: query / key tile sizes (powers of two >= 16); num_warps, num_stages: Triton launch
        parameters (None: ``DEFAULT_TILING``); interpret: Pallas interpret mode (CPU tests).
    Returns: (kl_sum f32 [], count int32 [], or float32 with q_weights), as ``minimax_jax.ops.msa.indexer_kl``
      with ``block_ids=None``.
    Memory: O(T) outputs and residuals (d qi, d ki in f32), plus the tile lists: O(T/block_q x S/block_k) int32.
    Raises: ValueError for unsupported shapes / dtypes (``dense_unsupported_reason``), a bad tiling, a
      kv_subtree_end with T != S or bad argument shapes.
    """
    why = dense_unsupported_reason(q, k, qi, ki)
    if why is not None:
        raise ValueError(f"indexer_kl_dense_gpu: {why}")
    bsz, t, h, _ = q.shape
    s, g = k.shape[1], k.shape[2]
    if h % g or qi.shape[:3] != (bsz, t, g) or ki.shape[:2] != (bsz, s) or k.shape[0] != bsz:
        raise ValueError(f"indexer_kl_dense_gpu: shapes q {q.shape}, k {k.shape}, qi {qi.shape}, ki {ki.shape} are "
                         "not [B,T,H,D], [B,S,G,D], [B,T,G,Di], [B,S,Di] with G dividing H")
    cfg = {name: DEFAULT_TILING[name] if v is None else v for name, v in
           (("block_q", block_q), ("block_k", block_k), ("num_warps", num_warps), ("num_stages", num_stages))}
    is_int = lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)     # noqa: E731
    if not all(is_int(v) for v in cfg.values()) or not (_pow2(cfg["block_q"]) and _pow2(cfg["block_k"])) \
            or cfg["num_warps"] not in (1, 2, 4, 8, 16) or cfg["num_stages"] < 1:
        raise ValueError(f"indexer_kl_dense_gpu: block_q / block_k must be powers of two >= 16, num_warps a power "
                         f"of two in 1-16, num_stages >= 1; got {cfg}")
    if kv_subtree_end is not None and (t != s or tuple(kv_subtree_end.shape) != (bsz, s)):
        raise ValueError(f"indexer_kl_dense_gpu: kv_subtree_end needs T == S and shape [B, S]; got T={t}, S={s}, "
                         f"{tuple(kv_subtree_end.shape)}")
    if q_weights is not None:
        if tuple(q_weights.shape) != (bsz, t):
            raise ValueError(f"indexer_kl_dense_gpu: q_weights must be [B,T] = {(bsz, t)}, got {q_weights.shape}")
        q_weights = jax.lax.stop_gradient(q_weights.astype(jnp.float32))
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("indexer_kl_dense_gpu: pass both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is None:
        q_segment_ids, kv_segment_ids = jnp.zeros((bsz, t), jnp.int32), jnp.zeros((bsz, s), jnp.int32)
    cfg["interpret"] = bool(interpret)
    return _kl(q, k, qi, ki, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_subtree_end, q_weights,
               tuple(sorted(cfg.items())))
