"""MSA sparse attention forward on Hopper, query-tiled: a CTA takes the queries of ``cta_tokens(H/G)``
consecutive tokens of one kv group and walks the union of the K/V windows they selected, so a window loaded
once serves every token of the tile that chose it; no per-selection partial outputs, no combine.

Math: MSA_SPEC.md section 3 (the contract of ``gpu_sparse_fwd.sparse_fwd_kv_outer``: same arguments, same
outputs). Schedule, per CTA (tile c of nt tokens, group g, batch row b), three warpgroups:

- XLA first builds, per tile, the distinct window storage starts its tokens selected, ascending (``u``), their
  count and per window a bit per token that selected it (``bits``), and per token the scalars (first and last
  storage index of its segment, base + position) that bound the keys it sees;
- memory warpgroup: TMA of the tile's tables into SMEM, then of each union window's K and V [B_blk, D] into a
  ring of ``STAGES`` slots;
- compute warpgroup w owns nt / 2 tokens (64 rows: ``head_slot(H/G)`` rows per token) and keeps an online softmax
  over the windows any of its tokens selected (``wgmma`` for S = Q K^T and P V, P in registers); a row sees the
  window columns [max(0, j0 - w0), min(B - 1, base + pos - w0, j1 - w0)] where its token selected the window,
  nothing otherwise; windows none of its tokens selected are skipped. Output rows and LSEs are stored once.

When it runs (``use_query_tiles``, decided on the device per call by ``sparse_fwd_hopper``; never for padded
head slots, H/G not in {8, 16, 32, 64}, which keep the KV-outer forward): every selected
window 8-row aligned and unclamped (its storage start is base + n * B), and the tiles' unions small: on average
at most ``UNION_PER_TOKEN`` x (valid selections per token) x nt / 8 windows (independent random selections give
~6x at nt = 8 and the KV-outer forward is faster there; a trained indexer's neighbouring tokens overlap,
~2.5x, and this kernel is faster: BENCHMARKS.md, MSA prefill, query-tiled forward). Otherwise the KV-outer
forward (``gpu_sparse_fwd_wgmma``) runs.

Restrictions: those of ``gpu_sparse_fwd_wgmma.wgmma_supported`` (bf16 / f16, H/G <= 64, D = Dv in {64, 128},
B in {64, 128}); H/G not in {8, 16, 32, 64} computes padded head slots (q padded in XLA, spare rows dropped).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import mosaic_interpret_params, mosaic_smem_transforms, typed_out_struct
from pallas_kernels.msa import layout
from pallas_kernels.msa.gpu_sparse_fwd_wgmma import (from_head_slots, head_slot, sparse_fwd_wgmma,
                                                     to_head_slots, wgmma_supported)

__all__ = ["sparse_fwd_qtile", "sparse_fwd_hopper", "tile_tables", "use_query_tiles", "cta_tokens",
           "UNION_PER_TOKEN", "STAGES"]

ROWS = 64                 # rows per compute warpgroup: one wgmma M
STAGES = 2                # K/V ring slots (three do not fit SMEM beside the q tiles at D = 128)
UNION_PER_TOKEN = 3.05    # dispatch bound: mean union windows per tile / (mean selections per token * nt / 8)
_BIG = 2 ** 30
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def cta_tokens(hg: int) -> int:
    """Query tokens per CTA: two compute warpgroups of 64 rows, ``head_slot(hg)`` rows per token."""
    return 2 * (ROWS // head_slot(hg))


def tile_tables(starts, valid, nt):
    """Per tile of nt tokens: (u [B,G,C,nt*K] int32 distinct selected window starts ascending, then 0;
    cnt [B,G,C] int32 how many; bits [B,G,C,nt*K] int32, bit i set where token i of the tile selected u).
    starts / valid: [B,G,T,K] (T a multiple of nt)."""
    b, g, t, k = starts.shape
    x = jnp.where(valid, starts, _BIG).reshape(b, g, t // nt, nt * k)
    xs = jnp.sort(x, axis=-1)
    first = (xs < _BIG) & jnp.concatenate([jnp.ones_like(xs[..., :1], bool), xs[..., 1:] != xs[..., :-1]], -1)
    u = jnp.sort(jnp.where(first, xs, _BIG), axis=-1)
    cnt = jnp.sum(first, -1, dtype=jnp.int32)
    # one reduction over (token, slot), so XLA fuses it with the comparison (nothing [.., nt*K, nt] is stored)
    eq = u[..., :, None, None] == x.reshape(b, g, t // nt, 1, nt, k)                      # [b,g,c,nt*k,nt,k]
    token_bit = jnp.left_shift(jnp.int32(1), jnp.arange(nt, dtype=jnp.int32))[:, None]
    bits = lax.reduce(jnp.where(eq, token_bit, jnp.int32(0)), jnp.int32(0), lax.bitwise_or, (4, 5))
    return jnp.where(u == _BIG, 0, u).astype(jnp.int32), cnt, bits


def use_query_tiles(cnt, starts, valid, ids, base, blk, nt):
    """The device-side choice (bool scalar): every valid window 8-row aligned and unclamped, and the mean
    union per tile <= UNION_PER_TOKEN x mean valid selections per token x nt / 8 (module docstring)."""
    exact = starts == base[:, None, :, None] + ids * blk
    ok = jnp.all(~valid | (exact & (starts % 8 == 0)))
    per_token = jnp.sum(valid) / jnp.maximum(jnp.sum(jnp.any(valid, axis=-1)), 1)
    return ok & (jnp.mean(cnt) <= UNION_PER_TOKEN * per_token * nt / 8)


def _body(u_ref, bits_ref, cnt_ref, tok_ref, q_ref, k_ref, v_ref, o_ref, l_ref, *, blk, sr, nt, scale, p_in_smem):
    """One CTA (module docstring). q / o carry G * sr head rows (head slots); tok_ref [B, 3, Tp] int32:
    first and last storage index of each token's segment, base + position."""
    c, g, b = lax.axis_index("c"), lax.axis_index("g"), lax.axis_index("b")
    tpw = nt // 2
    t0 = c * nt
    n_u = cnt_ref[b, g, c]
    nu = u_ref.shape[-1]
    dtype = q_ref.dtype
    d, dv = q_ref.shape[-1], v_ref.shape[-1]
    heads = pl.ds(g * sr, sr)

    def scope(q_smem, k_smem, v_smem, tab_smem, l_smem, q_bar, k_rdy, v_rdy, k_free, v_free, tab_bar,
              p_smem=None):
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def _():
            plgpu.copy_gmem_to_smem(u_ref.at[b, g, c], tab_smem.at[0], tab_bar.at[0])
            plgpu.copy_gmem_to_smem(bits_ref.at[b, g, c], tab_smem.at[1], tab_bar.at[0])
        plgpu.barrier_wait(tab_bar.at[0])

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def load(j, slot):
                rows = pl.ds(pl.multiple_of(tab_smem[0, j], 8), blk)
                plgpu.copy_gmem_to_smem(k_ref.at[b, rows, g], k_smem.at[slot], k_rdy.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[b, rows, g], v_smem.at[slot], v_rdy.at[slot])

            def first(j, carry):
                load(j, j)
                return carry
            lax.fori_loop(0, jnp.minimum(n_u, STAGES), first, None)

            def steady(j, carry):
                slot = lax.rem(j, STAGES)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                load(j, slot)
                return carry
            lax.fori_loop(STAGES, n_u, steady, None)

            def drain(j, carry):        # observe the last releases before the barriers go away
                slot = lax.rem(j, STAGES)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                return carry
            lax.fori_loop(jnp.maximum(n_u - STAGES, 0), n_u, drain, None)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qs = q_smem.at[wg]
            tb = t0 + wg * tpw
            for j in range(tpw):
                plgpu.copy_gmem_to_smem(q_ref.at[b, tb + j, heads], qs.at[pl.ds(j * sr, sr)], q_bar.at[wg])
            # per token of this warpgroup: segment storage run [j0, j1] and base + position (last visible key)
            j0s = [tok_ref[b, 0, tb + j] for j in range(tpw)]
            j1s = [tok_ref[b, 1, tb + j] for j in range(tpw)]
            lasts = [tok_ref[b, 2, tb + j] for j in range(tpw)]
            row_tok = plgpu.broadcasted_iota(jnp.int32, (ROWS, blk), 0, layout=plgpu.Layout.WGMMA) // sr
            col = plgpu.broadcasted_iota(jnp.int32, (ROWS, blk), 1, layout=plgpu.Layout.WGMMA)
            plgpu.barrier_wait(q_bar.at[wg])
            m_i = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((ROWS, dv), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            full_bits = (1 << tpw) - 1
            # per-token bounds that do not depend on the window: first / last storage index it may see
            his = [jnp.minimum(lasts[jt], j1s[jt]) for jt in range(tpw)]
            lo_all = functools.reduce(jnp.maximum, j0s)          # a window at or after every token's segment start
            hi_all = functools.reduce(jnp.minimum, his)          # ... and ending at or before every token's last key

            def step(j, carry):
                slot = lax.rem(j, STAGES)
                w0 = tab_smem[0, j]
                mine = lax.shift_right_logical(tab_smem[1, j], wg * tpw) & full_bits
                plgpu.barrier_wait(k_rdy.at[slot])

                def compute(carry):
                    acc, m_i, l_i = carry

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, qs, k_smem.at[slot].transpose((1, 0)))
                        return acc_ref[...]
                    s = pl.run_scoped(qk, plgpu.ACC((ROWS, blk), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])

                    def masked(s):
                        # visible columns of each token's rows (none where it did not select the window)
                        lo = hi = None
                        for jt in reversed(range(tpw)):
                            lo_j = jnp.maximum(j0s[jt] - w0, 0)
                            hi_j = jnp.where(((mine >> jt) & 1) == 1, jnp.minimum(his[jt] - w0, blk - 1), -1)
                            lo = lo_j if lo is None else jnp.where(row_tok == jt, lo_j, lo)
                            hi = hi_j if hi is None else jnp.where(row_tok == jt, hi_j, hi)
                        return jnp.where((col >= lo) & (col <= hi), s, -jnp.inf)
                    # every row chose the window and sees all of it: no mask
                    whole = (mine == full_bits) & (w0 >= lo_all) & (w0 + blk - 1 <= hi_all)
                    s = lax.cond(whole, lambda s: s, masked, s)
                    m_ij = jnp.maximum(m_i, jnp.max(s, axis=1) * scale)      # the scale folded into exp2's FMA
                    m_safe = jnp.where(m_ij == -jnp.inf, 0.0, m_ij)
                    p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_safe, (ROWS, blk), [0]))
                    alpha = jnp.exp2(m_i - m_safe)
                    l_i = l_i * alpha + jnp.sum(p, axis=1)
                    acc = acc * lax.broadcast_in_dim(alpha, (ROWS, dv), [0])
                    p16 = p.astype(dtype)
                    if p_smem is not None:      # P through SMEM (the interpreter's wgmma reads SMEM only)
                        p_ref = p_smem.at[wg]
                        p_ref[...] = p16
                        plgpu.commit_smem()
                    plgpu.barrier_wait(v_rdy.at[slot])

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16 if p_smem is None else p_ref, v_smem.at[slot])
                    if p_smem is None:      # accumulate in place (the interpreter cannot lower ACC.init)
                        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    else:
                        def pv_new(acc_ref):
                            pv(acc_ref)
                            return acc_ref[...]
                        acc = acc + pl.run_scoped(pv_new, plgpu.ACC((ROWS, dv), jnp.float32))
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_ij, l_i

                def skip(carry):                # keep the barrier phases in step
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_wait(v_rdy.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                    return carry
                return lax.cond(mine != 0, compute, skip, carry)

            acc, m_i, l_i = lax.fori_loop(0, n_u, step, (acc, m_i, l_i))
            l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
            o = acc * lax.broadcast_in_dim(1.0 / l_safe, (ROWS, dv), [0])
            m_safe = jnp.where(m_i == -jnp.inf, 0.0, m_i)
            qs[...] = o.astype(dtype)       # the q tile is spent: it stages the output rows
            l_smem.at[wg][...] = jnp.where(l_i == 0.0, -jnp.inf, m_safe * _LN2 + jnp.log(l_safe))
            plgpu.commit_smem()
            for j in range(tpw):
                plgpu.copy_smem_to_gmem(qs.at[pl.ds(j * sr, sr)], o_ref.at[b, tb + j, heads])
                plgpu.copy_smem_to_gmem(l_smem.at[wg, pl.ds(j * sr, sr)], l_ref.at[b, tb + j, heads])
            plgpu.wait_smem_to_gmem(0)

    itemsize = jnp.dtype(dtype).itemsize
    extra = {}
    if p_in_smem:
        extra["p_smem"] = plgpu.SMEM((2, ROWS, blk), dtype, transforms=mosaic_smem_transforms(blk, itemsize))
    pl.run_scoped(
        scope,
        q_smem=plgpu.SMEM((2, ROWS, d), dtype, transforms=mosaic_smem_transforms(d, itemsize)),
        k_smem=plgpu.SMEM((STAGES, blk, d), dtype, transforms=mosaic_smem_transforms(d, itemsize)),
        v_smem=plgpu.SMEM((STAGES, blk, dv), dtype, transforms=mosaic_smem_transforms(dv, itemsize)),
        tab_smem=plgpu.SMEM((2, nu), jnp.int32),
        l_smem=plgpu.SMEM((2, ROWS), jnp.float32),
        q_bar=plgpu.Barrier(num_arrivals=tpw, num_barriers=2),
        k_rdy=plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),
        v_rdy=plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),
        k_free=plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
        v_free=plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
        tab_bar=plgpu.Barrier(num_arrivals=2, num_barriers=1),
        **extra,
        collective_axes="wg",
    )


