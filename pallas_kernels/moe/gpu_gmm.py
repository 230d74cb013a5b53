"""Grouped matmul (MoE experts) on GPU: Pallas kernels with the Triton lowering, and their VJP.

Math (the block-sparse grouped GEMM of MegaBlocks, Gale et al. 2022, "MegaBlocks: Efficient Sparse
Training with Mixture-of-Experts", arXiv 2211.15841): rows of ``lhs [M, K]`` are sorted by group
(expert); group g owns rows ``[start_g, start_g + size_g)`` with ``start_g = sum(size[:g])``, and

    forward  out[rows of g]  = lhs[rows of g] @ rhs[g]                 (gmm,  rhs [G, K, N])
    dlhs     dlhs[rows of g] = dout[rows of g] @ rhs[g]^T              (gmm with transpose_rhs)
    drhs     drhs[g]         = lhs[rows of g]^T @ dout[rows of g]      (tgmm; 0 for an empty group)

Kernel layout (no BlockSpecs: the refs are whole arrays in global memory, blocks are gathered with
data-dependent ``pl.ds`` slices and masked ``pallas.triton`` loads / stores):

- gmm: a work list of *visits* computed in XLA (``make_visits``). Each group's rows are cut into
  row blocks of ``bm`` rows starting at the group's first row (blocks are group-relative, not
  aligned to multiples of ``bm``: a group of s rows costs ``ceil(s / bm)`` visits, about G/2 fewer
  visits in total than aligned row tiles, where a tile straddling a group boundary is visited once
  per group). A visit is ``(group, lo, hi)``: rows ``[lo, hi)``, ``hi - lo <= bm``. The program
  loads ``bm`` rows from ``lo`` with the rows ``>= hi`` masked to zero, and stores with the same
  mask, so the stores of different visits never overlap. Rows past ``sum(group_sizes)`` form one
  extra pseudo-group whose visits store zeros without computing: the output is fully defined (0
  there), as for ``jax.lax.ragged_dot``. The grid is one-dimensional and fixed:
  ``(cdiv(M, bm) + G) * cdiv(N, bn)`` programs (an upper bound of the visits times the column
  tiles; ``sum_g ceil(s_g / bm) <= cdiv(sum s_g, bm) + (parts - 1)``); programs past the last
  visit do nothing. Program id -> (visit, column tile) with the column tile fastest, so the
  programs running at the same time share an lhs row block and walk one group's weights (L2 reuse).
  With ``TileConfig.visit_group = n > 1`` the ids walk n consecutive visits per column tile first
  (the grouped ordering of Triton's matmul tutorial; the visit count, and so the grid, is rounded up
  to a multiple of n with empty visits): the visits of one expert then start together, and read each
  weight tile close enough in time to share it in L2. That pays where an expert's weight is larger than
  the L2 (M3's first projection, 75 MB: +27 % forward, +40 % dlhs with n = 4) and costs where it fits
  (M2, 19 MB: -13 %), so ``shape_configs`` sets n = 4 above ``GROUPED_VISITS_MIN_BYTES`` (BENCHMARKS.md (MoE)).
  fp32 accumulation over a static loop of ``cdiv(K, bk)`` steps, output in the requested dtype.
- tail folding (``TileConfig.fold = f > 0``): a group of ``s = q * bm + r`` rows with ``q >= 1`` full
  blocks and a remainder ``0 < r <= f`` gets ``q`` visits instead of ``q + 1``: its last visit is
  *extended* to ``bm + r`` rows (``hi - lo > bm`` marks it). Its program loads each weight tile
  ``[bk, bn]`` once per K step and feeds two dots, ``[bm, bk]`` for rows ``[lo, lo + bm)`` (all live,
  loaded unmasked) and ``[f, bk]`` for rows ``[lo + bm, lo + bm + f)`` (masked at ``hi``), into two
  fp32 accumulators; so the remainder costs a small dot but no second pass over the expert's weight
  column block. The program branches (``pl.when``) between a plain and an extended K loop, each
  pipelined on its own, so plain visits pay nothing for the option. The pseudo-group is never folded.
  Folding only removes visits (the same grid bound holds) and only moves rows from a group's
  remainder visit into the visit before it, so every row is still stored by exactly one visit.
- FP8 weights (``gpu_gmm_fp8.gmm_fp8``): rhs float8_e4m3fn with float32 block scales (``[G, ceil(K/br), ceil(N/bc)]``;
  MODEL_FACTS.md section 1). Tiles are cut so that each ``[bk, bn]`` weight tile lies in one scale block; the
  kernel loads the FP8 tile and its one scale and dequantises it as ``Fp8Weight.astype`` does (float32 product
  rounded to lhs.dtype) before the dot, so the result equals the kernel on pre-dequantised weights bit for bit
  while reading half the weight bytes and never writing a dequantised copy. Inference only: lhs gets its
  gradient, the FP8 weights are constants. Weights of 2**31-2**32 one-byte elements (M2's gate / up projection)
  are read as uint16 byte pairs (``common.needs_byte_pairs``; an XLA bitcast, no copy): Triton's
  int32 element offsets would overflow.
- gated epilogue (``gpu_gmm_gated.gmm_gated``, ``gmm_forward(gate_fn=)``): for the first MoE matmul, whose
  weight holds the gate columns then the up columns (``[G, K, 2I]``), a program loads per K step one weight
  tile of each half (columns ``[n0, n0 + bn)`` and ``[I + n0, I + n0 + bn)``) into two fp32 accumulators,
  rounds both to lhs.dtype and stores ``gate_fn(gate, up)``: ``[M, I]`` out, and the ``[M, 2I]`` intermediate
  is neither written nor read back by a separate activation. ``gmm_gated`` runs it in forward-only calls
  (differentiated, the separate path: the backward needs h); the FP8 ``gmm_fp8(gate_fn=)`` always (its
  backward recomputes h).
- transpose_rhs: the same kernel loads ``rhs[g]`` tiles ``[bn, bk]`` and contracts their last
  dimension (``dot_general`` with a transposed operand; Triton transposes in shared memory), so
  dlhs needs no transposed copy of the weights.
- tgmm: one program per (group, K tile, N tile), group outermost (the group's rows stay in L2 while
  its tiles run); a loop with dynamic bounds over the group's row blocks (``bm`` rows, starting at
  the group's first row, tail rows masked to zero) accumulates ``lhs_blk^T @ dout_blk`` in fp32.
  An empty group runs zero iterations and stores exact zeros.

Tile shapes: ``TileConfig`` (powers of two >= 16, as Triton's tensor-core dots need). K and N need
not be multiples of the tiles (tails are masked, with static checks so aligned shapes pay nothing).
fp32 inputs use IEEE fp32 dots (``Precision.HIGHEST``; Triton's default for fp32 would be TF32).
"""

