"""Grouped matmul (forward and input gradient) on Hopper: a warp-specialized, persistent Pallas Mosaic GPU kernel.

Math: ``out[rows of g] = lhs[rows of g] @ op(rhs[g])`` with ``op`` the identity (forward, rhs ``[G, K, N]``) or
the transpose (input gradient, rhs ``[G, N, K]``); same contract as ``gpu_gmm.gmm_forward`` (MegaBlocks' grouped
GEMM, Gale et al. 2022, arXiv 2211.15841): rows sorted by group, fp32 accumulation, rows past
``sum(group_sizes)`` exactly 0.

Layout (the pieces of ``gpu_tgmm_ws``, ``ws_ring``):

- work list (XLA, ``ws_visits``): each group's rows are cut into row blocks of ``block_m`` rows starting at the
  group's first row rounded down to a multiple of 8 (TMA row offsets into 8-row tiled SMEM); a *visit* is
  ``(group, first row of the block, live rows [lo, hi))``. Group-relative blocks cost ``ceil(rows / block_m)``
  visits per group, not one extra visit per group boundary as row tiles aligned to ``block_m`` would. The rows
  past the sum form a pseudo-group whose visits run no ``wgmma`` and store zeros.
- one CTA per SM walks the output tiles ``(visit, N tile)`` (N tile fastest: the CTAs running together share a
  visit's lhs rows and one group's weights in L2) with ``plgpu.nd_loop``;
- three warpgroups: a memory warpgroup issues the TMA loads of ``[block_m, block_k]`` lhs and
  ``[block_k, block_n]`` (or, transposed, ``[block_n, block_k]``) rhs blocks into a ring of ``stages`` SMEM slots
  with one running slot counter across the CTA's tiles; two compute warpgroups each own 64 of the tile's 128 rows
  (``wgmma`` of their lhs rows with the whole weight block into a ``[64, block_n]`` fp32 accumulator; a
  warpgroup whose rows are all outside the visit's live rows skips its ``wgmma``, so a group's short last visit
  costs about half a tile), then convert, write an unswizzled SMEM tile and store their live rows only: TMA boxes
  need static shapes, so the rows go out as at most 7 stores of power-of-two row counts (the binary digits of
  the count, as jax's ``ragged_dot_mgpu`` does). Rows of a block outside its group are computed with this
  group's weights and never stored, so visits of different groups never write the same row.

Checked against an fp64 oracle in the Mosaic GPU interpreter (tests/kernels/moe/test_gmm_ws.py, jax >= 0.11) and
against the Triton gmm on a GPU by ``bench/gmm_ws_probe.py``. ``gpu_gmm.gmm`` / ``gmm_forward`` run it when passed
a ``WsGmmConfig`` as ``config`` / ``dlhs_config``.

Requirements (ValueError / TypeError otherwise, never a silent fallback): bf16 / f16 operands of one dtype, the
contraction dim a multiple of ``block_k`` and the output columns a multiple of ``block_n``. Any M (padded to a
multiple of 8 with zero rows: a copy).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (match_vma, mosaic_interpret_params, mosaic_smem_transforms, searchsorted,
                                   typed_out_struct)
from pallas_kernels.moe.groups import group_bounds
from pallas_kernels.moe.ws_ring import (COMPUTE_REGISTERS, MEMORY_REGISTERS, check_config, drain_steps, fill_steps,
                                        mma_steps, over_tiles)

__all__ = ["WsGmmConfig", "WS_GMM_CANDIDATES", "gmm_ws", "ws_gmm_config", "ws_visits", "num_ws_visits"]

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class WsGmmConfig:
    """Tile shape of ``gmm_ws``: output tile ``[128, block_n]`` (two compute warpgroups of 64 rows each),
    ``block_k`` contraction elements per pipeline step, ``stages`` SMEM slots.

    block_k: 64 or 128; block_n: 128 or 256 (a ``[64, block_n]`` fp32 accumulator per warpgroup: at most 128
    registers per thread). num_sms: CTAs (default: the device's SM count). Raises ValueError for other values or a
    ring plus epilogue tiles over 227 KiB of shared memory.
    """
    block_k: int = 64
    block_n: int = 256
    stages: int = 3
    num_sms: int | None = None

    block_m = 128        # rows per visit: two compute warpgroups of 64 rows

    def __post_init__(self):
        check_config(self, {"block_k": (64, 128), "block_n": (128, 256)}, self.smem_bytes(2))

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory of the ring (lhs + rhs blocks per stage) plus the two epilogue tiles."""
        ring = self.stages * self.block_k * (self.block_m + self.block_n) * itemsize
        return ring + self.block_m * self.block_n * itemsize

    def label(self) -> str:
        """Short name, e.g. ``ws128x64x256s3`` (rows x block_k x block_n, stages)."""
        return f"ws{self.block_m}x{self.block_k}x{self.block_n}s{self.stages}"


#: Candidates for a sweep (bench/gmm_ws_probe.py; ring + epilogue <= 208 KiB in bf16), the default first.
#: (block_k 32 is not offered: Mosaic GPU's layout inference finds no layout for a [32, 256] weight block.)
WS_GMM_CANDIDATES = (
    WsGmmConfig(64, 256, 3),
    WsGmmConfig(64, 128, 4),
    WsGmmConfig(128, 128, 2),
)


def ws_gmm_config(k: int, n: int, dtype, num_sms: int | None = None) -> WsGmmConfig | str:
    """The ``WsGmmConfig`` for a grouped matmul contracting ``k`` into ``n`` output columns in ``dtype``: 128 x 256
    tiles (the default), 128 columns where N needs it; or why the kernel cannot take it (a short sentence: fp32
    operands, K not a multiple of 64, N not a multiple of 128). ``num_sms`` passes through."""
    if jnp.dtype(dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not bf16 / f16"
    bn = next((b for b in (256, 128) if n % b == 0), None)
    if k % 64 or bn is None:
        return " and ".join(f"{name}={v} is not a multiple of {m}" for name, v, m, bad in
                            (("K", k, 64, k % 64), ("N", n, 128, bn is None)) if bad)
    base = WsGmmConfig() if bn == 256 else WsGmmConfig(64, 128, 4)
    return dataclasses.replace(base, num_sms=num_sms)


def num_ws_visits(m: int, num_groups: int, block_m: int) -> int:
    """Static upper bound of the visits of ``ws_visits``: ``cdiv(m + 7 (G + 1), block_m) + G + 1`` (each of the
    G groups and the pseudo-group starts up to 7 rows early and ends in a partial block)."""
    return pl.cdiv(m + 7 * (num_groups + 1), block_m) + num_groups + 1


def ws_visits(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """Work list of ``gmm_ws`` (XLA, O(V log G)).

    Args: group_sizes: int ``[G]`` rows per group (sum clipped to m, negative sizes count as 0); m: rows of lhs;
      block_m: rows per visit.
    Returns: int32 ``[4, V]``, ``V = num_ws_visits(m, G, block_m)``; column v = ``(group, row0, lo, hi)``: the
      visit multiplies rows ``[row0, row0 + block_m)`` (``row0 % 8 == 0``) and stores rows ``[lo, hi)``
      (``row0 <= lo < hi <= row0 + block_m``); ``group == G`` is the pseudo-group of the rows past the sum (stored
      as zeros); unused visits have ``lo == hi == 0``. Every row in ``[0, m)`` is stored by exactly one visit.
    """
    g = group_sizes.shape[0]
    starts, sizes = group_bounds(group_sizes, m)
    total = jnp.sum(sizes)
    starts_x = jnp.concatenate([starts, total[None]])
    ends_x = jnp.concatenate([starts + sizes, jnp.full((1,), m, jnp.int32)])
    row0_x = (starts_x // 8) * 8
    blocks = jnp.where(ends_x > starts_x, (ends_x - row0_x + block_m - 1) // block_m, 0)
    vend = jnp.cumsum(blocks)
    vstart = vend - blocks
    v = jnp.arange(num_ws_visits(m, g, block_m), dtype=jnp.int32)
    grp = searchsorted(vend, v, side="right")                 # in [0, G + 1]: G + 1 = unused
    valid = grp <= g
    gc = jnp.minimum(grp, g)
    row0 = row0_x[gc] + (v - vstart[gc]) * block_m
    lo = jnp.maximum(starts_x[gc], row0)
    hi = jnp.minimum(ends_x[gc], row0 + block_m)
    z = jnp.zeros_like(v)
    return jnp.stack([gc, jnp.where(valid, row0, z), jnp.where(valid, lo, z), jnp.where(valid, hi, z)]).astype(
        jnp.int32)


def _transposed(ref):
    """The 2-D SMEM ref transposed (a view for ``wgmma``); ``plgpu.transpose_ref`` before jax 0.11."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    return plgpu.transpose_ref(ref, (1, 0))


def gmm_ws(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
           config: WsGmmConfig | None = None, out_dtype=None, interpret: bool = False) -> jax.Array:
    """Grouped matmul ``out[rows of g] = lhs[rows of g] @ op(rhs[g])`` (warp-specialized Mosaic GPU, Hopper).

    Args:
      lhs: ``[M, K]`` bf16 / f16, rows sorted by group.
      rhs: ``[G, K, N]``, or with ``transpose_rhs`` ``[G, N, K]`` (``op`` = transpose: the input gradient of
        ``gmm`` without a transposed copy of the weights); lhs's dtype.
      group_sizes: int ``[G]`` rows per group in order (negative sizes count as 0; the sum is clipped to M).
      config: ``WsGmmConfig`` (default ``WsGmmConfig()``); out_dtype: bf16 / f16 (default lhs.dtype).
      interpret: run in the Mosaic GPU interpreter (any backend, jax >= 0.11; tests). On a CPU pass
        ``config.num_sms``.
    Returns: ``[M, N]`` in out_dtype, fp32 accumulation; rows past ``sum(group_sizes)`` are exactly 0.
    Raises: ValueError on shapes (ranks, G or K mismatch, K % block_k, N % block_n) or a device without an SM
      count and no ``config.num_sms``; TypeError on dtypes or config; NotImplementedError for
      ``interpret=True`` on a jax without the Mosaic GPU interpreter.
    Math: MegaBlocks (Gale et al. 2022) grouped GEMM; kernel layout in the module docstring.
    """
    cfg = config or WsGmmConfig()
    if not isinstance(cfg, WsGmmConfig):
        raise TypeError(f"config must be a WsGmmConfig, got {type(cfg).__name__}")
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1 or group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"gmm_ws expects lhs [M, K], rhs [G, K, N] (transposed: [G, N, K]), group_sizes [G]; got "
                         f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}")
    kdim = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    ndim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if lhs.shape[1] != kdim:
        raise ValueError(f"gmm_ws: contraction mismatch, lhs {lhs.shape} vs rhs {rhs.shape} "
                         f"(transpose_rhs={transpose_rhs})")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integer, got {group_sizes.dtype}")
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if lhs.dtype != rhs.dtype or jnp.dtype(lhs.dtype) not in _DTYPES or out_dtype not in _DTYPES:
        raise TypeError(f"gmm_ws needs bf16 / f16 lhs and rhs of one dtype and a bf16 / f16 output, got "
                        f"{lhs.dtype}, {rhs.dtype} -> {out_dtype} (gpu_gmm.gmm_forward covers fp32)")
    bm, bk, bn, stages = cfg.block_m, cfg.block_k, cfg.block_n, cfg.stages
    if kdim % bk or ndim % bn:
        raise ValueError(f"gmm_ws {cfg.label()} needs K % {bk} == 0 and N % {bn} == 0, got K={kdim}, N={ndim} "
                         f"(gpu_gmm.gmm_forward has no such constraint)")
    interpret_params = mosaic_interpret_params("gmm_ws") if interpret else None
    m = lhs.shape[0]
    g = rhs.shape[0]
    if m == 0:
        return jnp.zeros((0, ndim), out_dtype)
    m_pad = -(-m // 8) * 8
    if m_pad != m:
        # TMA row offsets into 8-row tiled SMEM (and M itself, Mosaic GPU: "dimension 0 must have size smaller or a
        # multiple of its tiling 8") must be multiples of 8: pad with zero rows, which no group owns.
        lhs = jnp.pad(lhs, ((0, m_pad - m), (0, 0)))
    tab = ws_visits(group_sizes, m, bm)
    nk, nn = kdim // bk, ndim // bn
    num_tiles = tab.shape[1] * nn
    hm = bm // 2                                   # rows per compute warpgroup
    itemsize = jnp.dtype(lhs.dtype).itemsize

    def decode(t):
        v = lax.div(t, nn)
        return v, t - v * nn

    def body(tab_ref, lhs_ref, rhs_ref, out_ref):
        def visit(v):
            """(group, first row of the block, live rows [lo, hi), ring steps)."""
            gi, row0, lo, hi = tab_ref[0, v], tab_ref[1, v], tab_ref[2, v], tab_ref[3, v]
            return gi, row0, lo, hi, jnp.where((gi < g) & (hi > lo), nk, 0)

        def scope(lhs_smem, rhs_smem, out_smem, produced, consumed):
            wg = lax.axis_index("wg")

            @pl.when(wg == 2)
            def _memory():
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

                @over_tiles(num_tiles, decode)
                def used(v, ni, carry):
                    gi, row0, _, _, nsteps = visit(v)

                    def load(s, slot, barrier):
                        ks = pl.ds(pl.multiple_of(s * bk, bk), bk)
                        plgpu.copy_gmem_to_smem(lhs_ref.at[pl.ds(pl.multiple_of(row0, 8), bm), ks],
                                                lhs_smem.at[slot], barrier)
                        w = rhs_ref.at[gi, pl.ds(pl.multiple_of(ni * bn, bn), bn), ks] if transpose_rhs else \
                            rhs_ref.at[gi, ks, pl.ds(pl.multiple_of(ni * bn, bn), bn)]
                        plgpu.copy_gmem_to_smem(w, rhs_smem.at[slot], barrier)
                    return fill_steps(produced, consumed, stages, nsteps, carry, load)
                drain_steps(consumed, stages, used)

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

                @over_tiles(num_tiles, decode)
                def _tiles(v, ni, carry):
                    _, row0, lo, hi, nsteps = visit(v)
                    r0 = row0 + wg * hm                              # this warpgroup's 64 rows
                    w_lo, w_hi = jnp.maximum(lo, r0), jnp.minimum(hi, r0 + hm)
                    live = jnp.maximum(w_hi - w_lo, 0)

                    def acc_scope(acc_ref):
                        def mma(s, slot):
                            @pl.when(live > 0)           # a short visit's second half: no wgmma (ring kept)
                            def _():
                                w = _transposed(rhs_smem.at[slot]) if transpose_rhs else rhs_smem.at[slot]
                                plgpu.wgmma(acc_ref, lhs_smem.at[slot, pl.ds(wg * hm, hm)], w)
                        c_end = mma_steps(produced, consumed, stages, nsteps, carry, mma)
                        return acc_ref[...], c_end

                    acc, c_end = pl.run_scoped(acc_scope, plgpu.ACC((hm, bn), jnp.float32))

                    @pl.when(live > 0)
                    def _store():
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous tile's stores read it
                        out_smem.at[wg][...] = acc.astype(out_dtype)
                        plgpu.commit_smem()
                        # The live rows as stores of 2**p rows (binary digits of the count, largest first): TMA
                        # boxes have static shapes (jax's ragged_dot_mgpu stores its partial tiles the same way).
                        off = w_lo - r0
                        cols = pl.ds(ni * bn, bn)
                        p = hm
                        while p >= 1:
                            @pl.when((live & p) != 0)
                            def _(p=p, off=off):
                                plgpu.copy_smem_to_gmem(out_smem.at[wg, pl.ds(off, p)],
                                                        out_ref.at[pl.ds(r0 + off, p), cols])
                            off = off + (live & p)
                            p //= 2
                    return c_end
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scope,
            lhs_smem=plgpu.SMEM((stages, bm, bk), lhs.dtype, transforms=mosaic_smem_transforms(bk, itemsize)),
            rhs_smem=(plgpu.SMEM((stages, bn, bk), lhs.dtype, transforms=mosaic_smem_transforms(bk, itemsize))
                      if transpose_rhs else
                      plgpu.SMEM((stages, bk, bn), lhs.dtype, transforms=mosaic_smem_transforms(bn, itemsize))),
            out_smem=plgpu.SMEM((2, hm, bn), out_dtype),          # unswizzled: row slices at any offset
            produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            collective_axes="wg",
        )

    num_sms = cfg.num_sms or getattr(jax.devices()[0], "core_count", None)
    if not num_sms:
        raise ValueError(f"gmm_ws: {jax.devices()[0].device_kind} reports no SM count; pass WsGmmConfig(num_sms=...)")
    kernel = plgpu.kernel(
        body,
        out_type=typed_out_struct((m_pad, ndim), out_dtype, lhs),
        grid=(num_sms,), grid_names=("sm",),
        num_threads=3, thread_name="wg", kernel_name="gmm_t_ws" if transpose_rhs else "gmm_ws",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params,
    )
    # plgpu.kernel types its output invariant inside shard_map (gpu_tgmm_ws): retype it like lhs.
    out = match_vma(kernel(tab, lhs, rhs), lhs)
    return out if m_pad == m else out[:m]