class _Prep:
    """What both Hopper forwards share: padded keys, bases, deduplicated ids, window starts."""

    def __init__(self, q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, blk):
        self.prep = layout.prepare(k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, blk)
        self.ids = layout.dedupe_ids(block_ids)
        self.valid = self.ids >= 0
        self.starts = layout.window_starts(self.ids, self.prep.base, blk, self.prep.s_pad)
        self.hg = q.shape[2] // k.shape[2]
        self.nt = cta_tokens(self.hg)


def _pad_tokens(x, axis, tp, value=0):
    pad = tp - x.shape[axis]
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _tables(pp, t):
    tp = -(-t // pp.nt) * pp.nt
    return tile_tables(_pad_tokens(pp.starts, 2, tp), _pad_tokens(pp.valid, 2, tp, False), pp.nt)


def _run_qtile(q, k, v, q_positions, pp, tables, *, blk, interpret):
    bsz, t, h, d = q.shape
    g = k.shape[2]
    sr, nt = head_slot(pp.hg), pp.nt
    tp = -(-t // nt) * nt
    u, cnt, bits = tables
    j0, j1 = jax.vmap(layout.segment_runs)(pp.prep.kv_seg, pp.prep.q_seg)
    last = pp.prep.base + q_positions.astype(jnp.int32)
    tok = _pad_tokens(jnp.stack([j0, j1, last], axis=1).astype(jnp.int32), 2, tp)
    tok = tok.at[:, 0, t:].set(1).at[:, 1, t:].set(0)                # padded tokens see nothing
    q_slots = _pad_tokens(to_head_slots(q, g, sr, 2), 1, tp)
    p_in_smem = bool(interpret)
    body = functools.partial(_body, blk=blk, sr=sr, nt=nt, scale=_LOG2E / math.sqrt(d), p_in_smem=p_in_smem)
    kernel = plgpu.kernel(
        body,
        out_type=[typed_out_struct((bsz, tp, g * sr, v.shape[-1]), q.dtype, q),
                  typed_out_struct((bsz, tp, g * sr), jnp.float32, q)],
        grid=(tp // nt, g, bsz), grid_names=("c", "g", "b"),
        num_threads=3, thread_name="wg", kernel_name="msa_sparse_fwd_qtile",
        interpret=mosaic_interpret_params("sparse_fwd_qtile") if interpret else None,
    )
    o, lse = kernel(u, bits, cnt, tok, q_slots, pp.prep.k, pp.prep.v)
    return from_head_slots(o[:, :t], g, pp.hg, 2), from_head_slots(lse[:, :t], g, pp.hg, 2)


def _check(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_size, name):
    layout.check_shapes(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    why = wgmma_supported(q.shape, k.shape, v.shape[-1], q.dtype, block_size)
    if why is not None:
        raise ValueError(f"{name}: {why}")
    if not k.dtype == v.dtype == q.dtype:
        raise ValueError(f"{name}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def sparse_fwd_qtile(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, *,
                     block_size, interpret=False):
    """Query-tiled MSA forward on Hopper, always: (o [B,T,H,Dv] q.dtype, lse [B,T,H] f32 natural log, -inf: no
    key). Arguments as ``gpu_sparse_fwd.sparse_fwd_kv_outer``; ``interpret``: the Mosaic GPU interpreter.
    Precondition (not checked under jit): every selected window 8-row aligned and unclamped
    (``use_query_tiles``' first half; ``sparse_fwd_hopper`` checks it). Raises ValueError for shapes
    ``wgmma_supported`` refuses or mixed dtypes."""
    _check(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_size,
           "sparse_fwd_qtile")
    pp = _Prep(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_size)
    return _run_qtile(q, k, v, q_positions, pp, _tables(pp, q.shape[1]), blk=block_size, interpret=interpret)


def sparse_fwd_hopper(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, *,
                      block_size, interpret=False, **kv_outer_kw):
    """The Hopper MSA forward: query tiles (``sparse_fwd_qtile``) where ``use_query_tiles`` holds for this
    call, else the KV-outer forward (``gpu_sparse_fwd_wgmma.sparse_fwd_wgmma``, given ``kv_outer_kw``); the
    choice is made on the device (``lax.cond``). H/G not in {8, 16, 32, 64} (padded head slots, e.g. M2's 6)
    always takes the KV-outer forward (the query-tiled one is untimed there and would hold o in head slots, a
    q-sized temporary). Outputs and errors as ``sparse_fwd_qtile``."""
    _check(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_size,
           "sparse_fwd_hopper")

    def kv_outer(q, k, v):
        return sparse_fwd_wgmma(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                                block_size=block_size, interpret=interpret, **kv_outer_kw)
    hg = q.shape[2] // k.shape[2]
    if head_slot(hg) != hg:     # padded head slots: not timed yet, and o in slots is a q-sized temporary
        return kv_outer(q, k, v)
    pp = _Prep(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_size)
    tables = _tables(pp, q.shape[1])
    pick = use_query_tiles(tables[1], pp.starts, pp.valid, pp.ids, pp.prep.base, block_size, pp.nt)

    def qtile(q, k, v):
        return _run_qtile(q, k, v, q_positions, pp, tables, blk=block_size, interpret=interpret)
    return lax.cond(pick, qtile, kv_outer, q, k, v)
