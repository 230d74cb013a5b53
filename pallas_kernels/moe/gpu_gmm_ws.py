"""Grouped matmul forward (and its transposed form for the input gradient) on Hopper: a warp-specialized,
persistent Pallas Mosaic GPU kernel.

Math: ``out[rows of g] = lhs[rows of g] @ rhs[g]`` (``transpose_rhs``: ``@ rhs[g]^T``), the forward and dlhs
of MegaBlocks' grouped GEMM (Gale et al. 2022, arXiv 2211.15841); same contract as ``gpu_gmm.gmm_forward``
(rows sorted by group, rows past ``sum(group_sizes)`` stored as exact zeros), fp32 accumulation.

Why a second forward: the Triton kernel (``gpu_gmm._gmm_kernel``) runs one program per output tile, each
filling and draining its own software pipeline over K; at ~256 rows per expert (M2 / M3, 8K tokens per
step) that is a few tiles per expert. This kernel keeps the loads streaming across tiles, as
``gpu_tgmm_ws`` does for the weight gradient:

- one CTA per SM (``plgpu.kernel`` grid = SM count) walks the output tiles (visit, N tile), N tile fastest
  (``plgpu.nd_loop``); a visit is up to ``block_m`` rows of one group, from XLA (``ws_visits``);
- three warpgroups: a memory warpgroup issues TMA loads of the ``[block_m, block_k]`` lhs block and the
  ``[block_k, block_n]`` weight block (``[block_n, block_k]`` transposed) into a ring of ``stages`` SMEM
  slots with one running slot counter across all tiles of the CTA (the next tile's loads are in flight
  during this tile's epilogue); two compute warpgroups own 64 rows each: ``wgmma`` of their rows of the
  lhs block with the whole weight block into a ``[64, block_n]`` fp32 accumulator, releasing each slot one
  step later (``wgmma_wait(1)``);
- ragged rows: TMA row offsets into 8-row tiled SMEM must be multiples of 8, so a group's visits start at
  the row ``8 * floor(start / 8)`` and cover ``block_m`` rows from there; rows of other groups in the
  block are computed and never stored (a row's output depends on that row alone: nothing leaks). The
  epilogue converts the accumulator into an untiled SMEM tile and stores exactly the visit's live rows
  with TMA stores of 64, 32, ..., 1 rows (a binary ladder of static box sizes, as JAX's
  ``ragged_dot_mgpu`` does); visits of the rows past the group sum store zeros without a K loop.

Requirements (ValueError / TypeError otherwise, never a silent fallback): bf16 / f16 operands of one dtype
(Hopper's ``wgmma`` of fp32 is TF32), K % block_k == 0 and N % block_n == 0.
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

__all__ = ["WsGmmConfig", "WS_GMM_CANDIDATES", "ws_visits", "gmm_ws"]

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_WG_ROWS = 64                     # rows per compute warpgroup (one wgmma M)


@dataclasses.dataclass(frozen=True)
class WsGmmConfig:
    """Tiles of ``gmm_ws``: output tile ``[128, block_n]`` (two compute warpgroups of 64 rows), contraction
    step ``block_k``, ``stages`` SMEM slots. block_k: 64 or 128; block_n: 128 or 256 (at most 128 fp32
    accumulator registers per thread). num_sms: CTAs (default: the device's SM count). Raises ValueError for
    other values or a ring plus epilogue tiles over 227 KiB of shared memory."""
    block_k: int = 64
    block_n: int = 256
    stages: int = 3
    num_sms: int | None = None

    block_m = 2 * _WG_ROWS

    def __post_init__(self):
        check_config(self, {"block_k": (64, 128), "block_n": (128, 256)}, self.smem_bytes(2))

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory of the ring (lhs + weight blocks per stage) plus the two epilogue tiles."""
        ring = self.stages * self.block_k * (self.block_m + self.block_n) * itemsize
        return ring + self.block_m * self.block_n * itemsize

    def label(self) -> str:
        """Short name, e.g. ``ws128x64x256s3``."""
        return f"ws{self.block_m}x{self.block_k}x{self.block_n}s{self.stages}"


#: Candidates for a sweep (bench/moe.py's tile sweep on a GPU, fwd and dlhs), none measured yet.
WS_GMM_CANDIDATES = (
    WsGmmConfig(64, 256, 3),
    WsGmmConfig(64, 256, 2),
    WsGmmConfig(64, 128, 5),
    WsGmmConfig(64, 128, 4),
    WsGmmConfig(128, 128, 2),
)


def ws_visits(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """Work list of ``gmm_ws`` (XLA): int32 ``[4, V]``, column v = ``(group, row0, lo, hi)``: the visit's
    block holds rows ``[row0, row0 + block_m)`` (``row0`` a multiple of 8) and stores rows ``[row0 + lo,
    row0 + hi)`` of ``group`` (``group == G``: the rows past the group sum, stored as zeros); unused visits
    have ``lo == hi == 0``. ``V = cdiv(m + 8 (G + 1), block_m) + G + 1`` bounds the visits of any sizes;
    every row in ``[0, m)`` is stored by exactly one visit. Sizes clipped to ``m`` as ``gpu_gmm``."""
    g = group_sizes.shape[0]
    starts, sizes = group_bounds(group_sizes, m)
    total = jnp.sum(sizes)
    starts = jnp.concatenate([starts, total[None]]).astype(jnp.int32)
    sizes = jnp.concatenate([sizes, (m - total)[None]]).astype(jnp.int32)
    a0 = starts - starts % 8
    lo = starts - a0
    blocks = jnp.where(sizes > 0, (lo + sizes + block_m - 1) // block_m, 0)
    vend = jnp.cumsum(blocks)
    vstart = vend - blocks
    n_vis = -(-(m + 8 * (g + 1)) // block_m) + g + 1
    v = jnp.arange(n_vis, dtype=jnp.int32)
    grp = searchsorted(vend, v, side="right")
    valid = grp <= g
    gc = jnp.minimum(grp, g)
    s = v - vstart[gc]
    row0 = a0[gc] + s * block_m
    v_lo = jnp.clip(lo[gc] - s * block_m, 0, block_m)
    v_hi = jnp.clip(lo[gc] + sizes[gc] - s * block_m, 0, block_m)
    return jnp.stack([gc, jnp.where(valid, row0, 0), jnp.where(valid, v_lo, 0),
                      jnp.where(valid, v_hi, 0)]).astype(jnp.int32)


def gmm_ws(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
           config: WsGmmConfig | None = None, out_dtype=None, interpret: bool = False) -> jax.Array:
    """Grouped matmul ``out[rows of g] = lhs[rows of g] @ op(rhs[g])`` (warp-specialized Mosaic GPU; no autodiff).

    Args:
      lhs: ``[M, K]`` bf16 / f16, rows sorted by group; rhs: ``[G, K, N]`` (``[G, N, K]`` with
        ``transpose_rhs``), same dtype; group_sizes: int ``[G]`` (negative sizes count as 0, the sum is
        clipped to M).
      config: ``WsGmmConfig`` (default ``WsGmmConfig()``); out_dtype: bf16 / f16 (default lhs.dtype).
      interpret: the Mosaic GPU interpreter (jax >= 0.11; tests). On a CPU pass ``config.num_sms``.
    Returns: ``[M, N]`` in out_dtype, fp32 accumulation; rows past the sum are exactly 0.
    Raises: ValueError on shapes (ranks, contraction, K % block_k, N % block_n) or a device without an SM count
      and no ``config.num_sms``; TypeError on dtypes or config; NotImplementedError for ``interpret=True``
      on a jax without the Mosaic GPU interpreter.
    Math: MegaBlocks (Gale et al. 2022) grouped GEMM; kernel layout in the module docstring.
    """
    cfg = config or WsGmmConfig()
    if not isinstance(cfg, WsGmmConfig):
        raise TypeError(f"config must be a WsGmmConfig, got {type(cfg).__name__}")
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1 or group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"gmm_ws expects lhs [M, K], rhs [G, K, N] and group_sizes [G]; got {lhs.shape}, "
                         f"{rhs.shape}, {group_sizes.shape}")
    m, kdim = lhs.shape
    ndim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if kdim != (rhs.shape[2] if transpose_rhs else rhs.shape[1]):
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
    num_sms = cfg.num_sms or getattr(jax.devices()[0], "core_count", None)
    if not num_sms:
        raise ValueError(f"gmm_ws: {jax.devices()[0].device_kind} reports no SM count; pass WsGmmConfig(num_sms=...)")
    g = rhs.shape[0]
    m_pad = -(-m // 8) * 8
    if m_pad != m:    # Mosaic GPU: a dimension tiled by 8 rows must be a multiple of 8 (zero rows, stored nowhere)
        lhs = jnp.pad(lhs, ((0, m_pad - m), (0, 0)))
    tab = ws_visits(group_sizes, m, bm)
    nk, nn = kdim // bk, ndim // bn
    num_tiles = tab.shape[1] * nn
    itemsize = jnp.dtype(lhs.dtype).itemsize

    def body(tab_ref, lhs_ref, rhs_ref, out_ref):
        def visit(t):
            """(group, row0, lo, hi, N tile, K steps) of tile t: N tile fastest."""
            v = lax.div(t, nn)
            gi, row0, lo, hi = (tab_ref[i, v] for i in range(4))
            steps = jnp.where((gi < g) & (hi > lo), nk, 0)
            return gi, row0, lo, hi, t - v * nn, steps

        def scope(lhs_smem, rhs_smem, out_smem, produced, consumed):
            wg = lax.axis_index("wg")

            @pl.when(wg == 2)
            def _memory():
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

                @over_tiles(num_tiles, visit)
                def used(gi, row0, lo, hi, ni, steps, carry):
                    def load(s, slot, barrier):
                        ks = pl.ds(pl.multiple_of(s * bk, bk), bk)
                        plgpu.copy_gmem_to_smem(lhs_ref.at[pl.ds(pl.multiple_of(row0, 8), bm), ks], lhs_smem.at[slot],
                                                barrier)
                        cols = pl.ds(pl.multiple_of(ni * bn, bn), bn)
                        src = rhs_ref.at[gi, cols, ks] if transpose_rhs else rhs_ref.at[gi, ks, cols]
                        plgpu.copy_gmem_to_smem(src, rhs_smem.at[slot], barrier)
                    return fill_steps(produced, consumed, stages, steps, carry, load)
                drain_steps(consumed, stages, used)

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

                @over_tiles(num_tiles, visit)
                def _tiles(gi, row0, lo, hi, ni, steps, carry):
                    def acc_scope(acc_ref):
                        def mma(s, slot):
                            w_ref = rhs_smem.at[slot]
                            plgpu.wgmma(acc_ref, lhs_smem.at[slot, pl.ds(wg * _WG_ROWS, _WG_ROWS)],
                                        w_ref.transpose((1, 0)) if transpose_rhs else w_ref)
                        c_end = mma_steps(produced, consumed, stages, steps, carry, mma)
                        return acc_ref[...], c_end

                    acc, c_end = pl.run_scoped(acc_scope, plgpu.ACC((_WG_ROWS, bn), jnp.float32))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)      # the previous tile's stores read its SMEM
                    o_smem = out_smem.at[wg]
                    o_smem[...] = acc.astype(out_dtype)
                    plgpu.commit_smem()
                    # this warpgroup's live rows [a, b) of its 64, stored by a ladder of static TMA box heights
                    a = jnp.clip(lo - wg * _WG_ROWS, 0, _WG_ROWS)
                    n = jnp.clip(hi - wg * _WG_ROWS, 0, _WG_ROWS) - a
                    off = a
                    for h in (64, 32, 16, 8, 4, 2, 1):
                        @pl.when((n & h) != 0)
                        def _(h=h, off=off):
                            plgpu.copy_smem_to_gmem(
                                o_smem.at[pl.ds(off, h)],
                                out_ref.at[pl.ds(row0 + wg * _WG_ROWS + off, h), pl.ds(pl.multiple_of(ni * bn, bn), bn)])
                        off = off + (n & h)
                    return c_end
                plgpu.wait_smem_to_gmem(0)

        w_shape = (stages, bn, bk) if transpose_rhs else (stages, bk, bn)
        pl.run_scoped(
            scope,
            lhs_smem=plgpu.SMEM((stages, bm, bk), lhs.dtype, transforms=mosaic_smem_transforms(bk, itemsize)),
            rhs_smem=plgpu.SMEM(w_shape, lhs.dtype, transforms=mosaic_smem_transforms(w_shape[-1], itemsize)),
            out_smem=plgpu.SMEM((2, _WG_ROWS, bn), out_dtype),     # untiled: stores start at any row
            produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            collective_axes="wg",
        )

    kernel = plgpu.kernel(
        body,
        out_type=typed_out_struct((m, ndim), out_dtype, lhs),
        grid=(num_sms,), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params,
    )
    # Inside shard_map plgpu.kernel returns its output typed invariant; its data varies like lhs (as tgmm_ws).
    return match_vma(kernel(tab, lhs, rhs), lhs)