from __future__ import annotations

import dataclasses
import functools
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import common_vma, from_byte_pairs, needs_byte_pairs, to_byte_pairs, typed_out_struct
from pallas_kernels.moe.gpu_tgmm_ws import WsTgmmConfig, tgmm_ws
from pallas_kernels.moe.groups import group_bounds, make_visits, num_visits

__all__ = ["TileConfig", "DEFAULT_CONFIG", "DEFAULT_DLHS_CONFIG", "DEFAULT_TGMM_CONFIG", "DEFAULT_CONFIGS",
           "CANDIDATES", "TGMM_CANDIDATES", "GROUPED_VISITS_MIN_BYTES", "shape_configs", "num_visits", "make_visits",
           "gmm_forward", "tgmm", "gmm", "FP8_DTYPE"]

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile shape and Triton launch parameters of one kernel.

    gmm / transposed gmm: output tile ``[bm rows, bn columns]``, contraction step ``bk``.
    tgmm: output tile ``[bk, bn]`` of ``drhs[g]``, ``bm`` rows of the group per loop step.
    bm, bk, bn: powers of two >= 16; num_warps: power of two in [1, 16]; num_stages >= 1 (software
    pipelining depth of the contraction loop); half_tail (gmm only, bm >= 32): visits of at most
    ``bm / 2`` rows run a ``[bm/2, bn]`` tile instead; fold (gmm only): 0 = off, else a power of two
    in ``[64, bm / 2]`` (so bm >= 128): a group remainder of at most ``fold`` rows after at least one full ``bm``
    block is computed by the group's previous visit, with an extra ``[fold, bn]`` tile that shares
    its weight loads (module docstring, "tail folding"); visit_group (gmm only): 1, or a power of two
    up to 16: program ids walk that many consecutive visits per column tile (module docstring). tgmm
    ignores half_tail, fold and visit_group. Raises ValueError for values outside these ranges.
    """
    bm: int = 128
    bk: int = 64
    bn: int = 128
    num_warps: int = 4
    num_stages: int = 4
    half_tail: bool = False
    fold: int = 0
    visit_group: int = 1

    def __post_init__(self):
        for name in ("bm", "bk", "bn"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16, got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TileConfig.num_warps must be a power of two in [1, 16], got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"TileConfig.num_stages must be an int >= 1, got {self.num_stages!r}")
        if self.half_tail and self.bm < 32:
            raise ValueError(f"TileConfig.half_tail needs bm >= 32 (a half tile of >= 16 rows), got bm={self.bm}")
        f = self.fold
        # fold >= 64: on Hopper (Triton 3.6) an extra dot of 16 or 32 rows beside the main one gave wrong
        # results in bench/moe.py's sweep while 64 rows were exact (see BENCHMARKS.md (MoE)).
        if (not isinstance(f, int) or isinstance(f, bool)
                or (f != 0 and (f < 64 or f & (f - 1) or 2 * f > self.bm))):
            raise ValueError(f"TileConfig.fold must be 0 (off) or a power of two in [64, bm/2 = {self.bm // 2}], "
                             f"got {f!r}")
        vg = self.visit_group
        if not isinstance(vg, int) or isinstance(vg, bool) or vg < 1 or vg > 16 or vg & (vg - 1):
            raise ValueError(f"TileConfig.visit_group must be a power of two in [1, 16], got {vg!r}")

    def label(self) -> str:
        """Short name, e.g. ``128x64x128w4s4`` (suffix ``h``: half-height tiles for short visits;
        ``fold64``: group remainders of <= 64 rows folded into the previous visit; ``g4``: visit_group 4)."""
        return (f"{self.bm}x{self.bk}x{self.bn}w{self.num_warps}s{self.num_stages}" + ("h" if self.half_tail else "")
                + (f"fold{self.fold}" if self.fold else "")
                + (f"g{self.visit_group}" if self.visit_group > 1 else ""))


#: Hopper defaults: the fastest configs of bench/moe.py's sweep of CANDIDATES / TGMM_CANDIDATES at the M2
#: expert shapes, 8K tokens (64K routed rows); see BENCHMARKS.md (MoE).
DEFAULT_CONFIG = TileConfig(128, 64, 256, 8, 4, half_tail=True)
DEFAULT_DLHS_CONFIG = TileConfig(128, 64, 256, 8, 4, half_tail=True)
DEFAULT_TGMM_CONFIG = TileConfig(32, 128, 128, 4, 4)
#: The base configs (read-only): kernel name -> config; ``shape_configs`` adapts them to the weight size.
DEFAULT_CONFIGS = MappingProxyType({"fwd": DEFAULT_CONFIG, "dlhs": DEFAULT_DLHS_CONFIG, "tgmm": DEFAULT_TGMM_CONFIG})
#: Expert weights ``[K, N]`` of more bytes than this (about Hopper's 50 MB L2) run the forward and dlhs with
#: ``visit_group = 4``: at M3's first projection (75 MB per expert) that measured 457 / 446 TFLOP/s against 360 / 318
#: with the plain order, at M2's (19 MB) 423 / 434 against 484 / 470 (BENCHMARKS.md (MoE)).
GROUPED_VISITS_MIN_BYTES = 48 * 2**20


def shape_configs(kdim: int, ndim: int, dtype) -> MappingProxyType:
    """The default configs (``DEFAULT_CONFIGS``' keys) for expert weights ``[K, N]`` of ``dtype``: the base ones,
    with ``visit_group = 4`` for the forward and dlhs when a weight exceeds ``GROUPED_VISITS_MIN_BYTES``."""
    if kdim * ndim * jnp.dtype(dtype).itemsize <= GROUPED_VISITS_MIN_BYTES:
        return DEFAULT_CONFIGS
    return MappingProxyType({"fwd": dataclasses.replace(DEFAULT_CONFIG, visit_group=4),
                             "dlhs": dataclasses.replace(DEFAULT_DLHS_CONFIG, visit_group=4),
                             "tgmm": DEFAULT_TGMM_CONFIG})

FP8_DTYPE = jnp.float8_e4m3fn   # the FP8 weights gmm_forward takes with rhs_scale

#: gmm / transposed-gmm candidates for a sweep (shared memory per stage <= 64 KiB in bf16), in priority
#: order (bench/moe.py --tiny sweeps the first three), around the defaults: tail folding (``fold``), a
#: smaller K step with a deeper pipeline, and half-height tails. ``fold`` 64 with four stages of a 128 +
#: 64-row tile would need ~224 KiB of shared memory, so it runs with three (or with bk = 32). Results
#: and the configs tried and dropped (among them 256-row tiles, slower at M2 and M3): BENCHMARKS.md (MoE). The
#: visit_group ones win at M3's first projection (``shape_configs``).
CANDIDATES = (
    TileConfig(128, 64, 256, 8, 3),
    TileConfig(128, 64, 256, 8, 3, fold=64),
    TileConfig(128, 64, 256, 8, 4),
    TileConfig(128, 64, 256, 8, 4, half_tail=True),
    TileConfig(128, 32, 256, 8, 5, fold=64),
    TileConfig(128, 32, 256, 8, 4, fold=64),
    TileConfig(128, 64, 256, 8, 4, half_tail=True, visit_group=2),
    TileConfig(128, 64, 256, 8, 4, half_tail=True, visit_group=4),
    TileConfig(128, 64, 256, 8, 4, half_tail=True, visit_group=8),
)
#: tgmm candidates (output tile bk x bn, bm rows per step); results and the designs tried and dropped:
#: BENCHMARKS.md (MoE).
TGMM_CANDIDATES = (
    TileConfig(32, 128, 128, 4, 4),
    TileConfig(32, 128, 128, 8, 4),
    TileConfig(32, 128, 256, 8, 3),
    TileConfig(16, 128, 128, 4, 4),
    TileConfig(32, 256, 128, 8, 3),
    TileConfig(64, 128, 128, 8, 3),
)


# ----------------------------------------------------------------------------- kernels
def _dot(a, b, trans_a=False, trans_b=False):
    """2-D matmul, fp32 accumulation (a Triton tensor-core dot); IEEE fp32 for fp32 inputs."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _iota(n):
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _mask(shape, rows=None, cols=None):
    """Bool ``shape`` mask from optional row ``[shape[0]]`` / column ``[shape[1]]`` masks; None (an
    unmasked access) when both are None."""
    if rows is None and cols is None:
        return None
    if rows is None:
        return jnp.broadcast_to(cols[None, :], shape)
    m = jnp.broadcast_to(rows[:, None], shape)
    return m if cols is None else m & cols[None, :]


def _load(ref, rows=None, cols=None):
    """Load a 2-D block, masked by optional row / column masks (masked elements read as 0)."""
    mask = _mask(ref.shape, rows, cols)
    return pltriton.load(ref, mask=mask, other=None if mask is None else jnp.zeros((), ref.dtype))


def _gmm_kernel(tab_ref, lhs_ref, rhs_ref, *refs, bm, bk, bn, n_groups, n_col_tiles, kdim, ndim,
                transpose_rhs, half_tail, fold, visit_group=1, scale_block=None, pairs=False, gate_fn=None,
                gather=False):
    refs = list(refs)
    rows_ref = refs.pop(0) if gather else None       # gather: lhs_ref is the flat [N * K] token matrix
    scale_ref = refs.pop(0) if scale_block else None
    out_ref = refs.pop(0)
    pid = pl.program_id(0)
    if visit_group == 1:
        v = jax.lax.div(pid, n_col_tiles)
        j = pid - v * n_col_tiles
    else:       # visit_group consecutive visits per column tile (the work list is padded to a multiple of it)
        per = visit_group * n_col_tiles
        blk = jax.lax.div(pid, per)
        r = pid - blk * per
        j = jax.lax.div(r, visit_group)
        v = blk * visit_group + (r - j * visit_group)
    g = tab_ref[0, v]
    lo = tab_ref[1, v]
    hi = tab_ref[2, v]
    n0 = pl.multiple_of(j * bn, bn)
    cmask = (n0 + _iota(bn)) < ndim if ndim % bn else None
    # gated epilogue: output column c = gate_fn(gate column c, up column ndim + c) of rhs [G, K, 2 * ndim]
    # (ndim % bn == 0, asserted by gmm_forward): one weight tile per half and K step, two accumulators
    col0s = (n0,) if gate_fn is None else (n0, pl.multiple_of(ndim + n0, bn))

    def tile(rm, extra=0):
        """Rows [lo, lo + rm) of the visit (masked at hi) x columns [n0, n0 + bn). With extra > 0 (an
        extended visit, hi - lo > rm: its first rm rows are all live and go unmasked) also rows
        [lo + rm, lo + rm + extra), masked at hi: a second dot on the same weight tile per K step."""
        parts = ((lo, rm, True),) if not extra else ((lo, rm, False), (lo + rm, extra, True))   # (row0, rows, masked)
        rmasks = [(r0 + _iota(r)) < hi if masked else None for r0, r, masked in parts]
        # gather: each part's source token rows (masked rows read token 0, loaded as zeros)
        srcs = [pltriton.load(rows_ref.at[pl.ds(r0, r)], mask=rmask, other=None if rmask is None else 0)
                for (r0, r, _), rmask in zip(parts, rmasks)] if gather else None

        def weight_tile(k0, kmask, c0):
            """The ``[bk, bn]`` (transposed: ``[bn, bk]``) weight tile of columns ``[c0, c0 + bn)``."""
            if pairs:                                                 # rhs [G, K, N/2] uint16: tile [bk, bn/2]
                pm = (jax.lax.div(n0, 2) + _iota(bn // 2)) < ndim // 2 if ndim % bn else None
                b = from_byte_pairs(_load(rhs_ref.at[g, pl.ds(k0, bk), pl.ds(jax.lax.div(c0, 2), bn // 2)],
                                          kmask, pm), FP8_DTYPE)
            elif transpose_rhs:                                       # rhs [G, N, K]: tile [bn, bk]
                b = _load(rhs_ref.at[g, pl.ds(c0, bn), pl.ds(k0, bk)], cmask, kmask)
            else:                                                     # rhs [G, K, N]: tile [bk, bn]
                b = _load(rhs_ref.at[g, pl.ds(k0, bk), pl.ds(c0, bn)], kmask, cmask)
            if scale_ref is not None:
                # FP8 rhs: the tile lies in one scale block (bk | br, bn | bc); dequantised as
                # Fp8Weight.astype does (float32(w) * scale, rounded to lhs.dtype), so the dot sees the
                # same operand as on pre-dequantised weights
                s = scale_ref[g, jax.lax.div(k0, scale_block[0]), jax.lax.div(c0, scale_block[1])]
                b = (b.astype(jnp.float32) * s).astype(lhs_ref.dtype)
            return b

        def body(kk, accs):     # accs[part][half]
            k0 = pl.multiple_of(kk * bk, bk)
            kmask = (k0 + _iota(bk)) < kdim if kdim % bk else None
            if gather:   # row i of the tile is token src[i] of lhs: element offsets into the flat token matrix
                a = [pltriton.load(lhs_ref.at[s[:, None] * kdim + (k0 + _iota(bk))[None, :]],
                                   mask=_mask((r, bk), rmask, kmask), other=jnp.zeros((), lhs_ref.dtype))
                     for (_, r, _), rmask, s in zip(parts, rmasks, srcs)]
            else:
                a = [_load(lhs_ref.at[pl.ds(r0, r), pl.ds(k0, bk)], rmask, kmask)
                     for (r0, r, _), rmask in zip(parts, rmasks)]
            bs = [weight_tile(k0, kmask, c0) for c0 in col0s]
            return tuple(tuple(acc + _dot(ai, b, trans_b=transpose_rhs) for acc, b in zip(pacc, bs))
                         for pacc, ai in zip(accs, a))

        accs = jax.lax.fori_loop(0, pl.cdiv(kdim, bk), body,
                                 tuple(tuple(jnp.zeros((r, bn), jnp.float32) for _ in col0s) for _, r, _ in parts))
        for pacc, (r0, r, _), rmask in zip(accs, parts, rmasks):
            if gate_fn is None:
                out = pacc[0]
            else:   # gate and up rounded to lhs.dtype first, as the separate path stores them
                gate, up = (acc.astype(lhs_ref.dtype).astype(jnp.float32) for acc in pacc)
                out = gate_fn(gate, up)
            pltriton.store(out_ref.at[pl.ds(r0, r), pl.ds(n0, bn)], out.astype(out_ref.dtype),
                           mask=_mask((r, bn), rmask, cmask))

    active = (hi > lo) & (g < n_groups)
    plain = active
    if fold:
        # Tail folding: a visit of bm + r rows (a group's last full block plus its remainder of
        # r <= fold rows) runs its own K loop with the extra [fold, bn] tile; the others never see it.
        ext = (hi - lo) > bm
        pl.when(active & ext)(lambda: tile(bm, fold))
        plain = active & jnp.logical_not(ext)
    if half_tail:
        # A visit of <= bm/2 rows (a group's tail, or a small group) runs a half-height tile: at ~256
        # rows per expert (M2, 8K tokens) most groups end in such a tail (the default; BENCHMARKS.md (MoE)).
        small = (hi - lo) <= bm // 2
        pl.when(plain & jnp.logical_not(small))(lambda: tile(bm))
        pl.when(plain & small)(lambda: tile(bm // 2))
    else:
        pl.when(plain)(lambda: tile(bm))

    @pl.when((hi > lo) & (g == n_groups))
    def _zero_tail():
        pltriton.store(out_ref.at[pl.ds(lo, bm), pl.ds(n0, bn)], jnp.zeros((bm, bn), out_ref.dtype),
                       mask=_mask((bm, bn), (lo + _iota(bm)) < hi, cmask))


def _tgmm_kernel(tab_ref, lhs_ref, dout_ref, out_ref, *, bm, bk, bn, n_k_tiles, n_n_tiles, kdim, ndim):
    pid = pl.program_id(0)
    per_group = n_k_tiles * n_n_tiles
    g = jax.lax.div(pid, per_group)
    r = pid - g * per_group
    ki = jax.lax.div(r, n_n_tiles)
    j = r - ki * n_n_tiles
    k0 = pl.multiple_of(ki * bk, bk)
    n0 = pl.multiple_of(j * bn, bn)
    start = tab_ref[0, g]
    size = tab_ref[1, g]
    end = start + size
    kmask = (k0 + _iota(bk)) < kdim if kdim % bk else None
    nmask = (n0 + _iota(bn)) < ndim if ndim % bn else None
    dtype = lhs_ref.dtype
    zero = jnp.zeros((), dtype)

    def body(i, acc):
        r0 = start + i * bm
        rmask = (r0 + _iota(bm)) < end
        a_mask = jnp.broadcast_to(rmask[:, None], (bm, bk))
        if kmask is not None:
            a_mask = a_mask & kmask[None, :]
        b_mask = jnp.broadcast_to(rmask[:, None], (bm, bn))
        if nmask is not None:
            b_mask = b_mask & nmask[None, :]
        a = pltriton.load(lhs_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], mask=a_mask, other=zero)
        b = pltriton.load(dout_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], mask=b_mask, other=zero)
        return acc + _dot(a, b, trans_a=True)

    n_blocks = jax.lax.div(size + (bm - 1), bm)
    acc = jax.lax.fori_loop(0, n_blocks, body, jnp.zeros((bk, bn), jnp.float32))
    o_mask = None
    if kmask is not None or nmask is not None:
        o_mask = jnp.ones((bk, bn), jnp.bool_)
        if kmask is not None:
            o_mask = o_mask & kmask[:, None]
        if nmask is not None:
            o_mask = o_mask & nmask[None, :]
    pltriton.store(out_ref.at[g, pl.ds(k0, bk), pl.ds(n0, bn)], acc.astype(out_ref.dtype), mask=o_mask)


def _params(cfg: TileConfig):
    return pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ----------------------------------------------------------------------------- checks
def _check(lhs, rhs, group_sizes, transpose_rhs, fp8=False):
    """Assert the kernels' preconditions (``minimax_jax.ops.moe.grouped_matmul`` checks them for users)."""
    assert lhs.ndim == 2 and rhs.ndim == 3 and group_sizes.ndim == 1, (
        f"gmm expects lhs [M, K], rhs [G, K, N] and group_sizes [G]; got {lhs.shape}, {rhs.shape}, {group_sizes.shape}")
    assert group_sizes.shape[0] == rhs.shape[0], (
        f"group_sizes has {group_sizes.shape[0]} groups, rhs has {rhs.shape[0]}")
    assert lhs.shape[1] == (rhs.shape[2] if transpose_rhs else rhs.shape[1]), (
        f"contraction mismatch: lhs {lhs.shape} vs rhs {rhs.shape} (transpose_rhs={transpose_rhs})")
    assert jnp.issubdtype(group_sizes.dtype, jnp.integer), f"group_sizes must be integer, got {group_sizes.dtype}"
    if fp8:
        assert rhs.dtype == FP8_DTYPE, f"an FP8 rhs must be {jnp.dtype(FP8_DTYPE)}, got {rhs.dtype}"
    else:
        assert lhs.dtype == rhs.dtype, f"lhs and rhs must have the same dtype, got {lhs.dtype} and {rhs.dtype}"
    assert jnp.dtype(lhs.dtype) in _DTYPES, f"gmm supports {[str(d) for d in _DTYPES]}, got {lhs.dtype}"


# ----------------------------------------------------------------------------- entry points
def gmm_forward(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
                out_dtype=None, config: TileConfig | None = None, interpret: bool = False,
                rhs_scale: jax.Array | None = None, scale_block: tuple[int, int] | None = None,
                fp8_pairs: bool | None = None, gate_fn=None, lhs_rows: jax.Array | None = None) -> jax.Array:
    """Grouped matmul kernel (no autodiff): ``out[rows of g] = lhs[rows of g] @ op(rhs[g])``, or with
    ``gate_fn`` the gated activation of it.

    Args:
      lhs: ``[M, K]`` bf16 / f16 / f32, rows sorted by group.
      rhs: ``[G, K, N]`` (``op`` = identity) or, with ``transpose_rhs``, ``[G, N, K]`` (``op`` =
        transpose: ``out[rows of g] = lhs[rows of g] @ rhs[g]^T``); same dtype as lhs.
      group_sizes: int ``[G]``, rows per group in order; ``sum <= M`` (a larger sum is clipped to M,
        negative sizes count as 0).
      transpose_rhs: see rhs.
      out_dtype: output dtype (default ``lhs.dtype``); accumulation is fp32.
      config: tile config (default ``shape_configs(...)["fwd" or "dlhs"]``); ``config.fold > 0`` turns on
        tail folding (module docstring), with the same result up to fp32 accumulation order.
      interpret: run in Pallas interpret mode (any backend; for CPU tests).
      rhs_scale / scale_block: FP8 weights (``gpu_gmm_fp8.gmm_fp8``): rhs float8_e4m3fn ``[G, K, N]`` times float32
        ``rhs_scale [G, ceil(K/br), ceil(N/bc)]`` per ``scale_block = (br, bc)`` block, dequantised per tile
        in the kernel (``fp8_unsupported`` must pass; not with ``transpose_rhs``).
      fp8_pairs: read the FP8 rhs as uint16 byte pairs (``common.needs_byte_pairs``; None: where needed). Same
        values; needs an even N.
      gate_fn: None, or a hashable elementwise ``f(gate, up) -> out`` on float32 ``[r, bn]`` tiles (a gated
        activation, e.g. ``silu(gate) * up``): rhs ``[G, K, 2I]`` holds the gate columns first, and the output is
        ``[M, I]``, ``out[:, c] = gate_fn(h[:, c], h[:, I + c])`` with ``h = lhs @ rhs[g]`` rounded to lhs.dtype
        (what the separate path stores) -- the epilogue of the first MoE matmul, so ``h [M, 2I]`` is never
        written. Needs ``I % config.bn == 0`` and no ``transpose_rhs``; a program computes both halves of its
        ``bn`` output columns (so ``bn`` here does the work of ``2 bn`` without it).
      lhs_rows: None, or int32 ``[M]``: row ``i`` of the sorted operand is ``lhs[lhs_rows[i]]`` (lhs is then the
        ``[T, K]`` token matrix, ``T * K < 2**31``): the MoE input permutation gathered by the kernel's loads, so
        the sorted ``[M, K]`` copy is never written (rows past the group sum are not read).
    Returns: ``[M, N]`` (``[M, N / 2]`` with ``gate_fn``) in out_dtype; rows past ``sum(group_sizes)`` are exactly
      0 (shapes and dtypes asserted as above).
    Math: MegaBlocks (Gale et al. 2022) block-sparse grouped GEMM; see the module docstring.
    """
    fp8 = rhs_scale is not None
    _check(lhs, rhs, group_sizes, transpose_rhs, fp8)
    gather = lhs_rows is not None
    if gather:
        assert lhs_rows.ndim == 1 and jnp.issubdtype(lhs_rows.dtype, jnp.integer), f"lhs_rows {lhs_rows.shape}"
        assert lhs.size < 2**31, f"lhs_rows: the token matrix {lhs.shape} needs < 2**31 elements (int32 offsets)"
    cfg = config or shape_configs(*((rhs.shape[2], rhs.shape[1]) if transpose_rhs else rhs.shape[1:]),
                                  rhs.dtype)["dlhs" if transpose_rhs else "fwd"]
    if fp8:
        assert not transpose_rhs, "FP8 rhs: no transposed kernel"
        assert scale_block[0] % cfg.bk == 0 and scale_block[1] % cfg.bn == 0, (
            f"FP8 rhs: {cfg.label()} tiles must lie in one {scale_block} scale block")
        assert rhs_scale.shape == (rhs.shape[0],) + tuple(-(-d // b) for d, b in zip(rhs.shape[1:], scale_block)), (
            f"rhs_scale {rhs_scale.shape} does not fit rhs {rhs.shape} in blocks {scale_block}")
    m, kdim = (lhs_rows.shape[0], lhs.shape[1]) if gather else lhs.shape
    g = rhs.shape[0]
    ndim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if gate_fn is not None:
        assert not transpose_rhs and ndim % 2 == 0 and (ndim // 2) % cfg.bn == 0, (
            f"gated gmm: rhs {rhs.shape} needs [G, K, 2I] with I a multiple of bn = {cfg.bn} (no transpose)")
        ndim //= 2
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    pairs = fp8 and (needs_byte_pairs(rhs) if fp8_pairs is None else bool(fp8_pairs))
    if pairs:   # [G, K, N] 1-byte -> [G, K, N/2] uint16 (an XLA bitcast, no copy): element offsets stay below 2**31
        rhs = to_byte_pairs(rhs)
    extra = ((lhs_rows.astype(jnp.int32),) if gather else ()) + ((rhs_scale.astype(jnp.float32),) if fp8 else ())
    operands = common_vma(lhs.reshape(-1) if gather else lhs, rhs, group_sizes, *extra)
    lhs, rhs, group_sizes, extra = operands[0], operands[1], operands[2], operands[3:]
    tab = make_visits(group_sizes, m, cfg.bm, cfg.fold)
    if tab.shape[1] % cfg.visit_group:    # unused visits (the pseudo-group, no rows) up to a multiple of visit_group
        pad = cfg.visit_group - tab.shape[1] % cfg.visit_group
        tab = jnp.concatenate([tab, jnp.broadcast_to(jnp.array([[g], [0], [0]], tab.dtype), (3, pad))], axis=1)
    n_col = pl.cdiv(ndim, cfg.bn)
    kernel = functools.partial(_gmm_kernel, bm=cfg.bm, bk=cfg.bk, bn=cfg.bn, n_groups=g, n_col_tiles=n_col,
                               kdim=kdim, ndim=ndim, transpose_rhs=transpose_rhs, half_tail=cfg.half_tail,
                               fold=cfg.fold, visit_group=cfg.visit_group,
                               scale_block=tuple(scale_block) if fp8 else None, pairs=pairs, gate_fn=gate_fn,
                               gather=gather)
    return pl.pallas_call(
        kernel,
        grid=(tab.shape[1] * n_col,),
        out_shape=typed_out_struct((m, ndim), out_dtype, lhs),
        compiler_params=_params(cfg),
        interpret=interpret,
        name=(("gmm_t_gpu" if transpose_rhs else ("gmm_fp8_gpu" if fp8 else "gmm_gpu")) + ("_gated" if gate_fn else "")
              + ("_gather" if gather else "")),
    )(tab, lhs, rhs, *extra)


def tgmm(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, out_dtype=None,
         config: TileConfig | WsTgmmConfig | None = None, interpret: bool = False) -> jax.Array:
    """Transposed grouped matmul (weight gradient): ``out[g] = lhs[rows of g]^T @ dout[rows of g]``.

    Args:
      lhs: ``[M, K]``; dout: ``[M, N]``, same dtype (bf16 / f16 / f32), rows sorted by group.
      group_sizes: int ``[G]`` (as in ``gmm_forward``; rows past the sum are not read by this kernel;
        with a ``WsTgmmConfig`` see ``gpu_tgmm_ws.tgmm_ws`` on rows outside a group).
      out_dtype: default ``lhs.dtype``; accumulation is fp32.
      config: tile config (output tile ``bk x bn``, ``bm`` rows per step; default
        ``DEFAULT_TGMM_CONFIG``); a ``gpu_tgmm_ws.WsTgmmConfig`` runs ``gpu_tgmm_ws.tgmm_ws``
        instead (bf16 / f16 only, its own shape constraints). interpret: Pallas interpret mode.
    Returns: ``[G, K, N]``; an empty group's matrix is exactly 0 (shapes and dtypes asserted as above).
    Math: MegaBlocks (Gale et al. 2022) weight gradient of the grouped GEMM.
    """
    assert lhs.ndim == 2 and dout.ndim == 2 and group_sizes.ndim == 1 and lhs.shape[0] == dout.shape[0], (
        f"tgmm expects lhs [M, K], dout [M, N], group_sizes [G]; got {lhs.shape}, {dout.shape}, {group_sizes.shape}")
    assert jnp.issubdtype(group_sizes.dtype, jnp.integer), f"group_sizes must be integer, got {group_sizes.dtype}"
    assert lhs.dtype == dout.dtype and jnp.dtype(lhs.dtype) in _DTYPES, (
        f"tgmm needs lhs and dout of one dtype in {[str(d) for d in _DTYPES]}, got {lhs.dtype}, {dout.dtype}")
    cfg = config or DEFAULT_TGMM_CONFIG
    lhs, dout, group_sizes = common_vma(lhs, dout, group_sizes)
    if isinstance(cfg, WsTgmmConfig):    # the warp-specialized Mosaic GPU weight gradient
        return tgmm_ws(lhs, dout, group_sizes, config=cfg, out_dtype=out_dtype, interpret=interpret)
    m, kdim = lhs.shape
    ndim = dout.shape[1]
    g = group_sizes.shape[0]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    starts, sizes = group_bounds(group_sizes, m)
    tab = jnp.stack([starts, sizes]).astype(jnp.int32)
    nk, nn = pl.cdiv(kdim, cfg.bk), pl.cdiv(ndim, cfg.bn)
    kernel = functools.partial(_tgmm_kernel, bm=cfg.bm, bk=cfg.bk, bn=cfg.bn, n_k_tiles=nk, n_n_tiles=nn,
                               kdim=kdim, ndim=ndim)
    return pl.pallas_call(
        kernel,
        grid=(g * nk * nn,),
        out_shape=typed_out_struct((g, kdim, ndim), out_dtype, lhs),
        compiler_params=_params(cfg),
        interpret=interpret,
        name="tgmm_gpu",
    )(tab, lhs, dout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _gmm(lhs, rhs, group_sizes, out_dtype, cfg, dlhs_cfg, tgmm_cfg, interpret):
    return gmm_forward(lhs, rhs, group_sizes, out_dtype=out_dtype, config=cfg, interpret=interpret)


def _gmm_fwd(lhs, rhs, group_sizes, out_dtype, cfg, dlhs_cfg, tgmm_cfg, interpret):
    return _gmm(lhs, rhs, group_sizes, out_dtype, cfg, dlhs_cfg, tgmm_cfg, interpret), (lhs, rhs, group_sizes)


def _gmm_bwd(out_dtype, cfg, dlhs_cfg, tgmm_cfg, interpret, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)   # the kernels multiply operands of one dtype (documented in gmm)
    dlhs = gmm_forward(dout, rhs, group_sizes, transpose_rhs=True, out_dtype=lhs.dtype, config=dlhs_cfg,
                       interpret=interpret)
    drhs = tgmm(lhs, dout, group_sizes, out_dtype=rhs.dtype, config=tgmm_cfg, interpret=interpret)
    return dlhs, drhs, np.zeros(group_sizes.shape, jax.dtypes.float0)


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, config: TileConfig | None = None,
        dlhs_config: TileConfig | None = None, tgmm_config: TileConfig | WsTgmmConfig | None = None, out_dtype=None,
        interpret: bool = False) -> jax.Array:
    """Differentiable grouped matmul: ``out[rows of g] = lhs[rows of g] @ rhs[g]`` (Pallas GPU kernels).

    Args:
      lhs: ``[M, K]`` bf16 / f16 / f32, rows sorted by group.
      rhs: ``[G, K, N]``, same dtype as lhs.
      group_sizes: int ``[G]`` rows per group, ``sum <= M`` (larger sums are clipped to M).
      config / dlhs_config / tgmm_config: TileConfigs of the forward, the dlhs kernel (transposed
        gmm) and the weight-gradient kernel (tgmm); None = ``shape_configs(K, N, rhs.dtype)``.
        A ``gpu_tgmm_ws.WsTgmmConfig`` as tgmm_config runs the warp-specialized Mosaic GPU weight
        gradient instead (bf16 / f16, its shape constraints raise ValueError).
      out_dtype: output dtype (default ``lhs.dtype``), fp32 accumulation.
      interpret: Pallas interpret mode (any backend; CPU tests).
    Returns: ``[M, N]`` in out_dtype; rows past ``sum(group_sizes)`` are exactly 0.
    Gradients: dlhs = transposed gmm of the cotangent (rows past the sum get 0), drhs = tgmm (empty
      groups get exact 0), none for group_sizes. The cotangent is cast to ``lhs.dtype`` first (a
      bf16 model multiplies bf16 operands with fp32 accumulation, as the forward does).
    Preconditions (asserted; ``minimax_jax.ops.moe.grouped_matmul`` checks them for users): the shapes
      above, integer group_sizes, lhs and rhs of one dtype. Raises TypeError for a config of the wrong type.
    Math: MegaBlocks (Gale et al. 2022, arXiv 2211.15841) block-sparse grouped GEMM and its
      transposes; module docstring for the kernel layout.
    """
    _check(lhs, rhs, group_sizes, False)
    for c in (config, dlhs_config):
        if c is not None and not isinstance(c, TileConfig):
            raise TypeError(f"configs must be TileConfig or None, got {type(c).__name__}")
    if tgmm_config is not None and not isinstance(tgmm_config, (TileConfig, WsTgmmConfig)):
        raise TypeError(f"tgmm_config must be a TileConfig, a WsTgmmConfig or None, got {type(tgmm_config).__name__}")
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    # Inside shard_map: give the operands one varying type first (as jnp binary ops do), so the
    # kernels' outputs and the custom VJP's cotangents are typed like their primals; JAX transposes
    # these casts (psum) outside the custom VJP. No-op elsewhere.
    lhs, rhs, group_sizes = common_vma(lhs, rhs, group_sizes.astype(jnp.int32))
    base = shape_configs(rhs.shape[1], rhs.shape[2], rhs.dtype)
    return _gmm(lhs, rhs, group_sizes, out_dtype, config or base["fwd"], dlhs_config or base["dlhs"],
                tgmm_config or base["tgmm"], bool(interpret))

